//! The stage worker's Prometheus metrics, served at `GET /metrics` (OpenMetrics text) on `--metrics-listen`. The
//! data path counts batches, bytes, errors and compute time as they happen; what the stage holds (KV blocks,
//! weights, layers, plan epoch, term, queue depth, resident memory) is read from the served stage when scraped,
//! so it is never stale. Names start `strata_worker_`, apart from the coordinator's `strata_` ones (its per-stage
//! `strata_stage_*{stage}` gauges among them), so a query never sums both.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use strata_engine::stage_memory::ProcessMemory;
use strata_proto::ErrorCode;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::slot::StageSlot;

/// The `Content-Type` of the rendered metrics.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels naming an error by its kind (`kind="not_found"`), a fixed set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

/// Labels of the worker's info metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Info {
    node: String,
    version: &'static str,
}

/// Every metric a stage worker exports.
pub struct StageMetrics {
    registry: Registry,
    node: String,
    batches: Counter,
    compute: Histogram,
    received: Counter,
    sent: Counter,
    answered_directly: Counter,
    errors: Family<Kind, Counter>,
    queue_depth: Gauge,
    kv_blocks_total: Gauge,
    kv_blocks_used: Gauge,
    kv_blocks_cached: Gauge,
    kv_capacity_tokens: Gauge,
    weight_bytes: Gauge,
    resident_bytes: Gauge,
    layers: Gauge,
    offloaded_layers: Gauge,
    plan_epoch: Gauge,
    term: Gauge,
    info: Family<Info, Gauge>,
}

impl StageMetrics {
    /// The metrics of worker `node`, all at zero.
    pub fn new(node: &str) -> Self {
        let mut m = StageMetrics {
            registry: Registry::with_prefix("strata_worker"),
            node: node.to_owned(),
            batches: Counter::default(),
            // 0.1 ms .. 13 s
            compute: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            received: Counter::default(),
            sent: Counter::default(),
            answered_directly: Counter::default(),
            errors: Family::default(),
            queue_depth: Gauge::default(),
            kv_blocks_total: Gauge::default(),
            kv_blocks_used: Gauge::default(),
            kv_blocks_cached: Gauge::default(),
            kv_capacity_tokens: Gauge::default(),
            weight_bytes: Gauge::default(),
            resident_bytes: Gauge::default(),
            layers: Gauge::default(),
            offloaded_layers: Gauge::default(),
            plan_epoch: Gauge::default(),
            term: Gauge::default(),
            info: Family::default(),
        };
        let r = &mut m.registry;
        r.register("batches", "Micro-batches computed", m.batches.clone());
        r.register("batch_compute_seconds", "Compute time of one micro-batch on this stage", m.compute.clone());
        r.register("received_bytes", "Bytes of micro-batches received from upstream", m.received.clone());
        r.register("sent_bytes", "Bytes sent on: hidden states downstream, sampled tokens back", m.sent.clone());
        r.register(
            "answered_directly",
            "Micro-batches whose sampled tokens went straight to the coordinator's Answers stream (last stage)",
            m.answered_directly.clone(),
        );
        r.register("errors", "Micro-batches answered with an error, by kind", m.errors.clone());
        r.register("queue_depth", "Micro-batches received and not yet answered", m.queue_depth.clone());
        r.register("kv_blocks_total", "KV cache capacity in blocks", m.kv_blocks_total.clone());
        r.register("kv_blocks_used", "KV cache blocks held by sequences", m.kv_blocks_used.clone());
        r.register("kv_blocks_cached", "KV cache blocks kept in the prefix cache", m.kv_blocks_cached.clone());
        r.register("kv_capacity_tokens", "KV cache capacity in tokens", m.kv_capacity_tokens.clone());
        r.register("weight_bytes", "Bytes of weights loaded on the device", m.weight_bytes.clone());
        r.register(
            "resident_bytes",
            "Resident memory of the worker process (mapped weight pages included)",
            m.resident_bytes.clone(),
        );
        r.register("layers", "Layers of the served stage", m.layers.clone());
        r.register("offloaded_layers", "Of those, layers kept offloaded", m.offloaded_layers.clone());
        r.register("plan_epoch", "Plan epoch of the served stage (0: none)", m.plan_epoch.clone());
        r.register("term", "Highest coordinator term seen", m.term.clone());
        r.register("info", "The worker: node id and strata version", m.info.clone());
        m.info.get_or_create(&Info { node: m.node.clone(), version: env!("CARGO_PKG_VERSION") }).set(1);
        m
    }

    /// A micro-batch was computed in `took`.
    pub fn computed(&self, took: Duration) {
        self.batches.inc();
        self.compute.observe(took.as_secs_f64());
    }

    /// `bytes` of a micro-batch arrived.
    pub fn received(&self, bytes: usize) {
        self.received.inc_by(bytes as u64);
    }

    /// `bytes` left the stage.
    pub fn sent(&self, bytes: usize) {
        self.sent.inc_by(bytes as u64);
    }

    /// A micro-batch's tokens went to the coordinator's `Answers` stream.
    pub fn answered_directly(&self) {
        self.answered_directly.inc();
    }

    /// A micro-batch was answered with an error of `code`.
    pub fn error(&self, code: ErrorCode) {
        self.errors.get_or_create(&Kind { kind: code.as_str() }).inc();
    }

    /// Every metric, with the held state read from `slot` now and `inflight` batches queued.
    pub fn render(&self, slot: &StageSlot, inflight: u32) -> String {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.queue_depth.set(i64::from(inflight));
        self.term.set(gauge(slot.term().current()));
        self.resident_bytes.set(ProcessMemory::of_self().map_or(0, |m| gauge(m.resident)));
        match slot.current() {
            Some(stage) => {
                let facts = stage.executor.facts();
                let total = facts.kv_total_blocks;
                self.kv_blocks_total.set(gauge(total));
                self.kv_blocks_used.set(gauge(total.saturating_sub(stage.executor.kv_free_blocks())));
                self.kv_blocks_cached.set(gauge(stage.executor.kv_cached_blocks()));
                self.kv_capacity_tokens.set(gauge(facts.kv_capacity_tokens()));
                self.weight_bytes.set(gauge(facts.weight_bytes));
                self.layers.set(gauge(facts.layers.len() as u64));
                self.offloaded_layers.set(gauge(facts.offloaded_layers.len() as u64));
                self.plan_epoch.set(gauge(stage.plan_epoch.unwrap_or(0)));
            }
            None => {
                for g in [
                    &self.kv_blocks_total,
                    &self.kv_blocks_used,
                    &self.kv_blocks_cached,
                    &self.kv_capacity_tokens,
                    &self.weight_bytes,
                    &self.layers,
                    &self.offloaded_layers,
                    &self.plan_epoch,
                ] {
                    g.set(0);
                }
            }
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// What the metrics endpoint reads.
#[derive(Clone)]
struct Scrape {
    metrics: Arc<StageMetrics>,
    slot: StageSlot,
    inflight: Arc<AtomicU32>,
}

async fn render(State(s): State<Scrape>) -> impl IntoResponse {
    ([(CONTENT_TYPE, OPENMETRICS)], s.metrics.render(&s.slot, s.inflight.load(Ordering::Relaxed)))
}

/// Serves `GET /metrics` on `listener` until `shutdown` is cancelled.
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<StageMetrics>,
    slot: StageSlot,
    inflight: Arc<AtomicU32>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new().route("/metrics", get(render)).with_state(Scrape { metrics, slot, inflight });
    axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::term::TermFence;

    #[test]
    fn an_idle_worker_renders_its_counters_and_an_empty_stage() {
        let m = StageMetrics::new("w0");
        m.computed(Duration::from_millis(3));
        m.received(100);
        m.sent(40);
        m.error(ErrorCode::NotFound);
        let io = crate::io_runtime::IoRuntime::start().expect("network runtime");
        let text = m.render(&StageSlot::empty(TermFence::default(), io), 2);
        for line in [
            "strata_worker_batches_total 1",
            "strata_worker_batch_compute_seconds_count 1",
            "strata_worker_received_bytes_total 100",
            "strata_worker_sent_bytes_total 40",
            "strata_worker_errors_total{kind=\"not_found\"} 1",
            "strata_worker_queue_depth 2",
            "strata_worker_kv_blocks_total 0",
            "strata_worker_info{node=\"w0\",version=\"",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
