//! `strata client generate`: one request through a coordinator, retried on UNAVAILABLE and transport errors with
//! capped exponential backoff, rotating over the `--coordinator` URLs (a standby takes over from a dead leader).
//! A stream that broke after tokens were printed is re-sent whole when the request is deterministic (greedy or
//! seeded) and the tokens already printed are checked and skipped; otherwise the failure is final.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use strata_proto::{TlsArgs, pb};
use tonic::transport::Endpoint;

use crate::connect::{self, ApiKeyArgs, Credentials};
use crate::generate::{Format, PromptArgs};
use crate::retry::{Decision, Mismatch, Resume, Retrier, RetryBudget, TextResume, deterministic};

/// Arguments of `strata client generate`.
#[derive(clap::Args)]
pub struct ClientGenerateArgs {
    /// Coordinator gRPC URLs (`https://` for TLS), comma-separated or repeated; each retry goes to the next one,
    /// so list the standby coordinators too.
    #[arg(long, default_value = "http://127.0.0.1:50051", env = "STRATA_COORDINATOR", value_delimiter = ',')]
    coordinator: Vec<String>,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    api_key: ApiKeyArgs,
    #[command(flatten)]
    prompt: PromptArgs,
    /// Seconds to keep retrying before the first token, whatever --retries says (the cluster may still be
    /// loading or switching plans).
    #[arg(long, default_value_t = 60)]
    wait: u64,
    /// Retries in a row without a new token before giving up (UNAVAILABLE and transport errors only).
    #[arg(long, default_value_t = 5, env = "STRATA_RETRIES")]
    retries: u32,
    /// Seconds without a new token after which retrying stops.
    #[arg(long, default_value_t = 30, env = "STRATA_RETRY_TIMEOUT")]
    retry_timeout: u64,
}

fn sampling(p: &PromptArgs) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
        seed: p.seed,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        min_p: p.min_p,
    }
}

/// Whether a failed attempt is worth retrying: UNAVAILABLE, or the connection itself failed or broke (which
/// tonic reports as a transport error, or as UNKNOWN/INTERNAL "h2 protocol error" when a stream is cut).
pub fn retryable(e: &anyhow::Error) -> bool {
    if e.downcast_ref::<tonic::transport::Error>().is_some() {
        return true;
    }
    let Some(s) = e.downcast_ref::<tonic::Status>() else { return false };
    match s.code() {
        tonic::Code::Unavailable => true,
        tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled => {
            let mut source = std::error::Error::source(s);
            while let Some(err) = source {
                if err.is::<std::io::Error>() || err.is::<tonic::transport::Error>() || err.is::<hyper::Error>() {
                    return true;
                }
                source = err.source();
            }
            s.message().starts_with("h2 protocol error") || s.message().starts_with("transport error")
        }
        _ => false,
    }
}

/// What one attempt ended with.
enum Attempt {
    /// The stream ended normally with this finish reason.
    Finished(Option<i32>),
    /// The attempt failed.
    Failed(anyhow::Error),
}

/// What the caller has received so far, across attempts.
struct Output {
    format: Format,
    prompt_ids: Vec<u32>,
    ids: Resume<u32>,
    text: TextResume,
}

impl Output {
    /// Takes one message of the current attempt; prints the new text. `Ok(true)` when it brought new tokens.
    fn take(&mut self, msg: &pb::GenerateResponse) -> Result<bool, Mismatch> {
        if !msg.prompt_ids.is_empty() {
            self.prompt_ids = msg.prompt_ids.clone();
        }
        let new_ids = !self.ids.feed(&msg.token_ids)?.is_empty();
        let new_text = self.text.feed(&msg.text)?;
        if self.format == Format::Text && !new_text.is_empty() {
            let mut stdout = std::io::stdout().lock();
            let _ = stdout.write_all(new_text.as_bytes()).and_then(|_| stdout.flush());
        }
        Ok(new_ids)
    }
}

async fn attempt(
    (endpoint, credentials): (&Endpoint, &Credentials),
    req: &pb::GenerateRequest,
    out: &mut Output,
    retrier: &mut Retrier,
    last_progress: &mut Instant,
) -> Result<Attempt, Mismatch> {
    out.ids.restart();
    out.text.restart();
    let mut stream = match connect::connect_as(endpoint, credentials).await {
        Ok(mut client) => match client.generate(req.clone()).await {
            Ok(r) => r.into_inner(),
            Err(s) => return Ok(Attempt::Failed(s.into())),
        },
        Err(e) => return Ok(Attempt::Failed(e)),
    };
    let mut finish = None;
    loop {
        match stream.message().await {
            Ok(Some(msg)) => {
                if out.take(&msg)? {
                    retrier.progressed();
                    *last_progress = Instant::now();
                }
                if msg.finish_reason != 0 {
                    finish = Some(msg.finish_reason);
                }
            }
            Ok(None) => return Ok(Attempt::Finished(finish)),
            Err(s) => return Ok(Attempt::Failed(s.into())),
        }
    }
}

/// Runs `strata client generate`: same flags and output as `strata generate`, through a coordinator.
pub fn client_generate(a: ClientGenerateArgs) -> Result<()> {
    let prompt = match (&a.prompt.prompt, &a.prompt.prompt_ids) {
        (_, Some(ids)) => pb::generate_request::Prompt::Ids(pb::TokenIds { ids: ids.clone() }),
        (Some(text), None) => pb::generate_request::Prompt::Text(text.clone()),
        (None, None) => bail!("pass --prompt or --prompt-ids"),
    };
    let req = pb::GenerateRequest {
        prompt: Some(prompt),
        chat: a.prompt.chat,
        max_tokens: u32::try_from(a.prompt.max_tokens).unwrap_or(u32::MAX),
        sampling: Some(sampling(&a.prompt)),
        stop: a.prompt.stop.clone(),
        ..Default::default()
    };
    let urls: Vec<&str> = a.coordinator.iter().map(|u| u.trim()).filter(|u| !u.is_empty()).collect();
    if urls.is_empty() {
        bail!("--coordinator needs at least one URL");
    }
    let endpoints = urls.iter().map(|u| connect::endpoint(u, &a.tls)).collect::<Result<Vec<_>>>()?;
    let credentials = a.api_key.credentials()?;
    let budget = RetryBudget {
        retries: a.retries,
        retry_timeout: Duration::from_secs(a.retry_timeout),
        wait: Duration::from_secs(a.wait),
    };
    let resumable = deterministic(a.prompt.temperature, a.prompt.seed);
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let mut out = Output {
            format: a.prompt.format,
            prompt_ids: Vec::new(),
            ids: Resume::new("token"),
            text: TextResume::default(),
        };
        let mut retrier = Retrier::new(budget);
        let start = Instant::now();
        let mut last_progress = start;
        let mut next = 0;
        let finish = loop {
            let i = next % endpoints.len();
            let target = (&endpoints[i], &credentials);
            let error = match attempt(target, &req, &mut out, &mut retrier, &mut last_progress).await {
                Ok(Attempt::Finished(f)) => break f,
                Ok(Attempt::Failed(e)) => e,
                Err(mismatch) => bail!("generate via {}: {mismatch}", urls[i]),
            };
            let delivered = out.ids.delivered().len();
            match retrier.decide(retryable(&error), delivered, resumable, start.elapsed(), last_progress.elapsed()) {
                Decision::Retry(delay) => {
                    next += 1;
                    let to = urls[next % urls.len()];
                    tracing::warn!(
                        "{}: {error:#}; retrying on {to} in {} ms ({delivered} token(s) to skip)",
                        urls[i],
                        delay.as_millis()
                    );
                    tokio::time::sleep(delay).await;
                }
                Decision::GiveUp(reason) => {
                    return Err(error).with_context(|| format!("generate via {} ({reason})", urls[i]));
                }
            }
        };
        let finish_reason = match finish.and_then(|f| pb::FinishReason::try_from(f).ok()) {
            Some(pb::FinishReason::Length) => "length",
            Some(pb::FinishReason::Eos) => "eos",
            Some(pb::FinishReason::Stop) => "stop",
            Some(pb::FinishReason::Cancelled) => "cancelled",
            _ => "error",
        };
        let mut stdout = std::io::stdout().lock();
        if a.prompt.format == Format::Text {
            writeln!(stdout)?;
        } else {
            let v = serde_json::json!({
                "prompt_ids": out.prompt_ids, "token_ids": out.ids.delivered(), "text": out.text.delivered(),
                "finish_reason": finish_reason,
            });
            writeln!(stdout, "{v}")?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_and_cut_streams_are_retried_other_errors_are_not() {
        let r = |s: tonic::Status| retryable(&anyhow::Error::from(s));
        assert!(r(tonic::Status::unavailable("no ready plan")));
        assert!(r(tonic::Status::unknown("h2 protocol error: error reading a body from connection")));
        assert!(!r(tonic::Status::invalid_argument("prompt too long")));
        assert!(!r(tonic::Status::resource_exhausted("queue full")));
        assert!(!r(tonic::Status::internal("stage 1 failed")));
        assert!(!retryable(&anyhow::anyhow!("something else")));
    }
}
