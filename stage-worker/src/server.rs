//! The `Stage` gRPC service: a thin layer that checks each micro-batch's plan epoch and coordinator term, feeds
//! it to the executor in arrival order, hands its output to the next stage (or answers with sampled tokens, on the
//! coordinator's `Answers` stream when it has one open here), and relays responses upstream.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use prost::Message;

use strata_proto::pb;
use strata_proto::pb::stage_server::Stage;
use strata_proto::{ServiceError, WireLayers, context_from_traceparent, set_parent_from_metadata, wire_u32};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::answer::{Answer, InflightGuard, Pending, Responses, error_response};
use crate::direct::DirectAnswers;
use crate::metrics::StageMetrics;
use crate::slot::{ActiveStage, StageSlot};

/// Responses buffered per upstream stream.
const STREAM_DEPTH: usize = 64;

/// The `Stage` service of one worker (a cheap handle: each `Forward` stream's reader holds a copy).
#[derive(Clone)]
pub struct StageService {
    node_id: String,
    slot: StageSlot,
    inflight: Arc<AtomicU32>,
    metrics: Arc<StageMetrics>,
    shutdown: CancellationToken,
    direct: DirectAnswers,
}

impl StageService {
    /// A service running batches on whatever stage `slot` holds when they arrive, counting them in `metrics`.
    /// Open `Forward` streams stop taking batches when `shutdown` is cancelled.
    pub fn new(node_id: String, slot: StageSlot, metrics: Arc<StageMetrics>, shutdown: CancellationToken) -> Self {
        StageService { node_id, slot, inflight: Arc::default(), metrics, shutdown, direct: DirectAnswers::default() }
    }

    /// Batches received and not yet answered, as the service counts them.
    pub fn inflight(&self) -> Arc<AtomicU32> {
        self.inflight.clone()
    }
}

fn no_stage() -> ServiceError {
    ServiceError::unavailable("no layers loaded: this worker is waiting for a plan that names it")
}

#[tonic::async_trait]
impl Stage for StageService {
    type ForwardStream = ReceiverStream<Result<pb::ForwardResponse, Status>>;

    async fn forward(
        &self,
        request: Request<Streaming<pb::ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStream>, Status> {
        let span = tracing::info_span!("forward_stream", node = %self.node_id);
        if let Err(e) = set_parent_from_metadata(&span, request.metadata()) {
            tracing::debug!(error = %e, "no usable trace context on the Forward stream");
        }
        let inbound = request.into_inner();
        let (out_tx, out_rx) = mpsc::channel(STREAM_DEPTH);
        let reader = read_batches(inbound, self.clone(), out_tx);
        tokio::spawn(tracing::Instrument::instrument(reader, span));
        Ok(Response::new(ReceiverStream::new(out_rx)))
    }

    type AnswersStream = ReceiverStream<Result<pb::ForwardResponse, Status>>;

    async fn answers(&self, request: Request<pb::AnswersRequest>) -> Result<Response<Self::AnswersStream>, Status> {
        let term = request.into_inner().term;
        // As a batch of that term would: a newer coordinator's stream raises the term and fences the older off.
        self.slot.term().admit(term, format_args!("answers stream"))?;
        tracing::debug!(node = %self.node_id, term, "coordinator's Answers stream open");
        Ok(Response::new(ReceiverStream::new(self.direct.open(term, &self.shutdown))))
    }

    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        let req = request.into_inner();
        // A newer term frees everything of the older ones on the executor before this release runs; the
        // propagated request keeps its term, so each stage does the same.
        self.slot.term().admit(req.term, format_args!("release"))?;
        let stage = self.slot.current().ok_or_else(no_stage)?;
        let released = stage.executor.release(req.seq_ids.clone()).await?;
        if req.propagate
            && let Some(down) = &stage.downstream
        {
            down.release(req).await?;
        }
        Ok(Response::new(pb::ReleaseResponse { released }))
    }

    async fn status(&self, _request: Request<pb::StageStatusRequest>) -> Result<Response<pb::StageStatus>, Status> {
        let inflight_batches = self.inflight.load(Ordering::Relaxed);
        let term = self.slot.term().current();
        let Some(stage) = self.slot.current() else {
            return Ok(Response::new(pb::StageStatus {
                node_id: self.node_id.clone(),
                inflight_batches,
                term,
                ..Default::default()
            }));
        };
        let facts = stage.executor.facts();
        let layers = WireLayers::try_from(facts.layers.clone())?;
        Ok(Response::new(pb::StageStatus {
            node_id: self.node_id.clone(),
            layer_start: layers.start,
            layer_end: layers.end,
            plan_epoch: stage.plan_epoch.unwrap_or(0),
            kv_total_blocks: facts.kv_total_blocks,
            kv_free_blocks: stage.executor.kv_free_blocks(),
            kv_cached_blocks: stage.executor.kv_cached_blocks(),
            batch_invariant: facts.batch_invariant,
            block_size: facts.block_size,
            inflight_batches,
            device: facts.device.clone(),
            weight_bytes: facts.weight_bytes,
            offloaded_layers: wire_u32("offloaded layer count", facts.offloaded_layers.len())?,
            term,
        }))
    }
}

/// Refuses a batch scheduled under another plan epoch than the stage serves (checked on arrival: a batch that
/// was accepted before a swap to a new epoch still runs on the stage it arrived at).
fn check_epoch(stage: &ActiveStage, batch: &pb::ForwardRequest) -> Result<(), ServiceError> {
    match stage.plan_epoch {
        Some(epoch) if batch.plan_epoch != epoch => Err(ServiceError::failed_precondition(format!(
            "batch {} was scheduled under plan epoch {}, this stage serves epoch {epoch}",
            batch.batch_id, batch.plan_epoch
        ))),
        _ => Ok(()),
    }
}

/// One span per traced sequence of `batch` (its chunk carries the request's `traceparent`), a child of the
/// coordinator's span for that request, open from the batch's arrival until its output has left the stage; the
/// executor records the compute under it. Every stage's work on a request thus lands in the request's trace.
fn request_spans(node_id: &str, stage: &ActiveStage, batch: &pb::ForwardRequest) -> Vec<tracing::Span> {
    batch
        .chunks
        .iter()
        .filter(|c| !c.traceparent.is_empty())
        .map(|c| {
            let span = tracing::info_span!(
                parent: None,
                "stage_forward",
                node = node_id,
                stage = stage.stage_index,
                batch_id = batch.batch_id,
                batch_sequences = batch.chunks.len(),
                seq_id = c.seq_id,
                tokens = c.len,
            );
            if let Err(e) = span.set_parent(context_from_traceparent(&c.traceparent)) {
                tracing::debug!(error = %e, "cannot record a stage span in its request's trace");
            }
            span
        })
        .collect()
}

/// Takes batches off an upstream stream and queues them on the executor without waiting for results, so
/// batch N+1 computes while batch N is downstream; each batch's [`Answer`] sends its output on from the executor.
async fn read_batches(mut inbound: Streaming<pb::ForwardRequest>, service: StageService, out: Responses) {
    let StageService { node_id, slot, inflight, metrics, shutdown, direct } = service;
    let runtime = Handle::current();
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => break,
            next = inbound.message() => next,
        };
        let mut batch = match next {
            Ok(Some(batch)) => batch,
            Ok(None) => break,
            Err(status) => {
                tracing::debug!(%status, "upstream Forward stream ended with an error");
                break;
            }
        };
        let received = Instant::now();
        metrics.received(batch.encoded_len());
        let guard = InflightGuard::new(&inflight);
        let batch_id = batch.batch_id;
        // The term first: a newer leader's batch raises it even on a stage with nothing loaded.
        let admitted = slot.term().admit(batch.term, format_args!("batch {batch_id}"));
        let stage = match admitted.and_then(|()| slot.current().ok_or_else(no_stage)) {
            Ok(stage) => stage,
            Err(err) => {
                let _ = out.send(Ok(error_response(&metrics, batch_id, err))).await;
                continue;
            }
        };
        if let Err(err) = check_epoch(&stage, &batch) {
            let _ = out.send(Ok(error_response(&metrics, batch_id, err))).await;
            continue;
        }
        // The executor takes the hidden states; the rest travels on to the next stage.
        let hidden = batch.hidden.take();
        let meta = batch.clone();
        batch.hidden = hidden;
        let traced = request_spans(&node_id, &stage, &batch);
        let on = Arc::clone(&stage);
        let answer = Answer::new(Pending {
            stage,
            meta,
            out: out.clone(),
            metrics: metrics.clone(),
            guard,
            traced: traced.clone(),
            runtime: runtime.clone(),
            direct: direct.clone(),
        });
        if let Err(err) = on.executor.submit(batch, traced, received, answer).await {
            // The answer, dropped unrun, reports the batch.
            tracing::debug!(batch_id, error = %err, "the executor has stopped");
        }
    }
}
