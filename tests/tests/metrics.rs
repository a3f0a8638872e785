//! `GET /metrics` of a coordinator in front of real in-process stage workers: the counters and histograms agree
//! with what the requests did (tokens, finishes, rejections, cancellations, HTTP statuses) and the gauges return
//! to idle.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::json;
use strata_coordinator::SchedulerLimits;
use strata_tests::http_client;
use strata_tests::{StageSizing, TestCluster, eventually, tiny_model_with_context};

const PROMPT: [u32; 5] = [17, 42, 3, 250, 99];

fn sample(metrics: &HashMap<String, f64>, key: &str) -> f64 {
    metrics.get(key).copied().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_the_requests_did() -> Result<()> {
    let model = tiny_model_with_context(4096)?;
    let limits = SchedulerLimits { max_concurrent_requests: 1, ..SchedulerLimits::default() };
    let sizing = StageSizing { kv_blocks: 1100, limits, ..StageSizing::default() };
    let cluster = TestCluster::start(model.path(), &[0, 2, 4], sizing).await?;
    let http = cluster.http_addr;

    let mut generated = 0.0;
    for max_tokens in [3, 4, 5] {
        let reply =
            http_client::post(http, "/v1/completions", &json!({"prompt": PROMPT, "max_tokens": max_tokens})).await?;
        ensure!(reply.status == 200, "status {}", reply.status);
        generated += reply.json()?["usage"]["completion_tokens"].as_f64().context("usage")?;
    }
    // One request held open, one refused for it, then the held one abandoned.
    // Log-probabilities make every token an event (the tiny model has no tokenizer, so no text).
    let long = json!({"prompt": PROMPT, "max_tokens": 4000, "stream": true, "logprobs": 0});
    let mut busy = http_client::post_stream(http, "/v1/completions", &long).await?;
    busy.next_data().await?.context("the long request streams")?;
    let refused = http_client::post(http, "/v1/completions", &json!({"prompt": PROMPT, "max_tokens": 2})).await?;
    ensure!(refused.status == 429, "status {}: {}", refused.status, String::from_utf8_lossy(&refused.body));
    drop(busy);
    ensure!(http_client::get(http, "/v1/nothing").await?.status == 404);

    let idle = || async {
        let m = http_client::scrape(http).await?;
        Ok(sample(&m, "strata_requests_running") == 0.0
            && sample(&m, "strata_kv_blocks_free") == sample(&m, "strata_kv_blocks_capacity")
            && sample(&m, "strata_requests_finished_total{reason=\"cancelled\"}") == 1.0)
    };
    eventually(Duration::from_secs(20), idle).await?;
    let m = http_client::scrape(http).await?;
    let finished = |reason: &str| sample(&m, &format!("strata_requests_finished_total{{reason=\"{reason}\"}}"));
    assert_eq!(sample(&m, "strata_requests_admitted_total"), 4.0, "{m:?}");
    assert_eq!(finished("length") + finished("eos"), 3.0, "{m:?}");
    assert_eq!(finished("error"), 0.0, "{m:?}");
    // Two stages: every answer came straight from the last stage, none relayed back through stage 0.
    assert!(sample(&m, "strata_stage_answers_total{route=\"direct\"}") >= 12.0, "{m:?}");
    assert_eq!(sample(&m, "strata_stage_answers_total{route=\"relayed\"}"), 0.0, "{m:?}");
    assert_eq!(sample(&m, "strata_requests_rejected_total{reason=\"overloaded\"}"), 1.0, "{m:?}");
    assert_eq!(sample(&m, "strata_prompt_tokens_total"), 4.0 * PROMPT.len() as f64, "{m:?}");
    // The three finished requests plus whatever the abandoned one streamed before it was cancelled.
    let streamed = sample(&m, "strata_generation_tokens_total") - generated;
    assert!(streamed >= 1.0, "{m:?}");
    assert_eq!(sample(&m, "strata_time_to_first_token_seconds_count"), 4.0, "{m:?}");
    assert_eq!(
        sample(&m, "strata_inter_token_latency_seconds_count"),
        sample(&m, "strata_generation_tokens_total") - 4.0,
        "{m:?}"
    );
    assert_eq!(sample(&m, "strata_request_duration_seconds_count"), 3.0, "{m:?}");
    assert!(sample(&m, "strata_batch_duration_seconds_count") >= sample(&m, "strata_generation_tokens_total"));
    // Every batch's overhead is observed once, and is its round trip less the stages' compute of it.
    assert_eq!(
        sample(&m, "strata_pipeline_overhead_seconds_count"),
        sample(&m, "strata_batch_duration_seconds_count"),
        "{m:?}"
    );
    let overhead = sample(&m, "strata_pipeline_overhead_seconds_sum");
    assert!(overhead > 0.0 && overhead < sample(&m, "strata_batch_duration_seconds_sum"), "{m:?}");
    assert_eq!(sample(&m, "strata_plan_stages"), 2.0, "{m:?}");
    assert!(sample(&m, "strata_kv_blocks_capacity") > 0.0, "{m:?}");
    let responses = |route: &str, status: u16| {
        sample(&m, &format!("strata_http_responses_total{{route=\"{route}\",status=\"{status}\"}}"))
    };
    assert_eq!(responses("/v1/completions", 200), 4.0, "{m:?}");
    assert_eq!(responses("/v1/completions", 429), 1.0, "{m:?}");
    assert_eq!(responses("other", 404), 1.0, "{m:?}");
    cluster.stop().await
}
