//! The pipeline actor: the I/O around the [`Scheduler`]. It owns the `Forward` stream to stage 0 and the stage
//! client, the callers' event channels and their [`SeqOutput`]s, and the metrics; it feeds commands, responses and
//! finished releases into the scheduler and executes the [`Effect`]s it returns. Only this task touches that
//! state, so none of it needs a lock.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_proto::{ErrorCode, ServiceError, Tls, pb};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::kv_budget::KvBudget;
use super::output::{SeqOutput, Verdict};
use super::scheduler::{Effect, RequestId, Requeue, Scheduler};
use super::{Command, Finish, ModelInfo, SchedulerLimits, SeqEvent, SeqRequest, StepTiming};
use crate::metrics::Metrics;
use crate::stage_client::{self, ForwardStream, TracedStageClient};
use strata_membership::Plan;

/// Events buffered per sequence before the actor waits for its caller.
const EVENT_BUFFER: usize = 64;
/// How long a `Release` may take. Its blocks stay reserved until it returns, so this only bounds how long a
/// stage that never answers can hold them.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long asking a stage for its status may take.
const STATUS_TIMEOUT: Duration = Duration::from_secs(5);
/// Finished `Release` calls waiting for the actor.
const RELEASED_BUFFER: usize = 256;

/// The caller's side of a request.
struct Caller {
    tx: mpsc::Sender<SeqEvent>,
    span: tracing::Span,
    output: SeqOutput,
    /// When the request was admitted, and when its last token was streamed (latency metrics).
    admitted: Instant,
    last_token: Option<Instant>,
    /// How it ended (`length`, `eos`, `stop`, `error`), for the metrics; unset means cancelled.
    ended: Option<&'static str>,
}

impl Caller {
    fn fail(&mut self, error: ServiceError) {
        self.ended = Some("error");
        let _ = self.tx.try_send(self.output.failed(error));
    }

    fn finish(&mut self, finish: Finish, timing: StepTiming) {
        self.ended = Some(finish.as_str());
        let _ = self.tx.try_send(self.output.done(finish, timing));
    }
}

pub(super) struct Actor {
    model: Arc<ModelInfo>,
    plan: Plan,
    scheduler: Scheduler,
    callers: HashMap<RequestId, Caller>,
    client: Option<TracedStageClient>,
    stream: Option<ForwardStream>,
    /// Finished releases: (budget generation, blocks).
    released_tx: mpsc::Sender<(u64, usize)>,
    released_rx: mpsc::Receiver<(u64, usize)>,
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
            scheduler: Scheduler::new(limits, plan.epoch.0, plan.stages.len()),
            plan,
            callers: HashMap::new(),
            client: None,
            stream: None,
            released_tx,
            released_rx,
            tls,
            metrics,
        }
    }

    pub(super) async fn run(mut self, mut commands: mpsc::Receiver<Command>, shutdown: CancellationToken) {
        loop {
            self.notice_cancelled();
            let effects = self.scheduler.reap();
            self.apply(effects).await;
            if self.stream.is_none() && self.scheduler.has_waiting() {
                // Sequences carried over from an old plan (or a broken stream) wait for the new stage 0.
                if let Err(e) = self.ensure_connected().await {
                    let mut effects = self.scheduler.fail_all(&e);
                    effects.extend(self.scheduler.reap());
                    self.apply(effects).await;
                }
            }
            if self.stream.is_some() {
                let effects = self.scheduler.schedule(Instant::now());
                self.apply(effects).await;
            }
            self.publish_gauges();
            let waiting = self.scheduler.batches_in_flight() > 0;
            tokio::select! {
                () = shutdown.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    None => break,
                    Some(Command::Submit { req, span, reply }) => {
                        let result = self.admit(req, span).await;
                        let _ = reply.send(result);
                    }
                    Some(Command::SetPlan(plan)) => self.set_plan(plan).await,
                },
                resp = next_response(&mut self.stream), if waiting => self.on_response(resp).await,
                Some((generation, n)) = self.released_rx.recv() => self.scheduler.released(generation, n),
            }
        }
        let mut effects = self.scheduler.fail_all(&ServiceError::unavailable("the coordinator is shutting down"));
        effects.extend(self.scheduler.reap());
        self.apply(effects).await;
    }

    /// Tells the scheduler about callers that dropped their receiver.
    fn notice_cancelled(&mut self) {
        for (req, caller) in &self.callers {
            if caller.tx.is_closed() {
                self.scheduler.cancel(*req);
            }
        }
    }

    /// Switches to `plan` if it differs: the scheduler requeues every active sequence, their releases go to the
    /// old stages, and the next loop connects to the new stage 0.
    async fn set_plan(&mut self, plan: Plan) {
        if plan.epoch == self.plan.epoch && plan.stages == self.plan.stages {
            return;
        }
        tracing::info!(epoch = %plan.epoch, stages = plan.stages.len(), "switching to a new plan");
        self.notice_cancelled();
        let effects = self.scheduler.set_plan(plan.epoch.0, plan.stages.len());
        // Free what the old stages hold (they may keep serving another epoch) before forgetting the client.
        self.apply(effects).await;
        publish_plan(&self.metrics, &plan);
        self.plan = plan;
        self.client = None;
        self.stream = None;
    }

    /// Opens the `Forward` stream to stage 0 and learns the KV capacity of every stage.
    async fn ensure_connected(&mut self) -> Result<(), ServiceError> {
        if self.stream.is_some() && self.scheduler.has_budget() {
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
        self.scheduler.set_budget(kv);
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
        self.notice_cancelled();
        let id = span.in_scope(|| self.scheduler.admit(&req))?;
        let (tx, rx) = mpsc::channel(EVENT_BUFFER.max(req.max_tokens + 2).min(4096));
        self.metrics.prompt_tokens.inc_by(req.prompt_ids.len() as u64);
        let output = SeqOutput::new(&req);
        self.callers.insert(id, Caller { tx, span, output, admitted: Instant::now(), last_token: None, ended: None });
        Ok(rx)
    }

    async fn on_response(&mut self, resp: Option<Result<pb::ForwardResponse, tonic::Status>>) {
        let effects = match resp {
            Some(Ok(r)) => self.scheduler.apply_response(r, Instant::now()),
            Some(Err(status)) => self.stream_broken(ServiceError::from(status)),
            None => self.stream_broken(ServiceError::unavailable("stage 0 closed the Forward stream")),
        };
        self.apply(effects).await;
    }

    fn stream_broken(&mut self, err: ServiceError) -> Vec<Effect> {
        tracing::warn!(error = %err, in_flight = self.scheduler.batches_in_flight(), "Forward stream to stage 0 broke");
        self.stream = None;
        self.scheduler.fail_all(&err)
    }

    /// Executes the scheduler's effects in order (and those of a stream that breaks on sending).
    async fn apply(&mut self, effects: Vec<Effect>) {
        let mut effects = VecDeque::from(effects);
        while let Some(effect) = effects.pop_front() {
            match effect {
                Effect::Send(batch) => {
                    // A stream that broke on an earlier batch of this round already failed this one's sequences.
                    let Some(stream) = &self.stream else { continue };
                    let (batch_id, tokens) = (batch.batch_id, batch.token_ids.len());
                    let sent = stream.tx.send(batch).await.is_ok();
                    self.metrics.batch_tokens.observe(tokens as f64);
                    if !sent {
                        let error = ServiceError::unavailable("the Forward stream to stage 0 closed");
                        effects.extend(self.stream_broken(error));
                        continue;
                    }
                    tracing::trace!(batch_id, "batch sent");
                }
                Effect::Release { seq_ids, blocks, generation } => self.release(seq_ids, blocks, generation),
                Effect::Token { req, token, timing } => self.on_token(req, &token, timing),
                Effect::Fail { req, error } => {
                    if let Some(caller) = self.callers.get_mut(&req) {
                        caller.fail(error);
                    }
                }
                Effect::Requeued { why, .. } => match why {
                    Requeue::KvFull => self.metrics.preempted("kv_full"),
                    Requeue::StageOutOfKv => self.metrics.preempted("stage_out_of_kv"),
                    Requeue::PlanChanged => {}
                },
                Effect::BatchReturned { elapsed } => Metrics::observe(&self.metrics.batch_duration, elapsed),
                Effect::Ended { req } => self.forget(req),
            }
        }
    }

    /// Streams a sampled token to its caller and tells the scheduler if the sequence ended there.
    fn on_token(&mut self, req: RequestId, token: &pb::SampledToken, timing: StepTiming) {
        let Some(caller) = self.callers.get_mut(&req) else { return self.scheduler.finish(req) };
        if caller.tx.is_closed() {
            return self.scheduler.finish(req);
        }
        let (event, verdict) = caller.output.push(&self.model, token);
        if let Some(event) = event {
            if caller.tx.try_send(event).is_err() {
                // Caller gone (or hopelessly behind): cancel.
                return self.scheduler.finish(req);
            }
            let now = Instant::now();
            match caller.last_token.replace(now) {
                None => Metrics::observe(&self.metrics.time_to_first_token, now - caller.admitted),
                Some(last) => Metrics::observe(&self.metrics.inter_token_latency, now - last),
            }
            self.metrics.generation_tokens.inc();
        }
        match verdict {
            Verdict::Continue => return,
            Verdict::Finish(finish) => caller.finish(finish, timing),
            Verdict::Fail(error) => caller.fail(error),
        }
        self.scheduler.finish(req);
    }

    /// Drops the caller of a request the scheduler forgot, counting how it ended.
    fn forget(&mut self, req: RequestId) {
        let Some(caller) = self.callers.remove(&req) else { return };
        caller.span.in_scope(|| tracing::debug!(generated = caller.output.generated(), "sequence released"));
        let reason = caller.ended.unwrap_or("cancelled");
        self.metrics.finished(reason);
        if !matches!(reason, "cancelled" | "error") {
            Metrics::observe(&self.metrics.request_duration, caller.admitted.elapsed());
        }
    }

    /// Exports queue depth and KV use.
    fn publish_gauges(&self) {
        let g = self.scheduler.gauges();
        self.metrics.running.set(g.running);
        self.metrics.waiting.set(g.waiting);
        self.metrics.kv_blocks_capacity.set(g.kv_total as i64);
        self.metrics.kv_blocks_free.set(g.kv_free as i64);
    }

    /// Frees `seq_ids` on every stage in the background; their `blocks` of budget `generation` return to the
    /// budget when it finishes.
    fn release(&self, seq_ids: Vec<u64>, blocks: usize, generation: u64) {
        let released = self.released_tx.clone();
        let Some(mut client) = self.client.clone() else {
            let _ = released.try_send((generation, blocks));
            return;
        };
        tokio::spawn(async move {
            let req = pb::ReleaseRequest { seq_ids, propagate: true, term: 0 };
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
