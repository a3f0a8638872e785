//! Admission and KV growth: which waiting sequences join the running set, and how a step gets its blocks (evicting
//! unused cached blocks first, then preempting the youngest running sequence).

use super::{Effect, KvBudget, PrefixCache, RequestId, Requeue, Scheduler, Seq};

impl Scheduler {
    /// Moves waiting sequences into the running set, oldest first, while the KV cache has room for their first
    /// step.
    pub(super) fn promote(&mut self) {
        let Some(kv) = &mut self.kv else { return };
        let mut running = self.seqs.values().any(|s| s.running && !s.gone());
        // Headroom while others run, so the running set can grow a little before anyone is preempted.
        let watermark = kv.total().div_ceil(100);
        while let Some(&id) = self.waiting.front() {
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            if seq.gone() {
                self.waiting.pop_front();
                continue;
            }
            if let Some(prefix) = self.prefix.as_mut().filter(|_| seq.pos == 0 && !seq.prefix.looked_up()) {
                // It keeps the blocks found while it waits at the front of the queue, unless a running sequence
                // needs them ([`Scheduler::unpin_waiting`]).
                let hit = prefix.lookup(&mut seq.prefix, &seq.input);
                if seq.output.is_empty() {
                    seq.timing.cached_tokens = u32::try_from(hit).unwrap_or(u32::MAX);
                }
                seq.input.drain(..hit);
                seq.pos = u32::try_from(hit).unwrap_or(u32::MAX);
            }
            let first = seq.input.len().min(self.limits.max_batch_tokens);
            let need = kv.blocks_for(seq.pos as usize + first).saturating_sub(seq.table_blocks());
            let evictable = self.prefix.as_ref().map_or(0, PrefixCache::evictable);
            if running && kv.free() + evictable < need + watermark {
                break;
            }
            if !grow(kv, &mut self.prefix, seq, first) {
                break;
            }
            let found = seq.prefix.take_found();
            self.prefix_stats.queried_tokens += found.queried_tokens;
            self.prefix_stats.hit_tokens += found.hit_tokens;
            seq.running = true;
            running = true;
            self.waiting.pop_front();
        }
    }

    /// Reserves KV for the next step of `id` (at most `budget` tokens), preempting younger sequences when the
    /// cache is full; returns the step's length, or `None` when it cannot run now.
    pub(super) fn reserve(&mut self, id: RequestId, budget: usize, effects: &mut Vec<Effect>) -> Option<usize> {
        loop {
            let kv = self.kv.as_mut()?;
            let seq = self.seqs.get_mut(&id)?;
            if !seq.running || seq.in_flight || seq.gone() {
                return None;
            }
            let len = seq.input.len().min(budget);
            if len == 0 {
                return None;
            }
            if grow(kv, &mut self.prefix, seq, len) {
                // Claimed for this batch: nobody may preempt it now.
                seq.in_flight = true;
                return Some(len);
            }
            // The youngest running sequence not in flight, and only one younger than `id`.
            let victim = self
                .seqs
                .range(id..)
                .rev()
                .find(|(v, s)| **v != id && s.running && !s.in_flight && !s.gone())
                .map(|(v, _)| *v);
            match victim {
                Some(victim) => self.requeue(victim, Requeue::KvFull, effects),
                // No one to preempt, and blocks that waiting sequences found cached cannot be evicted while they
                // keep them; but they wait for this one to end: they let go, or neither would ever run.
                None if self.unpin_waiting() => {}
                None => return None,
            }
        }
    }

    /// Waiting sequences give back the cached blocks their match found (they are matched again when they reach
    /// the front of the queue), so that those no running sequence uses become evictable; false when none held any.
    fn unpin_waiting(&mut self) -> bool {
        let Some(prefix) = self.prefix.as_mut() else { return false };
        let mut any = false;
        for id in &self.waiting {
            let Some(seq) = self.seqs.get_mut(id) else { continue };
            if seq.running || seq.prefix.shared() == 0 {
                continue;
            }
            prefix.unref(&seq.prefix.take_refs());
            // Waiting, it holds no blocks of its own, and its match only moved its start.
            seq.rewind();
            any = true;
        }
        any
    }
}

/// Grows `seq`'s blocks to cover its next `len` tokens, evicting cached blocks no sequence uses while the budget
/// lacks room; false (and no change to `seq` or the cache) when even evicting every such block would not make room.
fn grow(kv: &mut KvBudget, prefix: &mut Option<PrefixCache>, seq: &mut Seq, len: usize) -> bool {
    let shared = seq.prefix.shared();
    let mut held = seq.table_blocks();
    let tokens = seq.pos as usize + len;
    let need = kv.blocks_for(tokens).saturating_sub(held);
    // Checked first, so that a step that cannot run does not empty the cache for nothing.
    if need > kv.free() + prefix.as_ref().map_or(0, PrefixCache::evictable) {
        return false;
    }
    while kv.free() < need && prefix.as_mut().is_some_and(PrefixCache::evict_one) {
        kv.evicted(1);
    }
    if !kv.grow(&mut held, tokens) {
        return false;
    }
    seq.blocks = held - shared;
    true
}
