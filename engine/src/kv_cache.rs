//! Paged KV cache of one stage: fixed-size blocks shared by all of the stage's layers, a free list, and
//! a block table per sequence.

use std::collections::HashMap;

use crate::backend::Backend;
use crate::{Error, KvDtype, Result};

/// A sequence's blocks and how many positions are filled.
#[derive(Debug, Clone, Default)]
pub struct BlockTable {
    /// Block ids in position order.
    pub blocks: Vec<u32>,
    /// Positions written so far.
    pub len: usize,
}

/// KV storage for a stage's layers plus the block bookkeeping.
pub struct KvCache<B: Backend> {
    /// Per-layer storage, indexed by layer offset within the stage.
    pub layers: Vec<B::KvLayer>,
    block_size: usize,
    num_blocks: usize,
    dtype: KvDtype,
    free: Vec<u32>,
    tables: HashMap<u64, BlockTable>,
}

impl<B: Backend> KvCache<B> {
    /// Allocates `num_blocks` blocks of `block_size` tokens for `layers` layers of width `kv_dim`, stored as
    /// `dtype`.
    pub fn new(
        backend: &B,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        dtype: KvDtype,
    ) -> Result<Self> {
        if block_size == 0 || num_blocks == 0 {
            return Err(Error::Config("KV cache needs at least one block of at least one token".into()));
        }
        let layers = (0..layers)
            .map(|_| backend.alloc_kv_layer(num_blocks, block_size, kv_dim, dtype))
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            block_size,
            num_blocks,
            dtype,
            free: (0..num_blocks as u32).rev().collect(),
            tables: HashMap::new(),
        })
    }

    /// Makes every page of the cache resident now rather than as sequences first write it, so memory the cache
    /// was sized for is taken (and counted) at start, and a machine that cannot give it fails then.
    pub fn prefault(&mut self, backend: &B) {
        for layer in &mut self.layers {
            backend.prefault_kv_layer(layer);
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The type keys and values are stored in.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks on the free list.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Positions already cached for a sequence (0 when unknown).
    pub fn seq_len(&self, seq: u64) -> usize {
        self.tables.get(&seq).map_or(0, |t| t.len)
    }

    /// The block table of a sequence.
    pub fn table(&self, seq: u64) -> Option<&BlockTable> {
        self.tables.get(&seq)
    }

    /// Makes room for `new_tokens` more positions of `seq` starting at `start_pos`, which must equal the
    /// positions already cached (a sequence is created at position 0). All-or-nothing.
    pub fn reserve(&mut self, seq: u64, start_pos: usize, new_tokens: usize) -> Result<()> {
        let have = self.tables.get(&seq).map_or(0, |t| t.len);
        if start_pos != have {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq}: chunk starts at position {start_pos} but {have} positions are cached"
            )));
        }
        let held = self.tables.get(&seq).map_or(0, |t| t.blocks.len());
        let needed = self.blocks_for(start_pos + new_tokens).saturating_sub(held);
        if needed > self.free.len() {
            return Err(Error::KvExhausted { needed, free: self.free.len() });
        }
        let t = self.tables.entry(seq).or_default();
        for _ in 0..needed {
            // The length check above guarantees the pop succeeds.
            if let Some(b) = self.free.pop() {
                t.blocks.push(b);
            }
        }
        t.len = start_pos + new_tokens;
        Ok(())
    }

    /// Frees a sequence's blocks; unknown sequences are ignored (release is idempotent).
    pub fn release(&mut self, seq: u64) {
        if let Some(t) = self.tables.remove(&seq) {
            self.free.extend(t.blocks.into_iter().rev());
        }
    }

    /// Sequences holding blocks.
    pub fn sequences(&self) -> impl Iterator<Item = u64> + '_ {
        self.tables.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn reserve_and_release_return_every_block() {
        let be = CpuBackend::new(1).expect("backend");
        let mut kv = KvCache::new(&be, 2, 4, 16, 8, KvDtype::F32).expect("kv");
        kv.reserve(1, 0, 20).expect("fits");
        assert_eq!(kv.free_blocks(), 2);
        kv.reserve(1, 20, 12).expect("fits in held block");
        assert_eq!(kv.free_blocks(), 2);
        let err = kv.reserve(2, 0, 49).expect_err("too big");
        assert!(matches!(err, Error::KvExhausted { needed: 4, free: 2 }));
        assert_eq!(kv.free_blocks(), 2, "failed reserve must not leak");
        kv.release(1);
        kv.release(1);
        assert_eq!(kv.free_blocks(), 4);
    }

    #[test]
    fn rejects_gaps_in_positions() {
        let be = CpuBackend::new(1).expect("backend");
        let mut kv = KvCache::new(&be, 1, 4, 16, 8, KvDtype::F32).expect("kv");
        assert!(kv.reserve(7, 3, 1).is_err());
    }
}
