//! Paged KV cache of one stage: fixed-size blocks shared by all of the stage's layers, a free list, a
//! block table per sequence, and the prefix cache: full blocks kept under a key the coordinator chose (the hash
//! chain of their tokens) so that later sequences starting with the same tokens reuse them.
//!
//! A block is free when nothing references it: each sequence whose table holds it counts once, and being cached
//! counts once. The coordinator decides every cache change (publish, attach, evict), so all stages agree.

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
    /// References per block (sequences holding it, plus one while it is cached).
    refs: Vec<u32>,
    /// Cached blocks by key.
    cached: HashMap<u64, u32>,
    /// Whether each block is cached.
    is_cached: Vec<bool>,
    /// Cached blocks no sequence holds: free as soon as the coordinator evicts them.
    idle_cached: usize,
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
            refs: vec![0; num_blocks],
            cached: HashMap::new(),
            is_cached: vec![false; num_blocks],
            idle_cached: 0,
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
                self.refs[b as usize] = 1;
                t.blocks.push(b);
            }
        }
        t.len = start_pos + new_tokens;
        Ok(())
    }

    /// Frees a sequence's blocks (cached ones stay cached); unknown sequences are ignored (release is
    /// idempotent).
    pub fn release(&mut self, seq: u64) {
        if let Some(t) = self.tables.remove(&seq) {
            for b in t.blocks.into_iter().rev() {
                self.unref(b);
            }
        }
    }

    fn unref(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        *r = r.saturating_sub(1);
        match *r {
            0 => self.free.push(block),
            1 if self.is_cached[block as usize] => self.idle_cached += 1,
            _ => {}
        }
    }

    /// Starts `seq` on the cached blocks `keys`, in position order, as its first `keys.len() × block_size`
    /// positions. Nothing changes when it fails: the sequence exists already, or a key is not cached (the
    /// coordinator's view of the cache and this stage's differ).
    pub fn attach(&mut self, seq: u64, keys: &[u64]) -> Result<()> {
        if self.tables.contains_key(&seq) {
            return Err(Error::InvalidRequest(format!(
                "sequence {seq} exists; cached blocks start new sequences only"
            )));
        }
        let blocks = keys
            .iter()
            .map(|k| {
                self.cached.get(k).copied().ok_or_else(|| Error::PrefixCache(format!("block {k:#018x} is not cached")))
            })
            .collect::<Result<Vec<u32>>>()?;
        for &b in &blocks {
            if self.refs[b as usize] == 1 {
                self.idle_cached -= 1;
            }
            self.refs[b as usize] += 1;
        }
        self.tables.insert(seq, BlockTable { len: blocks.len() * self.block_size, blocks });
        Ok(())
    }

    /// Whether `keys` are all cached, so that [`KvCache::attach`] of them succeeds.
    pub fn has_cached(&self, keys: &[u64]) -> bool {
        keys.iter().all(|k| self.cached.contains_key(k))
    }

    /// Caches block `index` of `seq` (which must be full) under `key`. A key that is cached already, or a block
    /// that is, is an error: the coordinator publishes each key once.
    pub fn publish(&mut self, seq: u64, index: usize, key: u64) -> Result<()> {
        let t = self.tables.get(&seq).ok_or_else(|| Error::PrefixCache(format!("sequence {seq} is not here")))?;
        let block = match t.blocks.get(index) {
            Some(&b) if (index + 1) * self.block_size <= t.len => b,
            _ => {
                return Err(Error::PrefixCache(format!(
                    "sequence {seq} has {} positions; block {index} is not full",
                    t.len
                )));
            }
        };
        if self.cached.contains_key(&key) || self.is_cached[block as usize] {
            return Err(Error::PrefixCache(format!("block {index} of sequence {seq} or key {key:#018x} is cached")));
        }
        self.cached.insert(key, block);
        self.is_cached[block as usize] = true;
        self.refs[block as usize] += 1;
        Ok(())
    }

    /// Drops `key` from the cache; its block is freed once no sequence holds it. Unknown keys are ignored.
    pub fn evict(&mut self, key: u64) {
        if let Some(b) = self.cached.remove(&key) {
            self.is_cached[b as usize] = false;
            if self.refs[b as usize] == 1 {
                self.idle_cached -= 1;
            }
            self.unref(b);
        }
    }

    /// Drops every cached block.
    pub fn clear_prefix_cache(&mut self) {
        let keys: Vec<u64> = self.cached.keys().copied().collect();
        for k in keys {
            self.evict(k);
        }
    }

    /// Blocks in the prefix cache (free once evicted, unless a sequence holds them too).
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks no sequence holds: free blocks for everyone but this stage, which waits for the coordinator
    /// to evict them.
    pub fn idle_cached_blocks(&self) -> usize {
        self.idle_cached
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
    fn cached_blocks_outlive_their_sequence_and_are_shared_until_evicted() -> Result<()> {
        let be = CpuBackend::new(1)?;
        let mut kv = KvCache::new(&be, 1, 6, 4, 8, KvDtype::F32)?;
        kv.reserve(1, 0, 10)?; // 3 blocks, 2 full
        assert!(kv.publish(1, 2, 0xc).is_err(), "block 2 is not full");
        kv.publish(1, 0, 0xa)?;
        kv.publish(1, 1, 0xb)?;
        assert!(kv.publish(1, 1, 0xd).is_err(), "a block is cached once");
        let first_two = kv.table(1).map(|t| t.blocks[..2].to_vec());
        assert_eq!(kv.idle_cached_blocks(), 0, "the sequence holds them");
        kv.release(1);
        assert_eq!((kv.free_blocks(), kv.cached_blocks(), kv.idle_cached_blocks()), (4, 2, 2));
        assert!(kv.attach(2, &[0xa, 0xe]).is_err(), "an unknown key attaches nothing");
        assert_eq!(kv.seq_len(2), 0);
        kv.attach(2, &[0xa, 0xb])?;
        kv.attach(3, &[0xa])?;
        assert_eq!(kv.table(2).map(|t| t.blocks.clone()), first_two);
        assert_eq!((kv.seq_len(2), kv.seq_len(3)), (8, 4));
        assert_eq!(kv.idle_cached_blocks(), 0);
        assert!(kv.reserve(2, 0, 1).is_err(), "a sequence continues after its cached blocks");
        kv.reserve(2, 8, 1)?;
        kv.reserve(3, 4, 1)?;
        assert_eq!(kv.free_blocks(), 2);
        kv.evict(0xa);
        kv.evict(0xb);
        assert_eq!((kv.free_blocks(), kv.cached_blocks()), (2, 0), "the sequences still hold a and b");
        kv.release(2);
        assert_eq!(kv.free_blocks(), 4, "b and 2's own block are free, 3 still holds a");
        assert_eq!(kv.idle_cached_blocks(), 0);
        kv.release(3);
        assert_eq!(kv.free_blocks(), 6);
        kv.reserve(4, 0, 8)?;
        kv.publish(4, 0, 0xa)?;
        kv.publish(4, 1, 0xb)?;
        kv.release(4);
        assert_eq!(kv.idle_cached_blocks(), 2);
        kv.attach(5, &[0xa])?;
        assert_eq!(kv.idle_cached_blocks(), 1);
        kv.clear_prefix_cache();
        assert_eq!((kv.idle_cached_blocks(), kv.free_blocks()), (0, 5));
        kv.release(5);
        assert_eq!((kv.free_blocks(), kv.cached_blocks()), (6, 0));
        Ok(())
    }

    #[test]
    fn rejects_gaps_in_positions() {
        let be = CpuBackend::new(1).expect("backend");
        let mut kv = KvCache::new(&be, 1, 4, 16, 8, KvDtype::F32).expect("kv");
        assert!(kv.reserve(7, 3, 1).is_err());
    }
}
