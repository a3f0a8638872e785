//! One trace per request across the pipeline: a coordinator and three stage workers (real processes) export their
//! spans over OTLP/gRPC (`OTEL_EXPORTER_OTLP_ENDPOINT`, the env fallback of `--otlp-endpoint`) to a receiver in
//! this test that speaks the OTLP trace service. For one request, the coordinator's `generate` span and every
//! stage's `stage_forward` spans (children of it, through the `traceparent` each chunk carries) and
//! `stage_compute` spans (children of those) share one trace id, and the request span carries the GenAI usage
//! attributes.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_tests::processes::ProcessCluster;
use strata_tests::{generate, ids_request, tiny_model};
use tonic::{Request, Response, Status};

/// What the receiver keeps of one span.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    attributes: HashMap<String, String>,
}

/// An OTLP trace receiver that records every span it is sent.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<Span>>>);

fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn attributes(kvs: &[KeyValue]) -> HashMap<String, String> {
    kvs.iter().map(|kv| (kv.key.clone(), text(kv.value.as_ref()))).collect()
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let resource = rs.resource.map(|r| attributes(&r.attributes)).unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                got.push(Span {
                    service: service.clone(),
                    name: span.name,
                    trace_id: span.trace_id,
                    span_id: span.span_id,
                    parent: span.parent_span_id,
                    attributes: attributes(&span.attributes),
                });
            }
        }
        self.0.lock().map_err(|_| Status::internal("poisoned"))?.extend(got);
        Ok(Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// The request span and the stage spans of its trace, once every stage's have arrived.
fn one_trace(spans: &[Span], stages: usize) -> Option<(Span, Vec<Span>)> {
    let request = spans.iter().find(|s| s.service == "strata-coordinator" && s.name == "generate")?;
    let in_trace: Vec<Span> = spans.iter().filter(|s| s.trace_id == request.trace_id).cloned().collect();
    let seen: BTreeSet<&str> = in_trace
        .iter()
        .filter(|s| s.name == "stage_compute")
        .filter_map(|c| in_trace.iter().find(|f| f.span_id == c.parent && f.name == "stage_forward"))
        .filter_map(|f| f.attributes.get("stage").map(String::as_str))
        .collect();
    (seen.len() == stages).then(|| (request.clone(), in_trace))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_through_three_stages_is_one_trace() -> Result<()> {
    let sink = Sink::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(sink.clone()))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)));
    let receiver = tokio::spawn(server);

    let model = tiny_model()?;
    let mut cluster = ProcessCluster::start(model.path(), 0, 0).await?;
    cluster.env.push(("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint.clone()));
    // Export every 100 ms rather than OpenTelemetry's default 5 s.
    cluster.env.push(("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()));
    for id in ["w0", "w1", "w2"] {
        cluster.add_worker(id)?;
    }
    // On although this f32 model's results depend on batching (caching is then off by default): only the spans'
    // count of cached tokens is checked, not the tokens.
    cluster.add_coordinator(&["--min-stages=3", "--enable-prefix-caching"])?;
    let status = cluster.wait_for_stages(3).await.with_context(|| cluster.logs())?;
    ensure!(status.stages.len() == 3, "{:?}", status.stages);

    let mut client = CoordinatorClient::connect(cluster.coordinators[0].url.clone()).await?;
    let out = generate(&mut client, ids_request(&[5, 17, 2, 99, 42], 4)).await?;
    ensure!(out.token_ids.len() == 4, "{out:?}");

    let deadline = Instant::now() + Duration::from_secs(30);
    let (request, trace) = loop {
        let spans = sink.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
        if let Some(found) = one_trace(&spans, 3) {
            break found;
        }
        if Instant::now() >= deadline {
            let names: BTreeSet<(String, String)> = spans.iter().map(|s| (s.service.clone(), s.name.clone())).collect();
            bail!("no trace with all 3 stages within 30 s; spans received: {names:?}\n{}", cluster.logs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // Parent links: every stage_forward span hangs off the request span, every stage_compute off a stage_forward.
    let forwards: Vec<&Span> = trace.iter().filter(|s| s.name == "stage_forward").collect();
    for f in &forwards {
        ensure!(f.parent == request.span_id, "{f:?} is not a child of the request span {request:?}");
        ensure!(f.service == "strata-stage-worker", "{f:?}");
    }
    for c in trace.iter().filter(|s| s.name == "stage_compute") {
        ensure!(forwards.iter().any(|f| f.span_id == c.parent), "{c:?} has no stage_forward parent");
    }
    let nodes: BTreeSet<&str> = forwards.iter().filter_map(|f| f.attributes.get("node").map(String::as_str)).collect();
    ensure!(nodes == BTreeSet::from(["w0", "w1", "w2"]), "stage spans from {nodes:?}");
    // Prefill and 3 decode steps: 4 batches through each of the 3 stages.
    ensure!(forwards.len() >= 12, "{} stage_forward spans", forwards.len());
    let attr = |k: &str| request.attributes.get(k).map(String::as_str);
    ensure!(attr("gen_ai.usage.input_tokens") == Some("5"), "{:?}", request.attributes);
    ensure!(attr("gen_ai.usage.output_tokens") == Some("4"), "{:?}", request.attributes);
    ensure!(attr("gen_ai.server.time_to_first_token").is_some(), "{:?}", request.attributes);
    ensure!(attr("gen_ai.usage.cache_read.input_tokens") == Some("0"), "{:?}", request.attributes);

    // The same longer prompt twice: the second request's span says how many of its prompt tokens the prefix cache
    // served, as its usage does.
    let prompt: Vec<u32> = (1..=40).collect();
    generate(&mut client, ids_request(&prompt, 2)).await?;
    let second = generate(&mut client, ids_request(&prompt, 2)).await?;
    let cached = second.usage.map(|u| u.cached_prompt_tokens).unwrap_or_default();
    ensure!(cached > 0, "the second request found nothing cached: {second:?}");
    let want = cached.to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let spans = sink.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
        let found = spans.iter().any(|s| {
            s.name == "generate"
                && s.attributes.get("gen_ai.usage.input_tokens").map(String::as_str) == Some("40")
                && s.attributes.get("gen_ai.usage.cache_read.input_tokens") == Some(&want)
        });
        if found {
            break;
        }
        if Instant::now() >= deadline {
            let generate: Vec<_> = spans.iter().filter(|s| s.name == "generate").map(|s| &s.attributes).collect();
            bail!("no request span with {cached} cached prompt tokens within 30 s: {generate:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    receiver.abort();
    Ok(())
}
