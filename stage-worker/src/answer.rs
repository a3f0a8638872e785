//! A batch's answer, sent from the executor thread the moment the batch is computed: hidden states go into the
//! link to the next stage (with this stage's timing appended to the batch's), sampled tokens to the
//! coordinator's `Answers` route when it has one open (`direct`; an acknowledgement goes upstream), else they and
//! errors into the upstream response stream. No task sits between the executor and those queues, so a pipeline
//! hop pays one cross-thread wake-up less (each costs 20-50 µs on the development VMs); batches still leave in the
//! order they were computed, which is their arrival order.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use prost::Message;
use strata_proto::{ServiceError, pb, wire_micros};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tonic::Status;

use crate::direct::DirectAnswers;
use crate::downstream::DownstreamReply;
use crate::executor::{BatchResult, Completion, Handoff, Output};
use crate::metrics::StageMetrics;
use crate::slot::ActiveStage;

/// The upstream stream's responses.
pub(crate) type Responses = mpsc::Sender<Result<pb::ForwardResponse, Status>>;

/// How long an answer dropped unrun waits for the executor's death to be recorded (so the error says why).
const DEATH_WAIT: Duration = Duration::from_secs(1);

/// Decrements the in-flight count when a batch's answer has been sent (or dropped).
pub(crate) struct InflightGuard(Arc<AtomicU32>);

impl InflightGuard {
    pub(crate) fn new(counter: &Arc<AtomicU32>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        InflightGuard(counter.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The answer to a batch that failed here, counted by kind.
pub(crate) fn error_response(metrics: &StageMetrics, batch_id: u64, err: ServiceError) -> pb::ForwardResponse {
    metrics.error(err.code);
    pb::ForwardResponse { batch_id, error: Some(err.into()), ..Default::default() }
}

/// Everything needed to answer one batch.
pub(crate) struct Pending {
    pub stage: Arc<ActiveStage>,
    /// The batch without its hidden states: what travels on to the next stage with the new ones.
    pub meta: pb::ForwardRequest,
    pub out: Responses,
    pub metrics: Arc<StageMetrics>,
    pub guard: InflightGuard,
    /// Open until the batch's output has left this stage (see `server::request_spans`).
    pub traced: Vec<tracing::Span>,
    /// The runtime that waits for the next stage's response.
    pub runtime: Handle,
    /// The coordinator's route for sampled tokens, when it has one open.
    pub direct: DirectAnswers,
}

/// A batch's [`Completion`]: answers exactly once, from the executor or, if dropped unrun, by itself.
pub(crate) struct Answer(Option<Pending>);

impl Answer {
    pub(crate) fn new(pending: Pending) -> Box<Self> {
        Box::new(Answer(Some(pending)))
    }
}

impl Completion for Answer {
    fn complete(mut self: Box<Self>, result: BatchResult) -> Option<Handoff> {
        self.0.take().and_then(|pending| pending.finish(result))
    }
}

impl Drop for Answer {
    /// Only a stopped executor drops a batch unrun (a panic, or a queue that closed): answer `UNAVAILABLE` with
    /// the reason, once the executor's death has been recorded.
    fn drop(&mut self) {
        let Some(p) = self.0.take() else { return };
        let death = p.stage.executor.death();
        let runtime = p.runtime.clone();
        runtime.spawn(async move {
            let _ = tokio::time::timeout(DEATH_WAIT, death.cancelled()).await;
            let err = p.stage.executor.gone();
            let resp = error_response(&p.metrics, p.meta.batch_id, err);
            drop(p.guard);
            let _ = p.out.send(Ok(resp)).await;
        });
    }
}

impl Pending {
    fn finish(mut self, result: BatchResult) -> Option<Handoff> {
        let batch_id = self.meta.batch_id;
        let output = match result {
            Ok(output) => output,
            Err(err) => {
                let resp = error_response(&self.metrics, batch_id, err);
                self.respond(resp);
                return None;
            }
        };
        let mut timing = pb::StageTiming {
            stage_index: self.stage.stage_index,
            compute_micros: output.compute_micros,
            queue_micros: output.queue_micros,
            handoff_micros: 0,
        };
        self.metrics.computed(Duration::from_micros(output.compute_micros));
        let stage = Arc::clone(&self.stage);
        match (output.output, &stage.downstream) {
            (Output::Tokens(tokens), _) => {
                // Up to the response's hand-off to the stream: what follows is transport.
                timing.handoff_micros = wire_micros(output.finished.elapsed());
                let mut timings = std::mem::take(&mut self.meta.timings);
                timings.push(timing);
                let resp = pb::ForwardResponse {
                    batch_id,
                    tokens,
                    stage_compute_micros: timings.iter().map(|t| t.compute_micros).sum(),
                    timings,
                    ..Default::default()
                };
                self.metrics.sent(resp.encoded_len());
                let resp = match self.direct.send(self.meta.term, resp) {
                    Ok(()) => {
                        self.metrics.answered_directly();
                        pb::ForwardResponse { batch_id, answered_directly: true, ..Default::default() }
                    }
                    Err(resp) => resp,
                };
                if resp.answered_directly && stage.stage_index == 0 {
                    // Upstream is the coordinator, which has the answer: nothing to acknowledge.
                    let Pending { guard, traced, .. } = self;
                    drop(guard);
                    drop(traced);
                    return None;
                }
                self.respond(resp);
                None
            }
            (Output::Hidden(hidden), Some(down)) => {
                let Pending { mut meta, out, metrics, guard, traced, runtime, .. } = self;
                let first = stage.stage_index == 0;
                meta.hidden = Some(hidden);
                // Up to the batch's hand-off to the next stage's link.
                timing.handoff_micros = wire_micros(output.finished.elapsed());
                meta.timings.push(timing);
                metrics.sent(meta.encoded_len());
                let down = down.clone();
                let relay = Relay { out, metrics, guard, traced, batch_id, first };
                Some(Box::pin(async move {
                    // Waits while the link's queue is full, so batches go down in the order they were computed.
                    let answer = down.send(meta).await;
                    runtime.spawn(relay.run(answer));
                }))
            }
            (Output::Hidden(_), None) => {
                let err = ServiceError::internal("this stage produced hidden states but has no next stage");
                let resp = error_response(&self.metrics, batch_id, err);
                self.respond(resp);
                None
            }
        }
    }

    /// Queues `resp` upstream without blocking the executor: straight into the stream when it has room, else
    /// from a task (the coordinator matches responses by batch id, so their order does not matter).
    fn respond(self, resp: pb::ForwardResponse) {
        let Pending { out, guard, traced, runtime, .. } = self;
        // Counted as answered before the caller can see the answer.
        drop(guard);
        match out.try_send(Ok(resp)) {
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
            Err(mpsc::error::TrySendError::Full(resp)) => {
                runtime.spawn(async move {
                    let _ = out.send(resp).await;
                    drop(traced);
                });
            }
        }
    }
}

/// What passes the next stage's answer to a batch upstream.
struct Relay {
    out: Responses,
    metrics: Arc<StageMetrics>,
    guard: InflightGuard,
    traced: Vec<tracing::Span>,
    batch_id: u64,
    first: bool,
}

impl Relay {
    async fn run(self, answer: tokio::sync::oneshot::Receiver<DownstreamReply>) {
        let Relay { out, metrics, guard, traced, batch_id, first } = self;
        let resp = match answer.await {
            Ok(Ok(resp)) => resp,
            Ok(Err(err)) => error_response(&metrics, batch_id, err),
            Err(_) => {
                error_response(&metrics, batch_id, ServiceError::unavailable("the link to the next stage stopped"))
            }
        };
        // Counted as answered before the caller can see the answer.
        drop(guard);
        // An acknowledgement frees each earlier stage's wait for this batch; stage 0's upstream is the coordinator,
        // which has the answer already and would only wake up for it.
        if !(first && resp.answered_directly) {
            let _ = out.send(Ok(resp)).await;
        }
        drop(traced);
    }
}
