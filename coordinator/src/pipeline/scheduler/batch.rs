//! Micro-batches on the wire: what a batch carries to the stages ([`Scheduler::build_batch`]), and what the stages'
//! response to it does to its sequences ([`Scheduler::apply_response`]).

use std::time::Instant;

use strata_proto::{ErrorCode, ServiceError, pb, wire_micros};

use super::{Effect, InFlight, PrefixCache, RequestId, Requeue, Scheduler, StallCause, fail, is_stage_fault};

impl Scheduler {
    /// The batch of `group`'s sequences, `len` tokens each: their chunks with the prefix cache's attachments and
    /// publications, and the cache's orders for the stages.
    pub(super) fn build_batch(&mut self, group: &[(RequestId, usize)]) -> pb::ForwardRequest {
        let batch_id = self.next_batch;
        self.next_batch += 1;
        let mut chunks = Vec::with_capacity(group.len());
        let mut token_ids = Vec::new();
        for &(id, len) in group {
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            let first = token_ids.len();
            token_ids.extend(seq.input.drain(..len));
            let (cached_blocks, cached_token_ids) = seq.prefix.take_attach();
            let end = seq.pos as usize + len;
            let publish = match &mut self.prefix {
                Some(prefix) => {
                    prefix.extend(&mut seq.prefix, seq.pos as usize, &token_ids[first..]);
                    prefix.publish(&mut seq.prefix, end)
                }
                None => Vec::new(),
            };
            // Published blocks pass from the sequence to the cache; the budget counts them as before.
            seq.blocks = seq.blocks.saturating_sub(publish.len());
            let publish = publish
                .into_iter()
                .map(|(index, key)| pb::PublishedBlock { index: u32::try_from(index).unwrap_or(u32::MAX), key })
                .collect();
            chunks.push(pb::SeqChunk {
                seq_id: seq.seq_id,
                start_pos: seq.pos,
                len: u32::try_from(len).unwrap_or(u32::MAX),
                sampling: Some(seq.sampling),
                want_logprobs: seq.logprobs,
                // Only the last slice of a prompt is sampled from.
                skip_sampling: !seq.input.is_empty(),
                traceparent: seq.traceparent.clone(),
                cached_blocks,
                cached_token_ids,
                publish,
                prompt_len: u32::try_from(seq.prompt.len()).unwrap_or(u32::MAX),
            });
            seq.pos += u32::try_from(len).unwrap_or(u32::MAX);
            seq.in_flight = true;
        }
        let (clear_prefix_cache, evict_blocks) = self.prefix.as_mut().map(PrefixCache::take_orders).unwrap_or_default();
        pb::ForwardRequest {
            plan_epoch: self.epoch,
            batch_id,
            chunks,
            token_ids,
            hidden: None,
            term: self.term,
            evict_blocks,
            clear_prefix_cache,
            timings: Vec::new(),
        }
    }

    /// A stage's response to a batch, arriving at `now`: per-sequence timing, then its tokens or its error.
    pub(in crate::pipeline) fn apply_response(&mut self, resp: pb::ForwardResponse, now: Instant) -> Vec<Effect> {
        let mut effects = Vec::new();
        let Some(batch) = self.batches.remove(&resp.batch_id) else {
            tracing::warn!(batch_id = resp.batch_id, "response for an unknown batch");
            return effects;
        };
        let elapsed = now.saturating_duration_since(batch.sent);
        effects.push(Effect::BatchReturned { elapsed, stages: resp.timings.clone() });
        let elapsed = wire_micros(elapsed);
        let queue: u64 = resp.timings.iter().map(|t| t.queue_micros).sum();
        let handoff: u64 = resp.timings.iter().map(|t| t.handoff_micros).sum();
        for id in &batch.reqs {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.in_flight = false;
                seq.timing.steps += 1;
                seq.timing.compute_micros += resp.stage_compute_micros;
                seq.timing.pipeline_micros += elapsed;
                seq.timing.queue_micros += queue;
                seq.timing.handoff_micros += handoff;
            }
        }
        if let Some(err) = resp.error {
            let err = ServiceError::from(err);
            if !is_stage_fault(err.code) {
                // The stages before the one that refused it may have published its blocks, the rest have not: the
                // cache forgets them, and the next batch tells every stage to (a stall clears every cache anyway).
                self.unpublish(&batch);
            }
            if err.code == ErrorCode::ResourceExhausted {
                // A stage ran out of KV blocks (e.g. its cache is smaller than it reported): recompute later.
                tracing::info!(batch_id = resp.batch_id, error = %err, "batch out of KV cache: preempting it");
                for id in &batch.reqs {
                    self.requeue(*id, Requeue::StageOutOfKv, &mut effects);
                }
                return effects;
            }
            if is_stage_fault(err.code) {
                effects.extend(self.stall(&err, StallCause::of(err.code)));
                return effects;
            }
            tracing::warn!(batch_id = resp.batch_id, error = %err, "batch failed");
            for id in &batch.reqs {
                if let Some(seq) = self.seqs.get_mut(id) {
                    fail(*id, seq, err.clone(), &mut effects);
                }
            }
            return effects;
        }
        for token in resp.tokens {
            let Some(&req) = self.by_seq_id.get(&token.seq_id) else { continue };
            let Some(seq) = self.seqs.get_mut(&req) else { continue };
            if seq.gone() {
                seq.done = true;
                continue;
            }
            seq.output.push(token.token_id);
            seq.input = vec![token.token_id];
            effects.push(Effect::Token { req, token, timing: seq.timing });
        }
        effects
    }

    /// Takes back from the cache the blocks a failed batch published and only its own sequence uses: each goes
    /// back to that sequence's blocks (freed with it) and is evicted on every stage that holds it. A block another
    /// sequence attached meanwhile stays (a stage without it refuses that sequence's batch, and a stall clears every
    /// cache).
    fn unpublish(&mut self, batch: &InFlight) {
        let Some(prefix) = self.prefix.as_mut() else { return };
        if batch.published.is_empty() {
            return;
        }
        for id in &batch.reqs {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.blocks += prefix.unpublish(&mut seq.prefix, &batch.published);
            }
        }
    }
}
