//! The chaos load: N concurrent streamed requests, half through gRPC `Generate` and half through HTTP
//! `/v1/completions` (SSE), half greedy and half seeded sampling, each with its own prompt. Every stream records its
//! tokens (ids over gRPC, text over HTTP), when each arrived, and its errors. The orchestrator learns through a
//! watch channel when every stream has produced its first tokens, which is when a fault is injected.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use strata_proto::pb;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Endpoint;

use crate::client::retryable;
use crate::connect;
use crate::drain::code_name;
use crate::http;
use crate::retry::{Decision, Resume, Retrier, RetryBudget, TextResume};

/// Temperature of the seeded streams.
const TEMPERATURE: f32 = 0.8;
/// Tokens every stream must have before the fault is injected.
pub const TRIGGER_TOKENS: usize = 2;

/// Distinct prompts; more streams than prompts get a numbered variant.
const PROMPTS: [&str; 16] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To bake a loaf of bread, first",
    "The largest planet in the solar system is",
    "In 1969, the first humans to walk on the Moon",
    "A good way to learn a new language is",
    "The recipe for a simple tomato sauce:",
    "Photosynthesis is the process by which",
    "The tallest mountain on Earth is",
    "My favourite thing about autumn is",
    "Rust is a programming language that",
    "The rules of chess say that a knight",
    "Water boils at a temperature of",
    "The best advice I ever received was",
    "A haiku about the ocean:",
];

/// Which API a stream goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// gRPC `Generate` (server-streamed); compared by token ids.
    Grpc,
    /// `POST /v1/completions` with `"stream": true`; compared by text.
    Http,
}

/// One stream of the load.
#[derive(Debug, Clone, Serialize)]
pub struct StreamSpec {
    /// Position in the load.
    pub index: usize,
    /// The API it uses.
    pub api: Api,
    /// The prompt text.
    pub prompt: String,
    /// `None`: greedy; `Some(seed)`: sampled at temperature 0.8 with this seed.
    pub seed: Option<u64>,
}

/// The load's streams: APIs alternate, sampling alternates every two, so each of the four combinations gets a
/// quarter.
pub fn specs(n: usize) -> Vec<StreamSpec> {
    (0..n)
        .map(|i| {
            let base = PROMPTS[i % PROMPTS.len()];
            let prompt = if i < PROMPTS.len() { base.to_owned() } else { format!("{base} (variant {})", i / 16) };
            StreamSpec {
                index: i,
                api: if i % 2 == 0 { Api::Grpc } else { Api::Http },
                prompt,
                seed: ((i / 2) % 2 == 1).then_some(1000 + i as u64),
            }
        })
        .collect()
}

/// What one stream received.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StreamRecord {
    /// Position in the load.
    pub index: usize,
    /// `grpc` or `http`.
    pub api: Option<Api>,
    /// The sampling seed (`None`: greedy).
    pub seed: Option<u64>,
    /// Token ids (gRPC only).
    pub token_ids: Vec<u32>,
    /// The generated text.
    pub text: String,
    /// Seconds from the load's start at which each token arrived (HTTP: each chunk with text).
    pub arrivals_s: Vec<f64>,
    /// The finish reason, once finished.
    pub finish: Option<String>,
    /// The error that ended the stream, if it did not finish.
    pub error: Option<String>,
    /// Every failed attempt's error, retried ones included.
    pub attempt_errors: Vec<String>,
    /// Retries made.
    pub retries: u32,
    /// Seconds from the load's start at which the stream ended.
    pub ended_s: f64,
}

impl StreamRecord {
    /// Whether it ended normally.
    pub fn completed(&self) -> bool {
        self.error.is_none() && self.finish.is_some()
    }
}

/// Where the load goes: gRPC URLs and HTTP addresses of the coordinators, the serving one first; retries move
/// to the next.
#[derive(Clone)]
pub struct Targets {
    /// gRPC URL and endpoint per coordinator.
    pub grpc: Vec<(String, Endpoint)>,
    /// HTTP API address per coordinator.
    pub http: Vec<SocketAddr>,
}

/// How the load runs.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Tokens per request (EOS is ignored, so every stream makes exactly this many).
    pub max_tokens: u32,
    /// A stream still running this long after the load started is cut and counted as failed.
    pub deadline: Duration,
    /// Retry UNAVAILABLE and transport errors (re-sending deterministic requests); `None`: every error is final.
    pub retry: Option<RetryBudget>,
}

/// A running load.
pub struct Load {
    /// When it started; every timestamp is relative to this.
    pub start: Instant,
    triggered: watch::Receiver<usize>,
    streams: usize,
    handles: Vec<JoinHandle<StreamRecord>>,
}

impl Load {
    /// Starts every stream at once.
    pub fn start(targets: &Targets, specs: &[StreamSpec], opts: LoadOptions) -> Self {
        let start = Instant::now();
        let (tx, triggered) = watch::channel(0usize);
        let handles = specs
            .iter()
            .map(|spec| {
                let (targets, spec, tx) = (targets.clone(), spec.clone(), tx.clone());
                tokio::spawn(async move { run_stream(targets, spec, opts, start, tx).await })
            })
            .collect();
        Self { start, triggered, streams: specs.len(), handles }
    }

    /// Waits until every stream has its first [`TRIGGER_TOKENS`] tokens (or has ended), at most `limit`.
    pub async fn producing(&mut self, limit: Duration) -> bool {
        let n = self.streams;
        tokio::time::timeout(limit, self.triggered.wait_for(|c| *c >= n)).await.is_ok_and(|r| r.is_ok())
    }

    /// Waits for every stream to end.
    pub async fn finish(self) -> Vec<StreamRecord> {
        let mut out = Vec::with_capacity(self.handles.len());
        for (i, h) in self.handles.into_iter().enumerate() {
            out.push(h.await.unwrap_or_else(|e| StreamRecord {
                index: i,
                error: Some(format!("stream task failed: {e}")),
                ..StreamRecord::default()
            }));
        }
        out
    }
}

/// One stream's state across attempts.
struct Progress {
    rec: StreamRecord,
    ids: Resume<u32>,
    text: TextResume,
    start: Instant,
    signalled: bool,
    tx: watch::Sender<usize>,
}

impl Progress {
    fn arrived(&mut self, n: usize) {
        let t = self.start.elapsed().as_secs_f64();
        self.rec.arrivals_s.extend(std::iter::repeat_n(t, n));
        if !self.signalled && self.rec.arrivals_s.len() >= TRIGGER_TOKENS {
            self.signal();
        }
    }

    fn signal(&mut self) {
        if !self.signalled {
            self.signalled = true;
            self.tx.send_modify(|c| *c += 1);
        }
    }
}

/// An attempt's failure: whether a retry could fix it, and what it was.
struct Failure {
    retryable: bool,
    message: String,
}

async fn run_stream(
    targets: Targets,
    spec: StreamSpec,
    opts: LoadOptions,
    start: Instant,
    tx: watch::Sender<usize>,
) -> StreamRecord {
    let rec = StreamRecord { index: spec.index, api: Some(spec.api), seed: spec.seed, ..StreamRecord::default() };
    let mut p = Progress { rec, ids: Resume::new("token"), text: TextResume::default(), start, signalled: false, tx };
    let mut retrier = opts.retry.map(Retrier::new);
    let mut last_progress = Instant::now();
    let deadline = tokio::time::Instant::from_std(start + opts.deadline);
    let mut target = 0;
    loop {
        p.ids.restart();
        p.text.restart();
        let before = p.rec.arrivals_s.len();
        let attempt = async {
            match spec.api {
                Api::Grpc => grpc_attempt(&targets, target, &spec, opts, &mut p).await,
                Api::Http => http_attempt(&targets, target, &spec, opts, &mut p).await,
            }
        };
        let result = match tokio::time::timeout_at(deadline, attempt).await {
            Ok(r) => r,
            Err(_) => Err(Failure {
                retryable: false,
                message: format!("timed out: not finished {} s after the load started", opts.deadline.as_secs()),
            }),
        };
        if p.rec.arrivals_s.len() > before {
            last_progress = Instant::now();
            if let Some(r) = retrier.as_mut() {
                r.progressed();
            }
        }
        let failure = match result {
            Ok(finish) => {
                p.rec.finish = Some(finish);
                break;
            }
            Err(f) => f,
        };
        p.rec.attempt_errors.push(failure.message.clone());
        let decision = match retrier.as_mut() {
            None => Decision::GiveUp(String::new()),
            Some(r) if tokio::time::Instant::now() < deadline => r.decide(
                failure.retryable,
                p.rec.arrivals_s.len(),
                true, // every chaos request is greedy or seeded
                start.elapsed(),
                last_progress.elapsed(),
            ),
            Some(_) => Decision::GiveUp(String::new()),
        };
        match decision {
            Decision::Retry(delay) => {
                p.rec.retries += 1;
                target += 1;
                tokio::time::sleep(delay).await;
            }
            Decision::GiveUp(_) => {
                p.rec.error = Some(failure.message);
                break;
            }
        }
    }
    p.signal(); // an ended stream no longer holds the trigger back
    p.rec.token_ids = p.ids.delivered().to_vec();
    p.rec.text = p.text.delivered();
    p.rec.ended_s = start.elapsed().as_secs_f64();
    p.rec
}

fn status_failure(s: &tonic::Status) -> Failure {
    let e = anyhow::Error::from(s.clone());
    Failure { retryable: retryable(&e), message: format!("gRPC {}: {}", code_name(s.code()), s.message()) }
}

async fn grpc_attempt(
    targets: &Targets,
    target: usize,
    spec: &StreamSpec,
    opts: LoadOptions,
    p: &mut Progress,
) -> Result<String, Failure> {
    let (url, endpoint) = &targets.grpc[target % targets.grpc.len()];
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(spec.prompt.clone())),
        max_tokens: opts.max_tokens,
        sampling: Some(pb::SamplingParams {
            temperature: if spec.seed.is_some() { TEMPERATURE } else { 0.0 },
            top_p: 1.0,
            seed: spec.seed,
            repetition_penalty: 1.0,
            ..Default::default()
        }),
        ignore_eos: true,
        request_id: format!("chaos-{}", spec.index),
        ..Default::default()
    };
    let mut client = connect::connect(endpoint)
        .await
        .map_err(|e| Failure { retryable: true, message: format!("connecting to {url}: {e:#}") })?;
    let mut stream = client.generate(req).await.map_err(|s| status_failure(&s))?.into_inner();
    let mut finish = None;
    loop {
        match stream.message().await {
            Ok(Some(msg)) => {
                let new =
                    p.ids.feed(&msg.token_ids).map_err(|m| Failure { retryable: false, message: m.to_string() })?;
                let n = new.len();
                p.text.feed(&msg.text).map_err(|m| Failure { retryable: false, message: m.to_string() })?;
                p.arrived(n);
                if msg.finish_reason != 0 {
                    finish =
                        pb::FinishReason::try_from(msg.finish_reason).ok().map(|f| format!("{f:?}").to_lowercase());
                }
            }
            Ok(None) => {
                return finish.ok_or_else(|| Failure {
                    retryable: true,
                    message: "the stream ended without a finish reason".into(),
                });
            }
            Err(s) => return Err(status_failure(&s)),
        }
    }
}

async fn http_attempt(
    targets: &Targets,
    target: usize,
    spec: &StreamSpec,
    opts: LoadOptions,
    p: &mut Progress,
) -> Result<String, Failure> {
    let addr = targets.http[target % targets.http.len()];
    let mut body = serde_json::json!({
        "prompt": spec.prompt, "max_tokens": opts.max_tokens, "stream": true, "ignore_eos": true,
        "temperature": if spec.seed.is_some() { TEMPERATURE } else { 0.0 },
    });
    if let Some(seed) = spec.seed {
        body["seed"] = seed.into();
    }
    let transport = |e: anyhow::Error| Failure { retryable: true, message: format!("HTTP {addr}: {e:#}") };
    let mut events = http::post_events(addr, "/v1/completions", &body).await.map_err(transport)?;
    if events.status != 200 {
        let status = events.status;
        let text = events.rest().await;
        return Err(Failure { retryable: status == 503, message: format!("HTTP {status}: {}", text.trim()) });
    }
    let mut finish = None;
    while let Some(data) = events.next_data().await.map_err(transport)? {
        if data == "[DONE]" {
            return finish.ok_or_else(|| Failure { retryable: true, message: "[DONE] without a finish reason".into() });
        }
        let chunk: serde_json::Value = serde_json::from_str(&data)
            .map_err(|e| Failure { retryable: false, message: format!("bad SSE chunk {data:?}: {e}") })?;
        if let Some(err) = chunk.get("error") {
            let retryable = err["code"] == "service_unavailable";
            return Err(Failure { retryable, message: format!("HTTP error event: {err}") });
        }
        let choice = &chunk["choices"][0];
        let delta = choice["text"].as_str().unwrap_or_default();
        if !delta.is_empty() {
            let new = p.text.feed(delta).map_err(|m| Failure { retryable: false, message: m.to_string() })?;
            if !new.is_empty() {
                p.arrived(1);
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    Err(Failure { retryable: true, message: "the event stream ended without [DONE]".into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_covers_every_api_and_sampling_combination_evenly() {
        let s = specs(16);
        let count = |api, seeded: bool| s.iter().filter(|x| x.api == api && x.seed.is_some() == seeded).count();
        for api in [Api::Grpc, Api::Http] {
            assert_eq!(count(api, false), 4);
            assert_eq!(count(api, true), 4);
        }
        let mut prompts: Vec<_> = specs(40).into_iter().map(|x| x.prompt).collect();
        prompts.sort();
        prompts.dedup();
        assert_eq!(prompts.len(), 40, "every prompt is distinct");
    }
}
