//! The coordinator's Prometheus metrics, served at `GET /metrics` (OpenMetrics text). One [`Metrics`] per pipeline,
//! no global registry: the scheduler actor updates it, the HTTP layer counts responses and renders it.
//!
//! Names follow Prometheus conventions (`_seconds`, `_total`), close to what vLLM and TGI export, so existing
//! dashboards map over: queue depth, running sequences, KV blocks, tokens, time to first token, inter-token latency.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The `Content-Type` of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels naming why something happened (`reason="length"`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// A short fixed word: never user input, so the label set stays small.
    pub reason: &'static str,
}

/// Labels naming the way a micro-batch's answer came back (`route="direct"`: from the last stage's `Answers`
/// stream; `"relayed"`: up the `Forward` streams).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Route {
    /// `direct` or `relayed`.
    pub route: &'static str,
}

/// Labels naming a stage by its position in the pipeline (`stage="0"`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Stage {
    /// Position in the pipeline, from 0.
    pub stage: u32,
}

/// Labels of the info metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Info {
    /// The served model's name.
    pub model: String,
    /// strata's version.
    pub version: &'static str,
}

/// Buckets of a stage's batch compute time: 0.1 ms .. 13 s.
fn stage_compute_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// Labels of an HTTP response.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    /// The matched route (`/v1/completions`), or `other` for unknown paths.
    pub route: String,
    /// The status code.
    pub status: u16,
}

/// What one stage reports of its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StageMemory {
    /// KV cache capacity in tokens.
    pub kv_tokens: u64,
    /// Layers kept offloaded.
    pub offloaded_layers: u64,
}

/// Every metric the coordinator exports, and the registry that renders them.
pub struct Metrics {
    registry: Registry,
    /// Requests accepted into the queue.
    pub requests_admitted: Counter,
    /// Requests refused before queueing (`overloaded`, `too_long`, `unavailable`).
    pub requests_rejected: Family<Reason, Counter>,
    /// Requests that ended (`length`, `eos`, `stop`, `error`, `cancelled`).
    pub requests_finished: Family<Reason, Counter>,
    /// Sequences holding KV on the stages.
    pub running: Gauge,
    /// Sequences queued (new or preempted).
    pub waiting: Gauge,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Tokens generated and streamed to callers.
    pub generation_tokens: Counter,
    /// Sequences sent back to the queue to be recomputed (`kv_full`, `stage_out_of_kv`, `plan_changed`,
    /// `stage_failed`).
    pub preemptions: Family<Reason, Counter>,
    /// Times the stages failed under the pipeline and every sequence was requeued (`unavailable`,
    /// `batch_overdue`, `stale_plan`, `scheduler_stopped`: `pipeline::actor::recovery`).
    pub stage_failures: Family<Reason, Counter>,
    /// Micro-batch answers received, by the way they came (`direct`, `relayed`).
    pub answers: Family<Route, Counter>,
    /// KV blocks of the tightest stage, as the scheduler budgets them.
    pub kv_blocks_capacity: Gauge,
    /// Of those, blocks no sequence holds.
    pub kv_blocks_free: Gauge,
    /// Share of the KV blocks sequences hold (0 to 1).
    pub kv_usage_ratio: Gauge<f64, AtomicU64>,
    /// Of the capacity, blocks in the prefix cache (those no sequence uses count as free).
    pub kv_blocks_cached: Gauge,
    /// Prompt tokens matched against the prefix cache.
    pub prefix_cache_queries: Counter,
    /// Of those, tokens found cached (not computed again).
    pub prefix_cache_hits: Counter,
    /// Each stage's KV cache capacity in tokens (from its memory budget), by pipeline position.
    pub stage_kv_tokens: Family<Stage, Gauge>,
    /// Each stage's offloaded layers (paged in or streamed per batch), by pipeline position.
    pub stage_offloaded_layers: Family<Stage, Gauge>,
    /// The plan epoch the pipeline serves.
    pub plan_epoch: Gauge,
    /// Stages in that plan.
    pub stages: Gauge,
    /// Admission to first generated token.
    pub time_to_first_token: Histogram,
    /// Admission until the request's first chunk is sent to the stages.
    pub queue_time: Histogram,
    /// Each stage's compute time per micro-batch, as the stages report it, by pipeline position.
    pub stage_compute: Family<Stage, Histogram, fn() -> Histogram>,
    /// The served model and the strata version (`model`, `version` labels, value 1).
    pub info: Family<Info, Gauge>,
    /// Between consecutive tokens of one sequence.
    pub inter_token_latency: Histogram,
    /// Admission to the end of a request that finished normally.
    pub request_duration: Histogram,
    /// One micro-batch, sent to stage 0 until its response came back.
    pub batch_duration: Histogram,
    /// The same minus the stages' compute of it: what the hops between the stages cost.
    pub pipeline_overhead: Histogram,
    /// Tokens in one micro-batch.
    pub batch_tokens: Histogram,
    /// HTTP API responses by route and status.
    pub http_responses: Family<HttpLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics, all zero, registered under the `strata` prefix.
    pub fn new() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("strata"),
            requests_admitted: Counter::default(),
            requests_rejected: Family::default(),
            requests_finished: Family::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            preemptions: Family::default(),
            stage_failures: Family::default(),
            answers: Family::default(),
            kv_blocks_capacity: Gauge::default(),
            kv_blocks_free: Gauge::default(),
            kv_usage_ratio: Gauge::default(),
            kv_blocks_cached: Gauge::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            stage_kv_tokens: Family::default(),
            stage_offloaded_layers: Family::default(),
            plan_epoch: Gauge::default(),
            stages: Gauge::default(),
            // 5 ms .. 41 s
            time_to_first_token: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            // 1 ms .. 65 s
            queue_time: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            stage_compute: Family::new_with_constructor(stage_compute_histogram),
            info: Family::default(),
            // 1 ms .. 2 s
            inter_token_latency: Histogram::new(exponential_buckets(0.001, 2.0, 12)),
            // 10 ms .. 5.5 min
            request_duration: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            // 0.5 ms .. 4 s
            batch_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            // 10 µs .. 0.4 s, bounds 25 % apart: a median interpolated inside its bucket is within a few µs of a
            // ~100 µs hop, close enough to compare hops
            pipeline_overhead: Histogram::new(exponential_buckets(0.00001, 1.25, 48)),
            // 1 .. 4096 tokens
            batch_tokens: Histogram::new(exponential_buckets(1.0, 2.0, 13)),
            http_responses: Family::default(),
        };
        let r = &mut m.registry;
        r.register("requests_admitted", "Requests accepted into the queue", m.requests_admitted.clone());
        r.register("requests_rejected", "Requests refused before queueing, by reason", m.requests_rejected.clone());
        r.register("requests_finished", "Requests that ended, by reason", m.requests_finished.clone());
        r.register("requests_running", "Sequences holding KV cache on the stages", m.running.clone());
        r.register("requests_waiting", "Sequences queued (new or preempted)", m.waiting.clone());
        r.register("prompt_tokens", "Prompt tokens of admitted requests", m.prompt_tokens.clone());
        r.register("generation_tokens", "Tokens generated and streamed to callers", m.generation_tokens.clone());
        r.register("preemptions", "Sequences queued again for recompute, by reason", m.preemptions.clone());
        r.register(
            "stage_failures",
            "Recoveries that requeued every sequence for recompute (stage failures, the scheduler's watchdog), by reason",
            m.stage_failures.clone(),
        );
        r.register(
            "stage_answers",
            "Micro-batch answers received: direct from the last stage, or relayed back through the stages",
            m.answers.clone(),
        );
        r.register("kv_blocks_capacity", "KV blocks of the tightest stage", m.kv_blocks_capacity.clone());
        r.register("kv_blocks_free", "KV blocks no sequence holds", m.kv_blocks_free.clone());
        r.register("kv_usage_ratio", "Share of the KV blocks sequences hold", m.kv_usage_ratio.clone());
        r.register(
            "kv_blocks_cached",
            "KV blocks in the prefix cache (those no sequence uses are counted free)",
            m.kv_blocks_cached.clone(),
        );
        r.register(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_cache_queries.clone(),
        );
        r.register("prefix_cache_hits", "Prompt tokens found in the prefix cache", m.prefix_cache_hits.clone());
        r.register(
            "stage_kv_capacity_tokens",
            "KV cache capacity of each stage of the served plan, in tokens",
            m.stage_kv_tokens.clone(),
        );
        r.register(
            "stage_offloaded_layers",
            "Layers each stage of the served plan keeps offloaded (paged in from the model file or streamed from host \
             memory for every batch)",
            m.stage_offloaded_layers.clone(),
        );
        r.register("plan_epoch", "Plan epoch being served", m.plan_epoch.clone());
        r.register("plan_stages", "Stages in the plan being served", m.stages.clone());
        r.register("time_to_first_token_seconds", "Admission to first generated token", m.time_to_first_token.clone());
        r.register("queue_time_seconds", "Admission until a request's first chunk is sent", m.queue_time.clone());
        r.register(
            "stage_compute_seconds",
            "Compute time of one micro-batch on each stage of the pipeline, as the stage reports it",
            m.stage_compute.clone(),
        );
        r.register("info", "The served model and the strata version", m.info.clone());
        m.info.get_or_create(&Info { model: String::new(), version: env!("CARGO_PKG_VERSION") }).set(1);
        r.register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence",
            m.inter_token_latency.clone(),
        );
        r.register("request_duration_seconds", "Admission to normal end of a request", m.request_duration.clone());
        r.register("batch_duration_seconds", "Micro-batch round trip through every stage", m.batch_duration.clone());
        r.register(
            "pipeline_overhead_seconds",
            "Micro-batch round trip minus the stages' compute of it: the hops (network, gRPC, queues, this coordinator)",
            m.pipeline_overhead.clone(),
        );
        r.register("batch_tokens", "Tokens per micro-batch", m.batch_tokens.clone());
        r.register("http_responses", "HTTP API responses by route and status", m.http_responses.clone());
        m
    }

    /// Counts one finished request.
    pub fn finished(&self, reason: &'static str) {
        self.requests_finished.get_or_create(&Reason { reason }).inc();
    }

    /// Counts one refused request.
    pub fn rejected(&self, reason: &'static str) {
        self.requests_rejected.get_or_create(&Reason { reason }).inc();
    }

    /// Counts one preemption.
    pub fn preempted(&self, reason: &'static str) {
        self.preemptions.get_or_create(&Reason { reason }).inc();
    }

    /// Preemptions of every reason since start.
    pub fn preemptions_total(&self) -> u64 {
        ["kv_full", "stage_out_of_kv", "plan_changed", "stage_failed"]
            .into_iter()
            .map(|reason| self.preemptions.get_or_create(&Reason { reason }).get())
            .sum()
    }

    /// Sets what each stage reported of its memory, in pipeline order.
    pub fn set_stage_memory(&self, stages: &[StageMemory]) {
        // A plan of fewer stages than the last leaves no stale series behind.
        self.stage_kv_tokens.clear();
        self.stage_offloaded_layers.clear();
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for (stage, s) in stages.iter().enumerate() {
            let stage = Stage { stage: u32::try_from(stage).unwrap_or(u32::MAX) };
            self.stage_kv_tokens.get_or_create(&stage).set(gauge(s.kv_tokens));
            self.stage_offloaded_layers.get_or_create(&stage).set(gauge(s.offloaded_layers));
        }
    }

    /// Names the served model in `strata_info`.
    pub fn set_model(&self, model: &str) {
        self.info.clear();
        self.info.get_or_create(&Info { model: model.to_owned(), version: env!("CARGO_PKG_VERSION") }).set(1);
    }

    /// Stage `stage` computed a micro-batch in `took`.
    pub fn stage_computed(&self, stage: u32, took: Duration) {
        self.stage_compute.get_or_create(&Stage { stage }).observe(took.as_secs_f64());
    }

    /// Observes a duration in seconds.
    pub fn observe(histogram: &Histogram, d: Duration) {
        histogram.observe(d.as_secs_f64());
    }

    /// Every metric in the OpenMetrics text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an encoder error would only drop the scrape.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_metrics_carry_names_labels_and_values() {
        let m = Metrics::new();
        m.requests_admitted.inc();
        m.finished("length");
        m.finished("length");
        m.preempted("kv_full");
        m.kv_blocks_capacity.set(64);
        m.kv_usage_ratio.set(0.25);
        m.set_model("smol");
        m.stage_computed(1, Duration::from_millis(2));
        Metrics::observe(&m.queue_time, Duration::from_millis(5));
        m.set_stage_memory(&[
            StageMemory { kv_tokens: 1024, offloaded_layers: 0 },
            StageMemory { kv_tokens: 512, offloaded_layers: 3 },
        ]);
        Metrics::observe(&m.time_to_first_token, Duration::from_millis(30));
        m.http_responses.get_or_create(&HttpLabels { route: "/v1/completions".into(), status: 200 }).inc();
        let text = m.render();
        assert!(text.contains("strata_requests_admitted_total 1"), "{text}");
        assert!(text.contains("strata_requests_finished_total{reason=\"length\"} 2"), "{text}");
        assert!(text.contains("strata_kv_blocks_capacity 64"), "{text}");
        assert!(text.contains("strata_kv_usage_ratio 0.25"), "{text}");
        assert!(text.contains(r#"strata_info{model="smol",version=""#), "{text}");
        assert!(text.contains(r#"strata_stage_compute_seconds_count{stage="1"} 1"#), "{text}");
        assert!(text.contains("strata_queue_time_seconds_count 1"), "{text}");
        assert!(text.contains(r#"strata_stage_kv_capacity_tokens{stage="1"} 512"#), "{text}");
        assert!(text.contains(r#"strata_stage_offloaded_layers{stage="1"} 3"#), "{text}");
        assert!(text.contains("strata_time_to_first_token_seconds_count 1"), "{text}");
        // 30 ms falls in the 40 ms bucket, not the 20 ms one.
        assert!(text.contains("strata_time_to_first_token_seconds_bucket{le=\"0.02\"} 0"), "{text}");
        assert!(text.contains("strata_time_to_first_token_seconds_bucket{le=\"0.04\"} 1"), "{text}");
        assert!(text.contains("route=\"/v1/completions\",status=\"200\"} 1"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
        assert_eq!(m.preemptions_total(), 1);
    }
}
