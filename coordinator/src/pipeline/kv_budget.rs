//! The coordinator's mirror of the KV cache of the smallest stage: admission and preemption decide with it, so
//! stages should never run out of blocks (and when one does anyway, the batch is preempted, not failed).

use strata_proto::{ServiceError, pb};

/// KV blocks of the tightest stage, counted in blocks of the largest block size any stage uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KvBudget {
    block_size: usize,
    total: usize,
    used: usize,
    /// Blocks of finished or preempted sequences whose `Release` has not yet returned: still held on the stages.
    releasing: usize,
    /// Every stage uses `block_size`, so a block here is a block on each stage (prefix caching needs that).
    uniform: bool,
    /// Every stage's results are independent of batching, so prefix caching changes no token.
    batch_invariant: bool,
}

impl KvBudget {
    /// A budget of `total` blocks of `block_size` tokens.
    pub(crate) fn new(block_size: usize, total: usize) -> Self {
        Self { block_size: block_size.max(1), total, used: 0, releasing: 0, uniform: true, batch_invariant: true }
    }

    /// The budget the stages' statuses allow: the smallest capacity in tokens, in blocks of the largest block
    /// size (so a sequence that fits here fits on every stage).
    pub(crate) fn from_statuses(statuses: &[pb::StageStatus]) -> Result<Self, ServiceError> {
        let block_size = statuses.iter().map(|s| s.block_size as usize).max().unwrap_or(0);
        if statuses.is_empty() || block_size == 0 {
            return Err(ServiceError::unavailable("no stage reported its KV cache"));
        }
        let tokens = statuses
            .iter()
            .map(|s| usize::try_from(s.kv_total_blocks).unwrap_or(usize::MAX).saturating_mul(s.block_size as usize))
            .min()
            .unwrap_or(0);
        let uniform = statuses.iter().all(|s| s.block_size as usize == block_size);
        let batch_invariant = statuses.iter().all(|s| s.batch_invariant);
        Ok(Self { uniform, batch_invariant, ..Self::new(block_size, tokens / block_size) })
    }

    /// Whether every stage computes each token the same however tokens are batched.
    pub(crate) fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    /// Whether every stage's blocks are this budget's blocks.
    pub(crate) fn uniform(&self) -> bool {
        self.uniform
    }

    /// `n` cached blocks were evicted: their space is free (the stages drop them before the next batch runs).
    pub(crate) fn evicted(&mut self, n: usize) {
        self.used = self.used.saturating_sub(n);
    }

    /// Blocks needed to hold `tokens` positions.
    pub(crate) fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Total blocks.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Tokens per block.
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks neither held by a sequence nor waiting for a `Release` to finish.
    pub(crate) fn free(&self) -> usize {
        self.total.saturating_sub(self.used + self.releasing)
    }

    /// Grows a sequence holding `held` blocks to cover `tokens` positions; false (and no change) when the free
    /// blocks do not suffice.
    pub(crate) fn grow(&mut self, held: &mut usize, tokens: usize) -> bool {
        let need = self.blocks_for(tokens).saturating_sub(*held);
        if need > self.free() {
            return false;
        }
        self.used += need;
        *held += need;
        true
    }

    /// A sequence's `held` blocks are being released; they stay counted until [`KvBudget::released`].
    pub(crate) fn release(&mut self, held: &mut usize) {
        let n = std::mem::take(held).min(self.used);
        self.used -= n;
        self.releasing += n;
    }

    /// A `Release` of `n` blocks finished on every stage.
    pub(crate) fn released(&mut self, n: usize) {
        self.releasing = self.releasing.saturating_sub(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(blocks: u64, block_size: u32) -> pb::StageStatus {
        pb::StageStatus { kv_total_blocks: blocks, block_size, ..Default::default() }
    }

    #[test]
    fn the_smallest_stage_sets_the_budget() -> Result<(), ServiceError> {
        let b = KvBudget::from_statuses(&[status(64, 16), status(40, 16), status(100, 16)])?;
        assert_eq!((b.total(), b.block_size()), (40, 16));
        // Mixed block sizes: 30 blocks of 32 tokens = 960 tokens is the least; counted in 32-token blocks.
        let b = KvBudget::from_statuses(&[status(64, 16), status(30, 32)])?;
        assert_eq!((b.total(), b.block_size()), (30, 32));
        assert!(!b.uniform(), "mixed block sizes");
        assert!(KvBudget::from_statuses(&[status(64, 16), status(40, 16)])?.uniform());
        assert!(KvBudget::from_statuses(&[]).is_err());
        assert!(KvBudget::from_statuses(&[status(10, 0)]).is_err());
        Ok(())
    }

    #[test]
    fn blocks_are_held_until_their_release_returns() {
        let mut b = KvBudget::new(4, 10);
        let (mut a, mut c) = (0, 0);
        assert!(b.grow(&mut a, 9)); // 3 blocks
        assert_eq!((a, b.free()), (3, 7));
        assert!(b.grow(&mut a, 12)); // still 3 blocks
        assert_eq!(a, 3);
        assert!(b.grow(&mut c, 28)); // 7 blocks
        assert!(!b.grow(&mut c, 29), "no 11th block");
        assert_eq!((c, b.free()), (7, 0));
        b.release(&mut a);
        assert_eq!((a, b.free()), (0, 0), "released blocks are still held by the stages");
        b.released(3);
        assert_eq!(b.free(), 3);
        assert!(b.grow(&mut c, 29));
        assert_eq!(b.free(), 2);
    }
}
