//! Prefix caching, the policy: which full KV blocks the stages keep after their sequence ends, under what key,
//! which sequences use them, and which to evict. Pure state, like the scheduler that drives it:
//! - a sequence about to prefill is matched against the cache ([`PrefixCache::lookup`]) and starts after the
//!   blocks it shares with earlier prompts;
//! - the chunk that fills a block publishes that block under its key ([`PrefixCache::publish`]): blocks of the
//!   prompt, and blocks of the output as decoding fills them ([`PrefixCache::extend`]), so a chat's next turn,
//!   whose prompt repeats this one's prompt and answer, starts after both;
//! - when a sequence's `Release` has returned from every stage its blocks lose a reference
//!   ([`PrefixCache::unref`]); a block no sequence uses stays cached until the budget needs the room, and then
//!   goes least recently used first, the end of a chain before its start ([`PrefixCache::evict_one`]).
//!
//! Keys are a hash chain: a block's key hashes the key before it and its own tokens, so equal keys mean equal
//! prompts up to the block's end. The cache also keeps each block's tokens and parent and compares them on a
//! match, so a hash collision costs a miss, never a wrong answer. Stages learn every change with the next batch
//! (the batch carries evictions, and its chunks attachments and publications), so all stages hold the same
//! blocks; a new budget starts an empty cache and the first batch after it clears the stages' caches.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

/// One cached block.
struct Entry {
    parent: u64,
    tokens: Box<[u32]>,
    /// Blocks before it in its chain: evicting deeper blocks first keeps chains' shared starts.
    depth: usize,
    /// Sequences using it (their `Release` not yet returned).
    refs: u32,
    /// When its last user released it ([`PrefixCache::idle`] order).
    idle_since: u64,
}

/// A sequence's part in the cache, kept by the scheduler with the sequence.
#[derive(Debug, Default)]
pub(super) struct SeqPrefix {
    /// Its tokens so far (the ones it prefills, then each one it decodes), and the keys of their full blocks.
    keys: Vec<u64>,
    tokens: Vec<u32>,
    /// Blocks of `keys` already matched or published (or skipped: cached by another sequence meanwhile).
    done: usize,
    /// Cached blocks it uses: they are in its block table on the stages, but the cache owns them.
    refs: Vec<u64>,
    /// Cached blocks its first chunk starts on, and their tokens, until that chunk is built.
    attach: Vec<u64>,
    attach_tokens: Vec<u32>,
    /// Matched against the cache since it was (re)queued.
    looked_up: bool,
    /// What that match found, counted once the sequence runs on it ([`SeqPrefix::take_found`]).
    found: PrefixStats,
}

impl SeqPrefix {
    /// Whether it was matched against the cache since it was (re)queued.
    pub(super) fn looked_up(&self) -> bool {
        self.looked_up
    }

    /// Blocks of its table that the cache owns rather than the sequence.
    pub(super) fn shared(&self) -> usize {
        self.refs.len()
    }

    /// The cached blocks its first chunk starts on, and their tokens, once.
    pub(super) fn take_attach(&mut self) -> (Vec<u64>, Vec<u32>) {
        (std::mem::take(&mut self.attach), std::mem::take(&mut self.attach_tokens))
    }

    /// What its match found, once: a waiting sequence may give its blocks back and be matched again, so a match
    /// counts when the sequence runs on it.
    pub(super) fn take_found(&mut self) -> PrefixStats {
        std::mem::take(&mut self.found)
    }

    /// Ends its part: the cached blocks it used, to [`PrefixCache::unref`] once its `Release` returns.
    pub(super) fn take_refs(&mut self) -> Vec<u64> {
        let refs = std::mem::take(&mut self.refs);
        *self = SeqPrefix::default();
        refs
    }
}

/// Prompt tokens looked up and found, since the coordinator started.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefixStats {
    /// Tokens of prompts (and recomputes) matched against the cache, counted when the sequence runs on the match.
    pub(crate) queried_tokens: u64,
    /// Of those, tokens found cached and not computed again.
    pub(crate) hit_tokens: u64,
}

/// The coordinator's view of the blocks cached on every stage.
pub(super) struct PrefixCache {
    block_size: usize,
    /// Mixed into every key, so keys of different plans differ.
    seed: u64,
    entries: HashMap<u64, Entry>,
    /// Unused blocks, in eviction order: longest idle first, deepest first among equals.
    idle: BTreeSet<(u64, Reverse<usize>, u64)>,
    clock: u64,
    /// Evicted keys the stages have not been told of yet.
    evicted: Vec<u64>,
    /// The stages' caches are to be cleared with the next batch.
    clear: bool,
}

impl PrefixCache {
    /// An empty cache of blocks of `block_size` tokens for plan `epoch`; the stages' caches are cleared with the
    /// next batch.
    pub(super) fn new(block_size: usize, epoch: u64) -> Self {
        PrefixCache {
            block_size: block_size.max(1),
            seed: epoch,
            entries: HashMap::new(),
            idle: BTreeSet::new(),
            clock: 0,
            evicted: Vec::new(),
            clear: true,
        }
    }

    fn key(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        (self.seed, parent, tokens).hash(&mut h);
        h.finish()
    }

    /// Starts a sequence that prefills `tokens` from position 0: finds the cached blocks its prompt starts with,
    /// leaving at least one token to compute (its logits are sampled), and takes a reference on each. Returns
    /// the positions found.
    pub(super) fn lookup(&mut self, seq: &mut SeqPrefix, tokens: &[u32]) -> usize {
        let bs = self.block_size;
        let mut keys = Vec::with_capacity(tokens.len() / bs);
        self.key_full_blocks(&mut keys, tokens);
        let reusable = tokens.len().saturating_sub(1) / bs;
        let mut hits = 0;
        while hits < reusable {
            let parent = if hits == 0 { 0 } else { keys[hits - 1] };
            let block = &tokens[hits * bs..(hits + 1) * bs];
            match self.entries.get_mut(&keys[hits]) {
                Some(e) if e.parent == parent && *e.tokens == *block => {
                    if e.refs == 0 {
                        self.idle.remove(&(e.idle_since, Reverse(e.depth), keys[hits]));
                    }
                    e.refs += 1;
                    hits += 1;
                }
                _ => break,
            }
        }
        *seq = SeqPrefix {
            found: PrefixStats { queried_tokens: tokens.len() as u64, hit_tokens: (hits * bs) as u64 },
            refs: keys[..hits].to_vec(),
            attach: keys[..hits].to_vec(),
            attach_tokens: tokens[..hits * bs].to_vec(),
            done: hits,
            tokens: tokens.to_vec(),
            keys,
            looked_up: true,
        };
        hits * bs
    }

    /// A chunk of `seq` carries `tokens` from position `start`: those past what the sequence knew (the tokens it
    /// decodes) join its tokens, and every block they fill gets its key, to be published like a prompt's.
    pub(super) fn extend(&self, seq: &mut SeqPrefix, start: usize, tokens: &[u32]) {
        let known = seq.tokens.len();
        // Chunks follow each other: a gap would be a scheduler bug, and caching after it would be wrong.
        if !seq.looked_up || start > known || start + tokens.len() <= known {
            return;
        }
        seq.tokens.extend_from_slice(&tokens[known - start..]);
        self.key_full_blocks(&mut seq.keys, &seq.tokens);
    }

    /// Appends to `keys` (the chain of `tokens`' first blocks) the keys of the full blocks of `tokens` after them.
    fn key_full_blocks(&self, keys: &mut Vec<u64>, tokens: &[u32]) {
        let mut parent = keys.last().copied().unwrap_or(0);
        for block in tokens.chunks_exact(self.block_size).skip(keys.len()) {
            parent = self.key(parent, block);
            keys.push(parent);
        }
    }

    /// The chunk of `seq` ending at position `end` was built: every block of its tokens that is full by then
    /// and not cached yet becomes cached, owned by the cache and used by `seq`. Returns (block index, key) of
    /// each, for the chunk to carry.
    pub(super) fn publish(&mut self, seq: &mut SeqPrefix, end: usize) -> Vec<(usize, u64)> {
        let full = (end / self.block_size).min(seq.keys.len());
        let mut published = Vec::new();
        for i in seq.done..full {
            let key = seq.keys[i];
            if self.entries.contains_key(&key) {
                // Cached by a sequence that ran beside this one (or a collision): this block stays its own.
                continue;
            }
            let tokens = seq.tokens[i * self.block_size..(i + 1) * self.block_size].into();
            let parent = if i == 0 { 0 } else { seq.keys[i - 1] };
            self.entries.insert(key, Entry { parent, tokens, depth: i, refs: 1, idle_since: 0 });
            seq.refs.push(key);
            published.push((i, key));
        }
        seq.done = seq.done.max(full);
        published
    }

    /// Of `keys` (published by a batch that failed), those `seq` published and no other sequence uses leave the
    /// cache, evicted by the next batch; returns how many, which go back to the sequence's own blocks.
    pub(super) fn unpublish(&mut self, seq: &mut SeqPrefix, keys: &[u64]) -> usize {
        let before = seq.refs.len();
        seq.refs.retain(|key| {
            let mine = keys.contains(key) && self.entries.get(key).is_some_and(|e| e.refs == 1);
            if mine {
                self.entries.remove(key);
                self.evicted.push(*key);
            }
            !mine
        });
        before - seq.refs.len()
    }

    /// A sequence that used `keys` is released on every stage: each block loses a reference, and one that no
    /// sequence uses becomes evictable.
    pub(super) fn unref(&mut self, keys: &[u64]) {
        // One tick for the release: its blocks idle together, and depth orders them.
        self.clock += 1;
        for &key in keys {
            let Some(e) = self.entries.get_mut(&key) else { continue };
            e.refs = e.refs.saturating_sub(1);
            if e.refs == 0 {
                e.idle_since = self.clock;
                self.idle.insert((e.idle_since, Reverse(e.depth), key));
            }
        }
    }

    /// Blocks no sequence uses: free for the budget's purposes, as eviction gets them back.
    pub(super) fn evictable(&self) -> usize {
        self.idle.len()
    }

    /// Cached blocks.
    pub(super) fn cached(&self) -> usize {
        self.entries.len()
    }

    /// Evicts the block unused for longest; false when every cached block is in use.
    pub(super) fn evict_one(&mut self) -> bool {
        let Some((_, _, key)) = self.idle.pop_first() else { return false };
        self.entries.remove(&key);
        self.evicted.push(key);
        true
    }

    /// What the next batch tells the stages before its chunks: clear the cache, and the keys evicted since.
    pub(super) fn take_orders(&mut self) -> (bool, Vec<u64>) {
        (std::mem::take(&mut self.clear), std::mem::take(&mut self.evicted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32) -> Vec<u32> {
        (0..n).map(|i| 1000 + i).collect()
    }

    #[test]
    fn a_prompt_reuses_the_published_blocks_of_an_earlier_one_and_computes_at_least_one_token() {
        let mut c = PrefixCache::new(4, 1);
        let mut a = SeqPrefix::default();
        assert_eq!(c.lookup(&mut a, &toks(10)), 0);
        // Chunked prefill: 6 tokens, then 4. Blocks publish as they fill.
        assert_eq!(c.publish(&mut a, 6).len(), 1);
        assert_eq!(c.publish(&mut a, 10).iter().map(|p| p.0).collect::<Vec<_>>(), [1]);
        assert_eq!((c.cached(), a.shared(), c.evictable()), (2, 2, 0));
        // A longer prompt with the same start matches both blocks; one of exactly 8 tokens matches one.
        let mut b = SeqPrefix::default();
        let mut prompt = toks(9);
        prompt.push(7);
        assert_eq!(c.lookup(&mut b, &prompt), 8);
        assert_eq!(b.take_attach().0.len(), 2);
        assert!(b.take_attach().0.is_empty(), "attached once");
        let mut d = SeqPrefix::default();
        assert_eq!(c.lookup(&mut d, &toks(8)), 4);
        // A different first block shares nothing, even with equal later tokens.
        let mut e = SeqPrefix::default();
        let mut other = toks(10);
        other[0] = 5;
        assert_eq!(c.lookup(&mut e, &other), 0);
        let found = [&mut a, &mut b, &mut d, &mut e].map(|s| s.take_found());
        let sum = |f: fn(&PrefixStats) -> u64| found.iter().map(f).sum::<u64>();
        assert_eq!((sum(|f| f.queried_tokens), sum(|f| f.hit_tokens)), (38, 12));
        assert_eq!(a.take_found(), PrefixStats::default(), "counted once");
        for s in [&mut a, &mut b, &mut d, &mut e] {
            let refs = s.take_refs();
            c.unref(&refs);
        }
        assert_eq!(c.evictable(), 2, "released blocks stay cached and evictable");
    }

    #[test]
    fn eviction_takes_the_longest_idle_block_and_the_end_of_a_chain_first() {
        let mut c = PrefixCache::new(2, 1);
        let (mut a, mut b) = (SeqPrefix::default(), SeqPrefix::default());
        c.lookup(&mut a, &toks(7));
        c.publish(&mut a, 7);
        let mut other = toks(5);
        other[0] = 1;
        c.lookup(&mut b, &other);
        c.publish(&mut b, 5);
        assert_eq!(c.cached(), 5);
        let a_keys = a.take_refs();
        c.unref(&a_keys);
        // `b` still uses its blocks: only `a`'s can go, the last of its chain first.
        assert!(c.evict_one());
        assert_eq!(c.take_orders(), (true, vec![a_keys[2]]));
        assert_eq!(c.take_orders(), (false, vec![]), "orders go out once");
        assert!(c.evict_one() && c.evict_one());
        assert!(!c.evict_one(), "blocks in use are never evicted");
        // A prompt whose chain start was evicted matches nothing.
        let mut d = SeqPrefix::default();
        assert_eq!(c.lookup(&mut d, &toks(7)), 0);
    }

    #[test]
    fn decoded_tokens_give_their_blocks_the_keys_a_prompt_of_them_gets() {
        let mut c = PrefixCache::new(4, 1);
        let mut decoded = SeqPrefix::default();
        c.lookup(&mut decoded, &toks(6));
        // Prefill chunks add nothing; decode steps (one token each) do; a gap or a repeat is ignored.
        c.extend(&mut decoded, 0, &toks(6));
        assert_eq!(decoded.tokens.len(), 6);
        c.extend(&mut decoded, 6, &[7]);
        c.extend(&mut decoded, 8, &[9]);
        c.extend(&mut decoded, 6, &[7]);
        c.extend(&mut decoded, 7, &[8]);
        assert_eq!(decoded.tokens[6..], [7, 8]);
        let mut whole = SeqPrefix::default();
        let mut prompt = toks(6);
        prompt.extend([7, 8]);
        c.lookup(&mut whole, &prompt);
        assert_eq!(decoded.keys, whole.keys);
        assert_eq!(decoded.keys.len(), 2);
        // A sequence never matched against the cache (caching was off when it started) keeps no tokens.
        let mut off = SeqPrefix::default();
        c.extend(&mut off, 0, &toks(8));
        assert!(off.tokens.is_empty() && off.keys.is_empty());
    }

    #[test]
    fn a_block_cached_meanwhile_by_another_sequence_is_not_published_twice() {
        let mut c = PrefixCache::new(4, 1);
        let (mut a, mut b) = (SeqPrefix::default(), SeqPrefix::default());
        c.lookup(&mut a, &toks(9));
        c.lookup(&mut b, &toks(9));
        assert_eq!(c.publish(&mut a, 9).len(), 2);
        assert!(c.publish(&mut b, 9).is_empty());
        assert_eq!((a.shared(), b.shared()), (2, 0));
        // Keys differ across plans.
        let mut e = SeqPrefix::default();
        let mut other_plan = PrefixCache::new(4, 2);
        other_plan.lookup(&mut e, &toks(9));
        assert_ne!(e.keys, a.keys);
    }
}
