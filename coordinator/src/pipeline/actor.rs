//! The scheduler actor: the request queue, the running set, micro-batch packing, preemption and the `Forward`
//! stream to stage 0. Only this task touches its state, so none of it needs a lock.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_engine::generate::StopState;
use strata_engine::tokenizer::IncrementalDecoder;
use strata_proto::{ErrorCode, ServiceError, Tls, pb};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::kv_budget::KvBudget;
use super::{Command, Finish, ModelInfo, SchedulerLimits, SeqEvent, SeqRequest, StepTiming};
use crate::membership::Plan;
use crate::metrics::Metrics;
use crate::stage_client::{self, ForwardStream, TracedStageClient};

/// Events buffered per sequence before the actor waits for its caller.
const EVENT_BUFFER: usize = 64;
/// How long a `Release` may take. Its blocks stay reserved until it returns, so this only bounds how long a
/// stage that never answers can hold them.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long asking a stage for its status may take.
const STATUS_TIMEOUT: Duration = Duration::from_secs(5);
/// A sequence whose batches a stage refused for want of KV this often fails instead of being recomputed again
/// (the stage holds less than it reported). Preemptions the coordinator decides itself are not limited: the
/// oldest sequence is never preempted, so it always progresses.
const MAX_STAGE_REFUSALS: u32 = 16;
/// Micro-batches in flight per stage when there are several stages. Stages + 1 keeps a pipeline busy only when
/// every batch costs the same; a batch carrying a prompt chunk costs 10-100× a decode step, and with one spare batch
/// the other stages drain and wait behind it. More, smaller batches absorb that, but since the CPU kernels unpack
/// each weight block once for up to 8 tokens a batch of 2 costs nearly what a batch of 8 does: at 16 streams a
/// 2-stage cluster measured 113 tok/s with 8 batches in flight, 140-153 with 4, 137 with 2 (2026-11-30).
const MICRO_BATCHES_PER_STAGE: usize = 2;
/// Finished `Release` calls waiting for the actor.
const RELEASED_BUFFER: usize = 256;

struct Seq {
    /// Admission order: the oldest runs first and is preempted last.
    order: u64,
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
    max_tokens: usize,
    sampling: pb::SamplingParams,
    logprobs: bool,
    ignore_eos: bool,
    in_flight: bool,
    done: bool,
    stop: StopState,
    decoder: IncrementalDecoder,
    timing: StepTiming,
    /// When the request was admitted, and when its last token was streamed (latency metrics).
    admitted: Instant,
    last_token: Option<Instant>,
    /// How it ended (`length`, `eos`, `stop`, `error`), for the metrics; unset means cancelled.
    ended: Option<&'static str>,
    tx: mpsc::Sender<SeqEvent>,
    span: tracing::Span,
}

impl Seq {
    fn gone(&self) -> bool {
        self.done || self.tx.is_closed()
    }

    fn fail(&mut self, error: ServiceError) {
        if !self.done {
            self.done = true;
            self.ended = Some("error");
            let _ = self.tx.try_send(SeqEvent::Failed { error, completion_tokens: self.output.len() });
        }
    }

    fn finish(&mut self, finish: Finish) {
        let stop = std::mem::replace(&mut self.stop, StopState::new(Vec::new()));
        let (text, _) = stop.finish();
        self.done = true;
        self.ended = Some(finish.as_str());
        let event = SeqEvent::Done { finish, text, completion_tokens: self.output.len(), timing: self.timing };
        let _ = self.tx.try_send(event);
    }
}

/// Why a sequence goes back to the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Requeue {
    /// The KV cache is full (a preemption).
    KvFull,
    /// A stage refused its batch for want of KV (it holds less than it reported).
    StageOutOfKv,
    /// The plan changed under it.
    PlanChanged,
}

/// A micro-batch in flight.
struct InFlight {
    seqs: Vec<u64>,
    sent: Instant,
}

pub(super) struct Actor {
    model: Arc<ModelInfo>,
    plan: Plan,
    limits: SchedulerLimits,
    client: Option<TracedStageClient>,
    stream: Option<ForwardStream>,
    kv: Option<KvBudget>,
    seqs: HashMap<u64, Seq>,
    /// Sequences not yet running, oldest (or preempted) first.
    waiting: VecDeque<u64>,
    batches: HashMap<u64, InFlight>,
    next_seq: u64,
    next_order: u64,
    next_batch: u64,
    /// Finished releases: (budget generation, blocks). A release of an older budget (plan) is ignored.
    released_tx: mpsc::Sender<(u64, usize)>,
    released_rx: mpsc::Receiver<(u64, usize)>,
    kv_generation: u64,
    /// How the stages are dialled.
    tls: Option<Tls>,
    metrics: Arc<Metrics>,
}

impl Actor {
    pub(super) fn new(
        model: Arc<ModelInfo>,
        plan: Plan,
        limits: SchedulerLimits,
        tls: Option<Tls>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (released_tx, released_rx) = mpsc::channel(RELEASED_BUFFER);
        publish_plan(&metrics, &plan);
        Actor {
            model,
            plan,
            limits,
            client: None,
            stream: None,
            kv: None,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            batches: HashMap::new(),
            next_seq: 1,
            next_order: 1,
            next_batch: 1,
            released_tx,
            released_rx,
            kv_generation: 0,
            tls,
            metrics,
        }
    }

    pub(super) async fn run(mut self, mut commands: mpsc::Receiver<Command>, shutdown: CancellationToken) {
        loop {
            self.reap();
            if self.stream.is_none() && !self.waiting.is_empty() {
                // Sequences carried over from an old plan (or a broken stream) wait for the new stage 0.
                if let Err(e) = self.ensure_connected().await {
                    self.fail_all(&e);
                    self.reap();
                }
            }
            self.schedule().await;
            self.publish_gauges();
            let waiting = !self.batches.is_empty();
            tokio::select! {
                () = shutdown.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    None => break,
                    Some(Command::Submit { req, span, reply }) => {
                        let result = self.admit(req, span).await;
                        let _ = reply.send(result);
                    }
                    Some(Command::SetPlan(plan)) => self.set_plan(plan),
                },
                resp = next_response(&mut self.stream), if waiting => self.on_response(resp),
                Some((generation, n)) = self.released_rx.recv() => {
                    if let Some(kv) = self.kv.as_mut().filter(|_| generation == self.kv_generation) {
                        kv.released(n);
                    }
                }
            }
        }
        self.fail_all(&ServiceError::unavailable("the coordinator is shutting down"));
        self.reap();
    }

    /// Switches to `plan`: batches in flight under the old plan are abandoned, and every active sequence is
    /// queued (in its original order) to be recomputed from its prompt and output under the new one.
    fn set_plan(&mut self, plan: Plan) {
        if plan.epoch == self.plan.epoch && plan.stages == self.plan.stages {
            return;
        }
        tracing::info!(epoch = %plan.epoch, stages = plan.stages.len(), "switching to a new plan");
        self.batches.clear();
        for seq in self.seqs.values_mut() {
            seq.in_flight = false;
        }
        self.reap();
        // Free what the old stages hold (they may keep serving another epoch) before forgetting the client.
        let mut active: Vec<(u64, u64)> = self.seqs.iter().map(|(id, s)| (s.order, *id)).collect();
        active.sort_unstable();
        for &(_, id) in active.iter().rev() {
            self.requeue(id, Requeue::PlanChanged);
        }
        publish_plan(&self.metrics, &plan);
        self.plan = plan;
        self.client = None;
        self.stream = None;
        self.kv = None;
        self.kv_generation += 1;
    }

    /// Opens the `Forward` stream to stage 0 and learns the KV capacity of every stage.
    async fn ensure_connected(&mut self) -> Result<(), ServiceError> {
        if self.stream.is_some() && self.kv.is_some() {
            return Ok(());
        }
        let Some(stage0) = self.plan.stages.first() else {
            return Err(ServiceError::unavailable("the plan has no stages"));
        };
        let mut statuses = Vec::with_capacity(self.plan.stages.len());
        for stage in &self.plan.stages {
            let mut client = stage_client::connect(&stage.address, self.tls.as_ref()).await?;
            let status = tokio::time::timeout(STATUS_TIMEOUT, client.status(pb::StageStatusRequest {}))
                .await
                .map_err(|_| ServiceError::unavailable(format!("stage {}: status timed out", stage.address)))?
                .map_err(ServiceError::from)?;
            statuses.push(status.into_inner());
        }
        let kv = KvBudget::from_statuses(&statuses)?;
        let mut client = stage_client::connect(&stage0.address, self.tls.as_ref()).await?;
        let stream = stage_client::open_forward(&mut client).await?;
        tracing::info!(
            address = %stage0.address,
            epoch = %self.plan.epoch,
            kv_blocks = kv.total(),
            block_size = kv.block_size(),
            "Forward stream to stage 0 open"
        );
        self.client = Some(client);
        self.stream = Some(stream);
        self.kv = Some(kv);
        self.kv_generation += 1;
        Ok(())
    }

    async fn admit(&mut self, req: SeqRequest, span: tracing::Span) -> Result<mpsc::Receiver<SeqEvent>, ServiceError> {
        let result = self.try_admit(req, span).await;
        match &result {
            Ok(_) => {
                self.metrics.requests_admitted.inc();
            }
            Err(e) => self.metrics.rejected(match e.code {
                ErrorCode::ResourceExhausted => "overloaded",
                ErrorCode::InvalidArgument => "too_long",
                _ => "unavailable",
            }),
        };
        result
    }

    async fn try_admit(
        &mut self,
        req: SeqRequest,
        span: tracing::Span,
    ) -> Result<mpsc::Receiver<SeqEvent>, ServiceError> {
        self.ensure_connected().instrument(span.clone()).await?;
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
        let id = self.next_seq;
        self.next_seq += 1;
        let order = self.next_order;
        self.next_order += 1;
        let (tx, rx) = mpsc::channel(EVENT_BUFFER.max(req.max_tokens + 2).min(4096));
        span.in_scope(|| tracing::debug!(seq = id, prompt = req.prompt_ids.len(), "sequence queued"));
        self.metrics.prompt_tokens.inc_by(req.prompt_ids.len() as u64);
        self.seqs.insert(
            id,
            Seq {
                order,
                pos: 0,
                input: req.prompt_ids.clone(),
                prompt: req.prompt_ids,
                output: Vec::new(),
                blocks: 0,
                running: false,
                refusals: 0,
                max_tokens: req.max_tokens,
                sampling: req.sampling,
                logprobs: req.logprobs,
                ignore_eos: req.ignore_eos,
                in_flight: false,
                done: false,
                stop: StopState::new(req.stop),
                decoder: IncrementalDecoder::default(),
                timing: StepTiming::default(),
                admitted: Instant::now(),
                last_token: None,
                ended: None,
                tx,
                span,
            },
        );
        self.waiting.push_back(id);
        Ok(rx)
    }

    /// Moves waiting sequences into the running set, oldest first, while the KV cache has room for their first
    /// step.
    fn promote(&mut self) {
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
            let first = seq.input.len().min(self.limits.max_batch_tokens);
            let need = kv.blocks_for(seq.pos as usize + first).saturating_sub(seq.blocks);
            if running && kv.free() < need + watermark {
                break;
            }
            if !kv.grow(&mut seq.blocks, seq.pos as usize + first) {
                break;
            }
            seq.running = true;
            running = true;
            self.waiting.pop_front();
        }
    }

    /// Packs the running sequences' next steps into micro-batches, up to [`in_flight`] of them.
    async fn schedule(&mut self) {
        let in_flight = in_flight(self.plan.stages.len());
        let slots = in_flight.saturating_sub(self.batches.len());
        if slots == 0 || self.stream.is_none() {
            return;
        }
        self.promote();
        let mut ready: Vec<(u64, u64)> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.running && !s.in_flight && !s.gone() && !s.input.is_empty())
            .map(|(id, s)| (s.order, *id))
            .collect();
        if ready.is_empty() {
            return;
        }
        ready.sort_unstable();
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
                let id = ready[next].1;
                next += 1;
                if let Some(len) = self.reserve(id, budget) {
                    budget -= len;
                    group.push((id, len));
                }
            }
            if group.is_empty() {
                continue;
            }
            let batch = self.build_batch(&group);
            let batch_id = batch.batch_id;
            let sent = match &self.stream {
                Some(s) => s.tx.send(batch).await.is_ok(),
                None => false,
            };
            self.metrics.batch_tokens.observe(group.iter().map(|(_, len)| *len).sum::<usize>() as f64);
            let seqs = group.iter().map(|(id, _)| *id).collect();
            self.batches.insert(batch_id, InFlight { seqs, sent: Instant::now() });
            if !sent {
                self.stream_broken(ServiceError::unavailable("the Forward stream to stage 0 closed"));
                return;
            }
            tracing::trace!(batch_id, seqs = group.len(), "batch sent");
            slots_left -= 1;
        }
    }

    /// Reserves KV for the next step of `id` (at most `budget` tokens), preempting younger sequences when the
    /// cache is full; returns the step's length, or `None` when it cannot run now.
    fn reserve(&mut self, id: u64, budget: usize) -> Option<usize> {
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
            if kv.grow(&mut seq.blocks, seq.pos as usize + len) {
                // Claimed for this batch: nobody may preempt it now.
                seq.in_flight = true;
                return Some(len);
            }
            let order = seq.order;
            let victim = self
                .seqs
                .iter()
                .filter(|(_, s)| s.running && !s.in_flight && !s.gone() && s.order > order)
                .max_by_key(|(_, s)| s.order)
                .map(|(v, _)| *v)?;
            self.requeue(victim, Requeue::KvFull);
        }
    }

    /// Frees a sequence's KV on every stage and queues it (first) to be recomputed from its prompt and output
    /// under a new id, so a late `Release` of the old id cannot touch the new cache.
    fn requeue(&mut self, id: u64, why: Requeue) {
        let Some(mut seq) = self.seqs.remove(&id) else { return };
        match why {
            Requeue::KvFull => self.metrics.preempted("kv_full"),
            Requeue::StageOutOfKv => self.metrics.preempted("stage_out_of_kv"),
            Requeue::PlanChanged => {}
        }
        if why == Requeue::StageOutOfKv {
            seq.refusals += 1;
        }
        tracing::debug!(seq = id, tokens = seq.pos, ?why, "requeueing for recompute");
        let blocks = seq.blocks;
        if let Some(kv) = &mut self.kv {
            kv.release(&mut seq.blocks);
        }
        seq.blocks = 0;
        self.release(vec![id], blocks);
        if seq.refusals > MAX_STAGE_REFUSALS {
            seq.fail(ServiceError::resource_exhausted(format!(
                "a stage refused this sequence's batches {} times for want of KV cache",
                seq.refusals
            )));
            self.metrics.finished("error");
            return;
        }
        seq.running = false;
        seq.pos = 0;
        seq.input = seq.prompt.iter().chain(&seq.output).copied().collect();
        let new_id = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(new_id, seq);
        self.waiting.push_front(new_id);
    }

    fn build_batch(&mut self, group: &[(u64, usize)]) -> pb::ForwardRequest {
        let batch_id = self.next_batch;
        self.next_batch += 1;
        let mut chunks = Vec::with_capacity(group.len());
        let mut token_ids = Vec::new();
        for &(id, len) in group {
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            token_ids.extend(seq.input.drain(..len));
            chunks.push(pb::SeqChunk {
                seq_id: id,
                start_pos: seq.pos,
                len: u32::try_from(len).unwrap_or(u32::MAX),
                sampling: Some(seq.sampling),
                want_logprobs: seq.logprobs,
                // Only the last slice of a prompt is sampled from.
                skip_sampling: !seq.input.is_empty(),
            });
            seq.pos += u32::try_from(len).unwrap_or(u32::MAX);
            seq.in_flight = true;
        }
        pb::ForwardRequest { plan_epoch: self.plan.epoch.0, batch_id, chunks, token_ids, hidden: None }
    }

    fn on_response(&mut self, resp: Option<Result<pb::ForwardResponse, tonic::Status>>) {
        let resp = match resp {
            Some(Ok(r)) => r,
            Some(Err(status)) => return self.stream_broken(ServiceError::from(status)),
            None => return self.stream_broken(ServiceError::unavailable("stage 0 closed the Forward stream")),
        };
        let Some(batch) = self.batches.remove(&resp.batch_id) else {
            tracing::warn!(batch_id = resp.batch_id, "response for an unknown batch");
            return;
        };
        let elapsed = batch.sent.elapsed();
        Metrics::observe(&self.metrics.batch_duration, elapsed);
        let elapsed = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        for id in &batch.seqs {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.in_flight = false;
                seq.timing.steps += 1;
                seq.timing.compute_micros += resp.stage_compute_micros;
                seq.timing.pipeline_micros += elapsed;
            }
        }
        if let Some(err) = resp.error {
            let err = ServiceError::from(err);
            if err.code == ErrorCode::ResourceExhausted {
                // A stage ran out of KV blocks (e.g. its cache is smaller than it reported): recompute later.
                tracing::info!(batch_id = resp.batch_id, error = %err, "batch out of KV cache: preempting it");
                for id in &batch.seqs {
                    self.requeue(*id, Requeue::StageOutOfKv);
                }
                return;
            }
            tracing::warn!(batch_id = resp.batch_id, error = %err, "batch failed");
            for id in &batch.seqs {
                if let Some(seq) = self.seqs.get_mut(id) {
                    seq.fail(err.clone());
                }
            }
            return;
        }
        for t in resp.tokens {
            self.on_token(t);
        }
    }

    fn on_token(&mut self, t: pb::SampledToken) {
        let tokenizer = self.model.tokenizer.clone();
        let eos = self.model.eos_token_ids.contains(&t.token_id);
        let Some(seq) = self.seqs.get_mut(&t.seq_id) else { return };
        if seq.gone() {
            seq.done = true;
            return;
        }
        if eos && !seq.ignore_eos {
            return seq.finish(Finish::Eos);
        }
        seq.output.push(t.token_id);
        let piece = match &tokenizer {
            Some(tok) => match seq.decoder.push(tok, t.token_id) {
                Ok(p) => p,
                Err(e) => return seq.fail(ServiceError::internal(format!("decoding token {}: {e}", t.token_id))),
            },
            None => String::new(),
        };
        let (text, hit) = seq.stop.push(&piece);
        let event = SeqEvent::Token { id: t.token_id, logprob: t.logprob, text };
        if seq.tx.try_send(event).is_err() {
            // Caller gone (or hopelessly behind): cancel.
            seq.done = true;
            return;
        }
        let now = Instant::now();
        match seq.last_token.replace(now) {
            None => Metrics::observe(&self.metrics.time_to_first_token, now - seq.admitted),
            Some(last) => Metrics::observe(&self.metrics.inter_token_latency, now - last),
        }
        self.metrics.generation_tokens.inc();
        if hit {
            seq.finish(Finish::Stop);
        } else if seq.output.len() >= seq.max_tokens {
            seq.finish(Finish::Length);
        } else {
            seq.input = vec![t.token_id];
        }
    }

    fn stream_broken(&mut self, err: ServiceError) {
        tracing::warn!(error = %err, in_flight = self.batches.len(), "Forward stream to stage 0 broke");
        self.stream = None;
        self.fail_all(&err);
    }

    fn fail_all(&mut self, err: &ServiceError) {
        for seq in self.seqs.values_mut() {
            seq.in_flight = false;
            seq.fail(err.clone());
        }
        self.batches.clear();
    }

    /// Forgets finished and cancelled sequences with no batch in flight and releases them on every stage.
    fn reap(&mut self) {
        let gone: Vec<u64> = self.seqs.iter().filter(|(_, s)| s.gone() && !s.in_flight).map(|(id, _)| *id).collect();
        if gone.is_empty() {
            return;
        }
        let seqs = &self.seqs;
        self.waiting.retain(|id| seqs.get(id).is_some_and(|s| !s.gone()));
        let mut blocks = 0;
        let mut held = Vec::new();
        for id in &gone {
            if let Some(mut seq) = self.seqs.remove(id) {
                seq.span.in_scope(|| tracing::debug!(seq = id, generated = seq.output.len(), "sequence released"));
                let reason = seq.ended.unwrap_or("cancelled");
                self.metrics.finished(reason);
                if !matches!(reason, "cancelled" | "error") {
                    Metrics::observe(&self.metrics.request_duration, seq.admitted.elapsed());
                }
                if seq.running {
                    blocks += seq.blocks;
                    if let Some(kv) = &mut self.kv {
                        kv.release(&mut seq.blocks);
                    }
                    held.push(*id);
                }
            }
        }
        if !held.is_empty() {
            self.release(held, blocks);
        }
    }

    /// Exports queue depth and KV use.
    fn publish_gauges(&self) {
        let (mut running, mut waiting) = (0, 0);
        for seq in self.seqs.values().filter(|s| !s.gone()) {
            if seq.running {
                running += 1;
            } else {
                waiting += 1;
            }
        }
        self.metrics.running.set(running);
        self.metrics.waiting.set(waiting);
        let (total, free) = self.kv.as_ref().map_or((0, 0), |kv| (kv.total(), kv.free()));
        self.metrics.kv_blocks_capacity.set(total as i64);
        self.metrics.kv_blocks_free.set(free as i64);
    }

    /// Frees `seq_ids` on every stage in the background; their `blocks` return to the budget when it finishes.
    fn release(&self, seq_ids: Vec<u64>, blocks: usize) {
        let released = self.released_tx.clone();
        let generation = self.kv_generation;
        let Some(mut client) = self.client.clone() else {
            let _ = released.try_send((generation, blocks));
            return;
        };
        tokio::spawn(async move {
            let req = pb::ReleaseRequest { seq_ids, propagate: true };
            match tokio::time::timeout(RELEASE_TIMEOUT, client.release(req)).await {
                Ok(Ok(_)) => {}
                Ok(Err(status)) => tracing::warn!(error = %status, "release failed"),
                Err(_) => tracing::warn!("release timed out"),
            }
            // Even a failed release gives the blocks back: a stage that still holds them answers
            // RESOURCE_EXHAUSTED, and that batch is preempted and retried.
            let _ = released.send((generation, blocks)).await;
        });
    }
}

/// Micro-batches kept in flight through `stages` stages: stages + 1 = 2 for one stage (one computing, one on the
/// wire), else [`MICRO_BATCHES_PER_STAGE`] per stage.
fn in_flight(stages: usize) -> usize {
    if stages <= 1 { 2 } else { MICRO_BATCHES_PER_STAGE * stages }
}

/// Exports the plan being served.
fn publish_plan(metrics: &Metrics, plan: &Plan) {
    metrics.plan_epoch.set(i64::try_from(plan.epoch.0).unwrap_or(i64::MAX));
    metrics.stages.set(plan.stages.len() as i64);
}

async fn next_response(stream: &mut Option<ForwardStream>) -> Option<Result<pb::ForwardResponse, tonic::Status>> {
    match stream {
        Some(s) => s.rx.next().await,
        None => std::future::pending().await,
    }
}
