//! The pipeline actor: the I/O around the [`Scheduler`]. It owns the `Forward` stream to stage 0 and the clients
//! of the stages, the callers' event channels and their [`SeqOutput`]s, and the metrics; it feeds commands,
//! responses, finished releases, connection attempts and timers into the scheduler and executes the [`Effect`]s
//! it returns. Only this task touches that state, so none of it needs a lock, and nothing here awaits stage I/O:
//! connecting runs in a spawned task ([`link`](super::link)), batches go out with `try_send`, releases are spawned.
//!
//! When the stages fail (a batch error, a broken stream, a batch overdue) the scheduler requeues every sequence
//! and the actor drops the stream and probes the stages again at once, then with backoff; the stages that do not
//! answer are reported as suspects so the control loop plans around them, and the sequences are recomputed
//! through whichever pipeline comes next. Work fails only when no pipeline is found within the recovery timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_membership::{Backoff, Plan};
use strata_proto::{ErrorCode, ServiceError, pb};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::link::{Connected, Dialer, Failed, Suspect};
use super::output::{SeqOutput, Verdict};
use super::scheduler::{Effect, RequestId, Requeue, Scheduler, StallCause};
use super::{Command, Finish, ModelInfo, PipelineOptions, SeqEvent, SeqRequest, StepTiming, Timeouts};
use crate::metrics::{Metrics, Route};
use crate::stage_client::{ForwardStream, TracedStageClient, Via};

mod connect;
mod recovery;

use recovery::STOPPED_AFTER;

/// Events buffered per sequence before the actor waits for its caller.
const EVENT_BUFFER: usize = 64;
/// How long a `Release` may take. Its blocks stay reserved until it returns, so this only bounds how long a
/// stage that never answers can hold them.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(60);
/// Finished `Release` calls waiting for the actor.
const RELEASED_BUFFER: usize = 256;
/// Reconnection attempts back off from the first delay to the cap.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_CAP: Duration = Duration::from_secs(1);

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
    /// The request's error event, to deliver.
    fn fail(&mut self, error: ServiceError) -> SeqEvent {
        self.ended = Some("error");
        self.span.set_attribute("error.type", error.code.as_str().to_owned());
        self.record_usage();
        self.output.failed(error)
    }

    /// The request's last event, to deliver.
    fn finish(&mut self, finish: Finish, timing: StepTiming) -> SeqEvent {
        self.ended = Some(finish.as_str());
        self.span.set_attribute("gen_ai.response.finish_reasons", finish.as_str());
        // OpenTelemetry's name for prompt tokens served from a cache (counted in `gen_ai.usage.input_tokens` too).
        self.span.set_attribute("gen_ai.usage.cache_read.input_tokens", i64::from(timing.cached_tokens));
        self.record_usage();
        self.output.done(finish, timing)
    }

    /// OpenTelemetry GenAI attributes of the finished request on its span (exported with it, if traced).
    fn record_usage(&self) {
        self.span.set_attribute("gen_ai.usage.output_tokens", self.output.generated() as i64);
    }
}

/// A request waiting for the stages' KV budget before it can be validated and queued.
struct PendingSubmit {
    req: SeqRequest,
    span: tracing::Span,
    reply: oneshot::Sender<Result<mpsc::Receiver<SeqEvent>, ServiceError>>,
}

/// The result of one connection attempt, tagged with the attempt it answers.
type Attempt = (u64, Result<Connected, Failed>);

/// An event for a caller, held until the next batch has gone out (see [`Actor::deliver`]).
struct Outgoing {
    req: RequestId,
    tx: mpsc::Sender<SeqEvent>,
    event: SeqEvent,
}

pub(super) struct Actor {
    model: Arc<ModelInfo>,
    plan: Plan,
    scheduler: Scheduler,
    callers: HashMap<RequestId, Caller>,
    /// Clients of every stage of the plan last connected (releases go to each), and the stream to its stage 0.
    clients: Vec<TracedStageClient>,
    stream: Option<ForwardStream>,
    dialer: Dialer,
    timeouts: Timeouts,
    /// The latest connection attempt (older answers are ignored) and whether it is still running.
    attempt: u64,
    connecting: bool,
    attempts_tx: mpsc::Sender<Attempt>,
    attempts_rx: mpsc::Receiver<Attempt>,
    /// When to try connecting again, after a failed attempt.
    retry_at: Option<Instant>,
    backoff: Backoff,
    /// Since when work has been waiting without a pipeline, and why the last attempt failed.
    stalled_since: Option<Instant>,
    last_error: Option<ServiceError>,
    pending: VecDeque<PendingSubmit>,
    suspects: Option<mpsc::Sender<Suspect>>,
    /// Set once a graceful shutdown began: new requests are refused; the senders hear when nothing is left.
    quiescing: Option<Vec<oneshot::Sender<()>>>,
    /// Set when the stages follow a newer coordinator: refuse everything until this one leads again (a new plan).
    deposed: Option<ServiceError>,
    /// Finished releases: (budget generation, blocks, cached blocks used).
    released_tx: mpsc::Sender<(u64, usize, Vec<u64>)>,
    released_rx: mpsc::Receiver<(u64, usize, Vec<u64>)>,
    /// `Release` calls spawned and not yet returned.
    releasing: usize,
    /// Since when the scheduler has had work left and nothing to wait for ([`Actor::check_stopped`]).
    stopped_since: Option<Instant>,
    /// Callers' events of this round, in order, delivered once its batches are on their way ([`Actor::deliver`]).
    outbox: Vec<Outgoing>,
    /// Whether this round sent a batch.
    sent: bool,
    metrics: Arc<Metrics>,
}

impl Actor {
    pub(super) fn new(model: Arc<ModelInfo>, plan: Plan, options: PipelineOptions, metrics: Arc<Metrics>) -> Self {
        let (released_tx, released_rx) = mpsc::channel(RELEASED_BUFFER);
        let (attempts_tx, attempts_rx) = mpsc::channel(4);
        publish_plan(&metrics, &plan);
        let PipelineOptions { limits, tls, timeouts, keepalive, suspects } = options;
        Actor {
            model,
            scheduler: Scheduler::new(limits, plan.epoch.0, plan.term, plan.stages.len()),
            plan,
            callers: HashMap::new(),
            clients: Vec::new(),
            stream: None,
            dialer: Dialer { tls, keepalive, probe_timeout: timeouts.probe },
            timeouts,
            attempt: 0,
            connecting: false,
            attempts_tx,
            attempts_rx,
            retry_at: None,
            backoff: Backoff::new(RETRY_FIRST, RETRY_CAP),
            stalled_since: None,
            last_error: None,
            pending: VecDeque::new(),
            suspects,
            quiescing: None,
            deposed: None,
            released_tx,
            released_rx,
            releasing: 0,
            stopped_since: None,
            outbox: Vec::new(),
            sent: false,
            metrics,
        }
    }

    pub(super) async fn run(mut self, mut commands: mpsc::Receiver<Command>, shutdown: CancellationToken) {
        loop {
            self.notice_cancelled();
            let effects = self.scheduler.reap();
            self.apply(effects);
            let now = Instant::now();
            self.check_overdue(now);
            self.check_recovery(now);
            self.drive_link(now);
            if self.stream.is_some() {
                let effects = self.scheduler.schedule(now);
                self.apply(effects);
            }
            // Every round, not only with a stream: without one there is no budget, so this also forgets a
            // watch begun before the stream dropped (its deadline would otherwise wake the loop without end).
            self.check_stopped(now);
            self.deliver().await;
            self.notify_quiesced();
            self.publish_gauges();
            let waiting = self.scheduler.batches_in_flight() > 0;
            let wake = tokio::time::Instant::from_std(self.next_wakeup(now));
            tokio::select! {
                () = shutdown.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    None => break,
                    Some(cmd) => self.command(cmd),
                },
                resp = next_response(&mut self.stream), if waiting => self.on_response(resp),
                Some((generation, n, cached)) = self.released_rx.recv() => {
                    self.releasing = self.releasing.saturating_sub(1);
                    self.scheduler.released(generation, n, &cached);
                }
                Some((attempt, result)) = self.attempts_rx.recv() => self.on_attempt(attempt, result),
                () = tokio::time::sleep_until(wake) => {}
            }
        }
        self.fail_everything(ServiceError::unavailable("the coordinator is shutting down"));
        self.deliver().await;
    }

    /// Hands this round's events to their callers. When the round sent a batch, the task first yields once so the
    /// batch is written to stage 0 before anything else runs: waking the callers' tasks first would put their
    /// wake-ups (and on a busy runtime a system call to rouse another worker) ahead of the batch, in every step's
    /// round trip. A caller that is gone or hopelessly behind is cancelled.
    async fn deliver(&mut self) {
        let sent = std::mem::take(&mut self.sent);
        if self.outbox.is_empty() {
            return;
        }
        if sent {
            tokio::task::yield_now().await;
        }
        for Outgoing { req, tx, event } in std::mem::take(&mut self.outbox) {
            if tx.try_send(event).is_err() {
                self.scheduler.finish(req);
            }
        }
    }

    /// Queues `event` for `req`'s caller ([`Actor::deliver`] sends it).
    fn post(&mut self, req: RequestId, event: SeqEvent) {
        if let Some(caller) = self.callers.get(&req) {
            self.outbox.push(Outgoing { req, tx: caller.tx.clone(), event });
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { req, span, reply } => self.submit(PendingSubmit { req, span, reply }),
            Command::SetPlan(plan) => self.set_plan(plan),
            Command::Quiesce(done) => {
                tracing::info!(active = self.callers.len(), "quiescing: new requests are refused");
                self.quiescing.get_or_insert_with(Vec::new).push(done);
            }
        }
    }

    /// Admits `p` now if the stages' budget is known, else keeps it until the pipeline is connected.
    fn submit(&mut self, p: PendingSubmit) {
        let refuse = if let Some(error) = &self.deposed {
            Some(error.clone())
        } else if self.quiescing.is_some() {
            Some(ServiceError::unavailable("the coordinator is shutting down; retry on another coordinator"))
        } else if self.plan.stages.is_empty() {
            Some(ServiceError::unavailable(
                "no plan is being served (this coordinator is not the leader, or no stages are ready)",
            ))
        } else if self.pending.len() >= self.scheduler.max_concurrent_requests() {
            Some(ServiceError::resource_exhausted("overloaded: too many requests wait for the stages; retry later"))
        } else {
            None
        };
        if let Some(error) = refuse {
            self.metrics.rejected(rejection_reason(error.code));
            let _ = p.reply.send(Err(error));
            return;
        }
        if self.stream.is_some() && self.scheduler.has_budget() {
            let result = self.admit(p.req, p.span);
            let _ = p.reply.send(result);
        } else {
            self.pending.push_back(p);
        }
    }

    fn admit(&mut self, req: SeqRequest, span: tracing::Span) -> Result<mpsc::Receiver<SeqEvent>, ServiceError> {
        self.notice_cancelled();
        let result = span.in_scope(|| self.scheduler.admit(&req));
        let id = match result {
            Ok(id) => id,
            Err(e) => {
                self.metrics.rejected(rejection_reason(e.code));
                return Err(e);
            }
        };
        self.metrics.requests_admitted.inc();
        if let Some(traceparent) = strata_proto::traceparent_of(&span) {
            self.scheduler.trace(id, traceparent);
            span.set_attribute("gen_ai.request.model", self.model.name.clone());
            span.set_attribute("gen_ai.usage.input_tokens", req.prompt_ids.len() as i64);
            span.set_attribute("gen_ai.request.max_tokens", req.max_tokens as i64);
        }
        let (tx, rx) = mpsc::channel(EVENT_BUFFER.max(req.max_tokens + 2).min(4096));
        self.metrics.prompt_tokens.inc_by(req.prompt_ids.len() as u64);
        let output = SeqOutput::new(&req);
        self.callers.insert(id, Caller { tx, span, output, admitted: Instant::now(), last_token: None, ended: None });
        Ok(rx)
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
    /// old stages, and the link to the new stages is made at once.
    fn set_plan(&mut self, plan: Plan) {
        if plan.epoch == self.plan.epoch && plan.term == self.plan.term && plan.stages == self.plan.stages {
            return;
        }
        tracing::info!(epoch = %plan.epoch, term = plan.term, stages = plan.stages.len(), "switching to a new plan");
        self.notice_cancelled();
        let effects = self.scheduler.set_plan(plan.epoch.0, plan.term, plan.stages.len());
        // Free what the old stages hold (they may keep serving another epoch) before forgetting their clients.
        self.apply(effects);
        publish_plan(&self.metrics, &plan);
        self.plan = plan;
        self.clients.clear();
        self.stream = None;
        self.attempt += 1;
        self.connecting = false;
        self.retry_at = None;
        self.backoff.reset();
        self.deposed = None;
        if self.plan.stages.is_empty() {
            // Deposed or standing by: callers should go to the leader now; running sequences wait for a plan.
            let error = ServiceError::unavailable("this coordinator stopped serving (it is not the leader)");
            for p in self.pending.drain(..) {
                let _ = p.reply.send(Err(error.clone()));
            }
        }
    }

    /// When the loop must wake up even if nothing arrives: the next retry, batch deadline or recovery deadline.
    fn next_wakeup(&self, now: Instant) -> Instant {
        let mut wake = now + Duration::from_secs(3600);
        if self.stream.is_none()
            && !self.connecting
            && let Some(t) = self.retry_at
        {
            wake = wake.min(t);
        }
        if let Some(sent) = self.scheduler.oldest_batch_sent() {
            wake = wake.min(sent + self.timeouts.batch);
        }
        if let Some(since) = self.stalled_since {
            wake = wake.min(since + self.timeouts.recovery);
        }
        if let Some(since) = self.stopped_since {
            wake = wake.min(since + STOPPED_AFTER);
        }
        wake.max(now)
    }

    /// Tells those waiting for a graceful shutdown that nothing is left to do.
    fn notify_quiesced(&mut self) {
        if self.scheduler.is_idle()
            && self.pending.is_empty()
            && let Some(waiters) = self.quiescing.as_mut()
        {
            for done in waiters.drain(..) {
                let _ = done.send(());
            }
        }
    }

    fn on_response(&mut self, resp: Option<Result<(pb::ForwardResponse, Via), tonic::Status>>) {
        let effects = match resp {
            Some(Ok((r, via))) => {
                self.metrics.answers.get_or_create(&Route { route: via.as_str() }).inc();
                self.scheduler.apply_response(r, Instant::now())
            }
            Some(Err(status)) => {
                let error = ServiceError::from(status);
                self.scheduler.stall(&error, StallCause::of(error.code))
            }
            None => self
                .scheduler
                .stall(&ServiceError::unavailable("stage 0 closed the Forward stream"), StallCause::Unavailable),
        };
        self.apply(effects);
    }

    /// Executes the scheduler's effects in order (and those of a stream that breaks on sending).
    fn apply(&mut self, effects: Vec<Effect>) {
        let mut effects = VecDeque::from(effects);
        while let Some(effect) = effects.pop_front() {
            match effect {
                Effect::Send(batch) => {
                    // A stream that broke on an earlier batch of this round already requeued this one's sequences.
                    let Some(stream) = &self.stream else { continue };
                    let tokens = batch.token_ids.len();
                    // The stream's buffer holds more batches than are ever in flight, so it is full only when stage
                    // 0 stopped reading: a failure, like a closed stream.
                    if let Err(e) = stream.tx.try_send(batch) {
                        let error = ServiceError::unavailable(match e {
                            mpsc::error::TrySendError::Full(_) => "stage 0 stopped reading the Forward stream",
                            mpsc::error::TrySendError::Closed(_) => "the Forward stream to stage 0 closed",
                        });
                        effects.extend(self.scheduler.stall(&error, StallCause::Unavailable));
                        continue;
                    }
                    self.metrics.batch_tokens.observe(tokens as f64);
                    self.sent = true;
                }
                Effect::Release { seq_ids, blocks, cached, generation } => {
                    self.release(seq_ids, blocks, cached, generation);
                }
                Effect::Token { req, token, timing } => self.on_token(req, &token, timing),
                Effect::Fail { req, error } => {
                    if let Some(caller) = self.callers.get_mut(&req) {
                        let event = caller.fail(error);
                        self.post(req, event);
                    }
                }
                Effect::Requeued { why, .. } => match why {
                    Requeue::KvFull => self.metrics.preempted("kv_full"),
                    Requeue::StageOutOfKv => self.metrics.preempted("stage_out_of_kv"),
                    Requeue::StageFailed => self.metrics.preempted("stage_failed"),
                    Requeue::PlanChanged => {}
                },
                Effect::BatchReturned { elapsed, stages } => {
                    Metrics::observe(&self.metrics.batch_duration, elapsed);
                    let mut computed = Duration::ZERO;
                    for t in &stages {
                        let took = Duration::from_micros(t.compute_micros);
                        self.metrics.stage_computed(t.stage_index, took);
                        computed += took;
                    }
                    Metrics::observe(&self.metrics.pipeline_overhead, elapsed.saturating_sub(computed));
                }
                Effect::Started { req } => {
                    if let Some(caller) = self.callers.get(&req) {
                        Metrics::observe(&self.metrics.queue_time, caller.admitted.elapsed());
                    }
                }
                Effect::Stalled { error, cause } => self.stalled(error, cause),
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
            self.outbox.push(Outgoing { req, tx: caller.tx.clone(), event });
            let now = Instant::now();
            match caller.last_token.replace(now) {
                None => {
                    let ttft = now - caller.admitted;
                    Metrics::observe(&self.metrics.time_to_first_token, ttft);
                    caller.span.set_attribute("gen_ai.server.time_to_first_token", ttft.as_secs_f64());
                }
                Some(last) => Metrics::observe(&self.metrics.inter_token_latency, now - last),
            }
            self.metrics.generation_tokens.inc();
        }
        let last = match verdict {
            Verdict::Continue => return,
            Verdict::Finish(finish) => caller.finish(finish, timing),
            Verdict::Fail(error) => caller.fail(error),
        };
        self.outbox.push(Outgoing { req, tx: caller.tx.clone(), event: last });
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
        self.metrics.waiting.set(g.waiting + self.pending.len() as i64);
        self.metrics.kv_blocks_capacity.set(g.kv_total as i64);
        self.metrics.kv_blocks_free.set(g.kv_free as i64);
        let used = g.kv_total.saturating_sub(g.kv_free) as f64;
        self.metrics.kv_usage_ratio.set(if g.kv_total == 0 { 0.0 } else { used / g.kv_total as f64 });
        self.metrics.kv_blocks_cached.set(g.kv_cached as i64);
        // The scheduler counts from the start; the counters catch up.
        for (counter, total) in [
            (&self.metrics.prefix_cache_queries, g.prefix.queried_tokens),
            (&self.metrics.prefix_cache_hits, g.prefix.hit_tokens),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// Frees `seq_ids` on every stage in the background (each stage directly, so a dead stage does not keep the
    /// others from freeing theirs); their `blocks` of budget `generation` return to the budget when it finishes,
    /// and the `cached` blocks they used lose a reference.
    fn release(&mut self, seq_ids: Vec<u64>, blocks: usize, cached: Vec<u64>, generation: u64) {
        self.releasing += 1;
        let released = self.released_tx.clone();
        let clients = self.clients.clone();
        let term = self.plan.term;
        tokio::spawn(async move {
            let calls = clients.into_iter().map(|mut client| {
                let req = pb::ReleaseRequest { seq_ids: seq_ids.clone(), propagate: false, term };
                async move {
                    match tokio::time::timeout(RELEASE_TIMEOUT, client.release(req)).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(status)) => tracing::debug!(error = %status, "release failed"),
                        Err(_) => tracing::debug!("release timed out"),
                    }
                }
            });
            futures_util::future::join_all(calls).await;
            // Even a failed release gives the blocks back: a stage that still holds them answers
            // RESOURCE_EXHAUSTED, and that batch is preempted and retried.
            let _ = released.send((generation, blocks, cached)).await;
        });
    }
}

/// The `requests_rejected` label of a request refused with `code`.
fn rejection_reason(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::ResourceExhausted => "overloaded",
        ErrorCode::InvalidArgument => "too_long",
        _ => "unavailable",
    }
}

/// Exports the plan being served.
fn publish_plan(metrics: &Metrics, plan: &Plan) {
    metrics.plan_epoch.set(i64::try_from(plan.epoch.0).unwrap_or(i64::MAX));
    metrics.stages.set(plan.stages.len() as i64);
}

async fn next_response(
    stream: &mut Option<ForwardStream>,
) -> Option<Result<(pb::ForwardResponse, Via), tonic::Status>> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}
