//! The scheduling policy as a synchronous state machine with no I/O: the waiting queue, the running set, the KV
//! budget and the micro-batches in flight. The actor feeds it inputs (a request admitted, free pipeline slots, a
//! stage's response, a broken stream, a new plan or KV budget, a finished `Release`) and executes the [`Effect`]s
//! it returns (send a batch, release KV on the stages, hand a sampled token to the caller's output, fail or forget
//! a request). Time is passed in, never read here, so every decision is unit-tested on plain data (`tests.rs`).
//!
//! The policy (admission in `admission.rs`; what batches carry and what their responses do in `batch.rs`):
//! - **Admission** ([`Scheduler::promote`]): waiting sequences join the running set oldest first while their
//!   first step fits, leaving a watermark of 1% of the blocks free while others run.
//! - **Packing** ([`Scheduler::schedule`]): [`in_flight`] micro-batches are kept in flight,
//!   `micro_batches_per_stage` per stage (1 by default: the biggest batches), at most `max_batches_in_flight` in
//!   all when it is set (stages sharing a host's cores); each takes an equal share of the
//!   running set, oldest first, at most `max_batch_tokens` tokens (longer prompts go in chunks, only the last one
//!   sampled).
//! - **Preemption** ([`Scheduler::reserve`]): when a step needs a block and none is free, the youngest running
//!   sequence not in flight is sent back to the queue (first) and recomputed under a new sequence id; the oldest
//!   is never preempted.
//! - **Prefix caching** (policy in `prefix_cache.rs`): a sequence about to prefill starts after the cached blocks
//!   its tokens begin with; the chunk that fills a block (of its prompt or its output) publishes it; cached blocks
//!   no sequence uses count as free and are evicted (least recently used first) before anyone is preempted; a
//!   waiting sequence lets go of the blocks it found when a running one needs them and has no one to preempt.
//!
//! What the stages say is bookkeeping, not policy: a stage that refuses a batch for want of KV gets it requeued
//! (at most [`MAX_STAGE_REFUSALS`] times per sequence); a batch the stages failed to run through no fault of its
//! own (a stage down, hung, or on another plan epoch or term) stalls the pipeline ([`Scheduler::stall`]): every
//! active sequence is requeued to be recomputed from its prompt and output once the actor has a pipeline again
//! (at most [`MAX_STAGE_FAILURES`] times per sequence), so callers see no error and the same tokens; a batch the
//! stages reject as malformed or fail internally fails its requests; a new plan requeues every active sequence. Whether a sampled token ends its sequence (EOS, `max_tokens`, stop strings) is decided
//! by `output`; the actor reports the end back with [`Scheduler::finish`] before it schedules again.
//!
//! A new policy is one new file beside this one with the same inputs and [`Effect`] output (the actor calls
//! nothing else), its tests on plain data beside it, and a swap of the `Scheduler` type in `actor.rs`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use strata_proto::{ErrorCode, ServiceError, pb};

use super::kv_budget::KvBudget;
use super::prefix_cache::{PrefixCache, PrefixStats, SeqPrefix};
use super::{SchedulerLimits, SeqRequest, StepTiming};

mod admission;
mod batch;
mod effect;
#[cfg(test)]
mod prefix_tests;
#[cfg(test)]
mod random_order_tests;
#[cfg(test)]
mod tests;

pub(super) use effect::{Effect, Gauges, RequestId, Requeue, StallCause};

/// A sequence whose batches a stage refused for want of KV this often fails instead of being recomputed again
/// (the stage holds less than it reported). Preemptions the coordinator decides itself are not limited: the
/// oldest sequence is never preempted, so it always progresses.
const MAX_STAGE_REFUSALS: u32 = 16;
/// A sequence that was running through this many stage failures fails instead of being recomputed again (a batch
/// that itself crashes stages must not take the cluster down forever). A crash costs each sequence one.
const MAX_STAGE_FAILURES: u32 = 8;
struct Seq {
    /// The sequence id on the wire; a new one on every recompute.
    seq_id: u64,
    /// Positions scheduled into the stages' KV cache.
    pos: u32,
    /// Tokens still to send: the (rest of the) prompt, or the last sampled token.
    input: Vec<u32>,
    /// The prompt and every token generated so far, to recompute after a preemption.
    prompt: Vec<u32>,
    output: Vec<u32>,
    /// KV blocks this sequence holds in the budget.
    blocks: usize,
    /// In the running set (holding KV) rather than waiting.
    running: bool,
    /// Batches of this sequence a stage refused for want of KV.
    refusals: u32,
    /// Stage failures it was running through.
    failures: u32,
    sampling: pb::SamplingParams,
    logprobs: bool,
    in_flight: bool,
    /// Finished or failed: no more steps, no more events.
    done: bool,
    /// The caller left; the sequence may still fail (its event is then dropped) until it is forgotten.
    cancelled: bool,
    timing: StepTiming,
    /// The request's W3C trace context, sent with each of its chunks (empty: not traced).
    traceparent: String,
    /// A chunk of it has been sent (it left the queue once; a recompute does not count again).
    started: bool,
    /// Its cached blocks (prefix caching).
    prefix: SeqPrefix,
}

impl Seq {
    fn gone(&self) -> bool {
        self.done || self.cancelled
    }

    /// Blocks of its table on the stages: its own and the cached ones it uses.
    fn table_blocks(&self) -> usize {
        self.blocks + self.prefix.shared()
    }

    /// Back to position 0, to feed its prompt and output again (a recompute, or a match given back).
    fn rewind(&mut self) {
        self.pos = 0;
        self.input = self.prompt.iter().chain(&self.output).copied().collect();
    }
}

/// A micro-batch in flight.
struct InFlight {
    reqs: Vec<RequestId>,
    sent: Instant,
    /// Keys of the blocks its chunks publish: taken back if it fails ([`PrefixCache::unpublish`]).
    published: Vec<u64>,
}

/// The scheduler's state. See the module documentation for the policy.
pub(super) struct Scheduler {
    limits: SchedulerLimits,
    /// Plan epoch and leadership term stamped on every batch, and the stage count that sizes [`in_flight`].
    epoch: u64,
    term: u64,
    stages: usize,
    kv: Option<KvBudget>,
    /// The blocks cached on the stages, with the budget that holds them (`None`: prefix caching is off).
    prefix: Option<PrefixCache>,
    prefix_stats: PrefixStats,
    /// Bumped with every new budget, so that a late release of an old one is ignored.
    kv_generation: u64,
    /// Every live request, oldest first.
    seqs: BTreeMap<RequestId, Seq>,
    /// Wire sequence id → request, for the tokens of a response.
    by_seq_id: HashMap<u64, RequestId>,
    /// Requests not yet running, oldest (or preempted) first.
    waiting: VecDeque<RequestId>,
    batches: HashMap<u64, InFlight>,
    next_seq: u64,
    next_req: u64,
    next_batch: u64,
}

impl Scheduler {
    /// A scheduler for a plan of `stages` stages at `epoch`, written in leadership `term`, with no KV budget yet.
    pub(super) fn new(limits: SchedulerLimits, epoch: u64, term: u64, stages: usize) -> Self {
        Scheduler {
            limits,
            epoch,
            term,
            stages,
            kv: None,
            prefix: None,
            prefix_stats: PrefixStats::default(),
            kv_generation: 0,
            seqs: BTreeMap::new(),
            by_seq_id: HashMap::new(),
            waiting: VecDeque::new(),
            batches: HashMap::new(),
            next_seq: first_seq_id(term),
            next_req: 1,
            next_batch: 1,
        }
    }

    /// Whether the stages' KV capacity is known (the actor learns it on connecting).
    pub(super) fn has_budget(&self) -> bool {
        self.kv.is_some()
    }

    /// The budget the stages reported on (re)connecting; releases of the previous one are ignored from now on.
    /// With prefix caching on (for these stages), the budget starts an empty cache, and the next batch clears the
    /// stages' caches.
    pub(super) fn set_budget(&mut self, kv: KvBudget) {
        self.prefix = None;
        if self.limits.prefix_caching.enabled(kv.batch_invariant()) {
            if kv.uniform() {
                self.prefix = Some(PrefixCache::new(kv.block_size(), self.epoch));
            } else {
                tracing::warn!("prefix caching is off: the stages' KV blocks hold different numbers of tokens");
            }
        }
        self.kv = Some(kv);
        self.kv_generation += 1;
    }

    /// A `Release` of `blocks` of budget `generation` returned from every stage; its sequences used the `cached`
    /// blocks.
    pub(super) fn released(&mut self, generation: u64, blocks: usize, cached: &[u64]) {
        if generation != self.kv_generation {
            return;
        }
        if let Some(kv) = self.kv.as_mut() {
            kv.released(blocks);
        }
        if let Some(prefix) = self.prefix.as_mut() {
            prefix.unref(cached);
        }
    }

    /// Whether no request is queued or running (a graceful shutdown waits for this).
    pub(super) fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// The most requests queued or running at once.
    pub(super) fn max_concurrent_requests(&self) -> usize {
        self.limits.max_concurrent_requests
    }

    /// Whether requests are queued (the actor reconnects for them after a broken stream or a new plan).
    pub(super) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Sends `traceparent` with every chunk of request `id`, so that each stage records its work on it as part
    /// of the request's trace.
    pub(super) fn trace(&mut self, id: RequestId, traceparent: String) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.traceparent = traceparent;
        }
    }

    /// Micro-batches sent and not yet answered.
    pub(super) fn batches_in_flight(&self) -> usize {
        self.batches.len()
    }

    /// Whether, right after [`Scheduler::schedule`], work is left that nothing will move: the budget is known,
    /// a sequence has not ended, no batch is in flight and no `Release` is out (`releasing`), so no answer the
    /// actor waits for can change anything. Only a bug gets here (waiting sequences pinning the cached blocks the
    /// one running sequence needed did, before 30013ab): the actor then recovers as from a stage failure.
    pub(super) fn stopped(&self, releasing: bool) -> bool {
        self.kv.is_some() && self.batches.is_empty() && !releasing && self.seqs.values().any(|s| !s.gone())
    }

    /// Queues `req` if it can ever fit and the queue has room.
    pub(super) fn admit(&mut self, req: &SeqRequest) -> Result<RequestId, ServiceError> {
        let kv = self.kv.as_ref().ok_or_else(|| ServiceError::unavailable("no KV budget"))?;
        let need = kv.blocks_for(req.prompt_ids.len() + req.max_tokens);
        if need > kv.total() {
            return Err(ServiceError::invalid_argument(format!(
                "{} prompt tokens + max_tokens {} need {need} KV blocks of {} tokens; the smallest stage holds {}",
                req.prompt_ids.len(),
                req.max_tokens,
                kv.block_size(),
                kv.total()
            )));
        }
        let active = self.seqs.values().filter(|s| !s.gone()).count();
        if active >= self.limits.max_concurrent_requests {
            return Err(ServiceError::resource_exhausted(format!(
                "overloaded: {active} requests are running or queued (max_concurrent_requests); retry later"
            )));
        }
        let seq_id = self.next_seq;
        self.next_seq += 1;
        let id = RequestId(self.next_req);
        self.next_req += 1;
        tracing::debug!(seq = seq_id, prompt = req.prompt_ids.len(), "sequence queued");
        self.seqs.insert(
            id,
            Seq {
                seq_id,
                pos: 0,
                input: req.prompt_ids.clone(),
                prompt: req.prompt_ids.clone(),
                output: Vec::new(),
                blocks: 0,
                running: false,
                refusals: 0,
                failures: 0,
                sampling: req.sampling,
                logprobs: req.logprobs,
                in_flight: false,
                done: false,
                cancelled: false,
                timing: StepTiming::default(),
                traceparent: String::new(),
                started: false,
                prefix: SeqPrefix::default(),
            },
        );
        self.by_seq_id.insert(seq_id, id);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// The caller of `req` left: no more steps; it is forgotten once nothing of it is in flight.
    pub(super) fn cancel(&mut self, req: RequestId) {
        if let Some(seq) = self.seqs.get_mut(&req) {
            seq.cancelled = true;
        }
    }

    /// `req` ended (its output finished it, or its events could not be delivered).
    pub(super) fn finish(&mut self, req: RequestId) {
        if let Some(seq) = self.seqs.get_mut(&req) {
            seq.done = true;
        }
    }

    /// Packs the running sequences' next steps into micro-batches for the free slots of [`in_flight`].
    pub(super) fn schedule(&mut self, now: Instant) -> Vec<Effect> {
        let mut effects = Vec::new();
        let in_flight = in_flight(&self.limits, self.stages);
        let slots = in_flight.saturating_sub(self.batches.len());
        if slots == 0 {
            return effects;
        }
        self.promote();
        // Oldest first: the map is ordered by admission.
        let ready: Vec<RequestId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.running && !s.in_flight && !s.gone() && !s.input.is_empty())
            .map(|(id, _)| *id)
            .collect();
        if ready.is_empty() {
            return effects;
        }
        // Every batch gets an equal share of the whole running set, oldest sequences first; the rest wait for the
        // next free slot. Sizing from what happens to be ready let arrival order freeze the split: 16 streams
        // through 2 stages ran as one batch of 13 and three of 1 for the whole run (logged), and a 1-token batch
        // costs a stage nearly what a 13-token one does. With a fixed share, batches even out within a cycle.
        let running = self.seqs.values().filter(|s| s.running && !s.gone()).count();
        let per_batch = running.div_ceil(in_flight).max(1);
        let mut slots_left = slots;
        let mut next = 0;
        while slots_left > 0 && next < ready.len() {
            let mut group = Vec::new();
            let mut budget = self.limits.max_batch_tokens;
            while next < ready.len() && group.len() < per_batch && budget > 0 {
                let id = ready[next];
                next += 1;
                if let Some(len) = self.reserve(id, budget, &mut effects) {
                    budget -= len;
                    group.push((id, len));
                }
            }
            if group.is_empty() {
                continue;
            }
            for (id, _) in &group {
                if let Some(seq) = self.seqs.get_mut(id)
                    && !seq.started
                {
                    seq.started = true;
                    effects.push(Effect::Started { req: *id });
                }
            }
            let batch = self.build_batch(&group);
            tracing::trace!(batch_id = batch.batch_id, seqs = group.len(), "batch built");
            let reqs = group.iter().map(|(id, _)| *id).collect();
            let published = batch.chunks.iter().flat_map(|c| c.publish.iter().map(|p| p.key)).collect();
            self.batches.insert(batch.batch_id, InFlight { reqs, sent: now, published });
            effects.push(Effect::Send(batch));
            slots_left -= 1;
        }
        effects
    }

    /// Frees a sequence's KV on every stage and queues it (first) to be recomputed from its prompt and output
    /// under a new sequence id, so a late `Release` of the old id cannot touch the new cache.
    fn requeue(&mut self, id: RequestId, why: Requeue, effects: &mut Vec<Effect>) {
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        effects.push(Effect::Requeued { req: id, why });
        match why {
            Requeue::StageOutOfKv => seq.refusals += 1,
            Requeue::StageFailed if seq.running => seq.failures += 1,
            _ => {}
        }
        tracing::debug!(seq = seq.seq_id, tokens = seq.pos, ?why, "requeueing for recompute");
        let blocks = seq.blocks;
        if let Some(kv) = &mut self.kv {
            kv.release(&mut seq.blocks);
        }
        seq.blocks = 0;
        self.by_seq_id.remove(&seq.seq_id);
        effects.push(Effect::Release {
            seq_ids: vec![seq.seq_id],
            blocks,
            cached: seq.prefix.take_refs(),
            generation: self.kv_generation,
        });
        let error = if seq.refusals > MAX_STAGE_REFUSALS {
            Some(ServiceError::resource_exhausted(format!(
                "a stage refused this sequence's batches {} times for want of KV cache",
                seq.refusals
            )))
        } else if seq.failures > MAX_STAGE_FAILURES {
            Some(ServiceError::unavailable(format!(
                "the stages failed {} times while this sequence ran; giving up on it",
                seq.failures
            )))
        } else {
            None
        };
        if let Some(error) = error {
            fail(id, seq, error, effects);
            self.seqs.remove(&id);
            self.waiting.retain(|w| *w != id);
            effects.push(Effect::Ended { req: id });
            return;
        }
        if !seq.running {
            // Already queued (a plan change requeues everyone): it moves to the front.
            self.waiting.retain(|w| *w != id);
        }
        seq.running = false;
        seq.rewind();
        seq.seq_id = self.next_seq;
        self.next_seq += 1;
        self.by_seq_id.insert(seq.seq_id, id);
        self.waiting.push_front(id);
    }

    /// The stages failed with `err` for `cause` (a batch failed for want of a stage, the stream broke, a batch is
    /// overdue, or the watchdog found the scheduler stopped):
    /// batches in flight are abandoned, finished sequences are reaped, and every active sequence is queued (in its
    /// original order) to be recomputed from its prompt and output, charging a failure to each one that was
    /// running. The budget is dropped until [`Scheduler::set_budget`]; the releases returned go to the same stages.
    pub(super) fn stall(&mut self, err: &ServiceError, cause: StallCause) -> Vec<Effect> {
        tracing::warn!(error = %err, in_flight = self.batches.len(), "stages failed: requeueing every sequence");
        let mut effects = self.abandon_and_requeue(Requeue::StageFailed);
        self.kv = None;
        self.prefix = None;
        self.kv_generation += 1;
        effects.push(Effect::Stalled { error: err.clone(), cause });
        effects
    }

    /// When the oldest batch in flight was sent (the actor's batch deadline).
    pub(super) fn oldest_batch_sent(&self) -> Option<Instant> {
        self.batches.values().map(|b| b.sent).min()
    }

    /// Abandons the batches in flight, reaps what ended, and requeues every remaining sequence for `why`, youngest
    /// first, each to the front of the queue, so the queue keeps admission order.
    fn abandon_and_requeue(&mut self, why: Requeue) -> Vec<Effect> {
        self.batches.clear();
        for seq in self.seqs.values_mut() {
            seq.in_flight = false;
        }
        let mut effects = self.reap();
        let active: Vec<RequestId> = self.seqs.keys().rev().copied().collect();
        for id in active {
            self.requeue(id, why, &mut effects);
        }
        effects
    }

    /// Nothing can serve (shutdown, or no pipeline within the recovery timeout): every request fails with `err`.
    pub(super) fn fail_all(&mut self, err: &ServiceError) -> Vec<Effect> {
        let mut effects = Vec::new();
        for (id, seq) in &mut self.seqs {
            seq.in_flight = false;
            fail(*id, seq, err.clone(), &mut effects);
        }
        self.batches.clear();
        effects
    }

    /// Switches to a plan of `stages` stages at `epoch`: batches in flight under the old plan are abandoned, and
    /// every active sequence is queued (in its original order) to be recomputed from its prompt and output under
    /// the new one. The budget is dropped until [`Scheduler::set_budget`]. The releases returned go to the old
    /// stages (they may keep serving another epoch).
    pub(super) fn set_plan(&mut self, epoch: u64, term: u64, stages: usize) -> Vec<Effect> {
        if term != self.term {
            // Before the requeue, so that the recomputed sequences get ids of the new term.
            self.next_seq = self.next_seq.max(first_seq_id(term));
        }
        let effects = self.abandon_and_requeue(Requeue::PlanChanged);
        self.epoch = epoch;
        self.term = term;
        self.stages = stages;
        self.kv = None;
        self.prefix = None;
        self.kv_generation += 1;
        effects
    }

    /// Forgets finished and cancelled sequences with no batch in flight and releases them on every stage.
    pub(super) fn reap(&mut self) -> Vec<Effect> {
        let mut effects = Vec::new();
        let gone: Vec<RequestId> =
            self.seqs.iter().filter(|(_, s)| s.gone() && !s.in_flight).map(|(id, _)| *id).collect();
        if gone.is_empty() {
            return effects;
        }
        let seqs = &self.seqs;
        self.waiting.retain(|id| seqs.get(id).is_some_and(|s| !s.gone()));
        let mut blocks = 0;
        let mut held = Vec::new();
        let mut cached = Vec::new();
        for id in gone {
            let Some(mut seq) = self.seqs.remove(&id) else { continue };
            self.by_seq_id.remove(&seq.seq_id);
            effects.push(Effect::Ended { req: id });
            if seq.running {
                blocks += seq.blocks;
                if let Some(kv) = &mut self.kv {
                    kv.release(&mut seq.blocks);
                }
                held.push(seq.seq_id);
                cached.extend(seq.prefix.take_refs());
            } else if let Some(prefix) = &mut self.prefix {
                // Waiting with blocks found in the cache: no stage has it yet.
                prefix.unref(&seq.prefix.take_refs());
            }
        }
        if !held.is_empty() {
            effects.push(Effect::Release { seq_ids: held, blocks, cached, generation: self.kv_generation });
        }
        effects
    }

    /// Queue depth and KV use.
    pub(super) fn gauges(&self) -> Gauges {
        let (mut running, mut waiting) = (0, 0);
        for seq in self.seqs.values().filter(|s| !s.gone()) {
            if seq.running {
                running += 1;
            } else {
                waiting += 1;
            }
        }
        let (kv_total, kv_free) = self.kv.as_ref().map_or((0, 0), |kv| (kv.total(), kv.free()));
        // Cached blocks no sequence uses are free: eviction gets them back when needed.
        let (evictable, kv_cached) = self.prefix.as_ref().map_or((0, 0), |p| (p.evictable(), p.cached()));
        Gauges { running, waiting, kv_total, kv_free: kv_free + evictable, kv_cached, prefix: self.prefix_stats }
    }
}

/// Ends `seq` with `error` unless it already ended.
fn fail(id: RequestId, seq: &mut Seq, error: ServiceError, effects: &mut Vec<Effect>) {
    if !seq.done {
        seq.done = true;
        effects.push(Effect::Fail { req: id, error });
    }
}

/// The first sequence id of leadership `term`: the term in the high 32 bits, so the ids of different coordinators
/// and of a restarted one (a new election, a higher term) never meet on a stage. Term 0 (no election) counts from 1.
fn first_seq_id(term: u64) -> u64 {
    (term.min(u64::from(u32::MAX)) << 32) | 1
}

/// Whether a batch error means the stages could not run it (down, hung, restarting, on another plan epoch or
/// leadership term), so its sequences are recomputed, rather than that the batch itself is bad.
fn is_stage_fault(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::Unavailable | ErrorCode::FailedPrecondition | ErrorCode::DeadlineExceeded | ErrorCode::Cancelled
    )
}

/// Micro-batches kept in flight through `stages` stages: `micro_batches_per_stage` each, at most
/// `max_batches_in_flight` when that is set, at least one in all (the trade-offs are told at
/// [`SchedulerLimits`]).
fn in_flight(limits: &SchedulerLimits, stages: usize) -> usize {
    let all = limits.micro_batches_per_stage.saturating_mul(stages);
    let capped = if limits.max_batches_in_flight == 0 { all } else { all.min(limits.max_batches_in_flight) };
    capped.max(1)
}
