//! `/v1/completions` and `/v1/chat/completions`: validate through [`request::prepare`], submit to the pipeline,
//! then either collect the sequence's events into one response or stream them as server-sent events.
//!
//! The pipeline's receiver lives in the handler (whole responses) or in the SSE body stream: when the client
//! disconnects, hyper drops either, which cancels the sequence and frees its KV on every stage.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Serialize;
use strata_engine::tokenizer::Tokenizer;
use strata_proto::ServiceError;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::HttpState;
use super::errors::ApiError;
use super::openai::{
    AssistantMessage, ChatChoice, ChatLogprobs, CompletionChoice, CompletionLogprobs, Delta, Generation, TokenLogprob,
    Usage,
};
use crate::pipeline::{Finish, SeqEvent};
use crate::request::{self, GenerateParams};

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// How the client wants the response.
#[derive(Debug, Clone, Copy)]
pub struct Delivery {
    /// Server-sent events instead of one JSON body.
    pub stream: bool,
    /// End the stream with a usage chunk.
    pub include_usage: bool,
}

/// Runs one request to the end (or to the client's disconnect) and answers it in the endpoint's shape.
pub async fn respond(
    state: &HttpState,
    endpoint: Endpoint,
    request_id: &str,
    params: GenerateParams,
    delivery: Delivery,
) -> Result<Response, ApiError> {
    let model = state.pipeline.model();
    let seq = request::prepare(model, params)?;
    let shaper = Shaper {
        endpoint,
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{request_id}"),
            Endpoint::Chat => format!("chatcmpl-{request_id}"),
        },
        created: unix_now(),
        model: model.name.clone(),
        tokenizer: seq.logprobs.then(|| model.tokenizer.clone()).flatten(),
        logprobs: seq.logprobs,
        prompt_tokens: seq.prompt_ids.len(),
    };
    let events = state.pipeline.submit(seq).await?;
    if delivery.stream {
        let body = sse_stream(events, shaper, delivery.include_usage, tracing::Span::current());
        Ok(Sse::new(body).into_response())
    } else {
        let whole = collect(events, &shaper).await?;
        Ok(whole.into_response())
    }
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn finish_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Eos | Finish::Stop => "stop",
        Finish::Length => "length",
    }
}

/// A sampled token, for log-probabilities.
struct Sampled {
    text: String,
    logprob: f32,
}

/// Builds the endpoint's response bodies and chunks.
struct Shaper {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    tokenizer: Option<Arc<Tokenizer>>,
    logprobs: bool,
    prompt_tokens: usize,
}

/// One piece of a response: a chunk when streaming; whole responses are one piece with `whole` set.
#[derive(Default)]
struct Piece {
    role: bool,
    text: Option<String>,
    tokens: Vec<Sampled>,
    /// Byte offset of the first token's text in the generated text.
    offset: usize,
    finish: Option<Finish>,
    usage: Option<Usage>,
    /// A usage-only chunk (`choices: []`).
    usage_only: bool,
    whole: bool,
}

impl Shaper {
    fn sampled(&self, id: u32, logprob: Option<f32>) -> Option<Sampled> {
        if !self.logprobs {
            return None;
        }
        let text = self.tokenizer.as_ref().and_then(|t| t.decode(&[id]).ok()).unwrap_or_default();
        Some(Sampled { text, logprob: logprob.unwrap_or(f32::NAN) })
    }

    fn usage(&self, completion_tokens: usize) -> Usage {
        Usage::new(self.prompt_tokens, completion_tokens)
    }

    /// The JSON of `piece` in this endpoint's shape.
    fn render(&self, piece: Piece) -> serde_json::Value {
        let finish_reason = piece.finish.map(finish_reason);
        // Chunks without tokens (role, finish, usage) carry `logprobs: null`, as OpenAI's do.
        let with_logprobs = self.logprobs && (piece.whole || !piece.tokens.is_empty());
        let (object, choice) = match self.endpoint {
            Endpoint::Completions => {
                let logprobs = with_logprobs.then(|| {
                    let mut offset = piece.offset;
                    let mut lp = CompletionLogprobs::default();
                    for t in &piece.tokens {
                        lp.text_offset.push(offset);
                        offset += t.text.len();
                        lp.token_logprobs.push(t.logprob);
                        lp.tokens.push(t.text.clone());
                    }
                    lp
                });
                let text = piece.text.unwrap_or_default();
                ("text_completion", to_json(&CompletionChoice { index: 0, text, logprobs, finish_reason }))
            }
            Endpoint::Chat => {
                let logprobs = with_logprobs.then(|| ChatLogprobs {
                    content: piece
                        .tokens
                        .iter()
                        .map(|t| TokenLogprob {
                            token: t.text.clone(),
                            logprob: t.logprob,
                            bytes: t.text.as_bytes().to_vec(),
                            top_logprobs: vec![],
                        })
                        .collect(),
                });
                let (object, message, delta) = if piece.whole {
                    let content = piece.text.unwrap_or_default();
                    ("chat.completion", Some(AssistantMessage { role: "assistant", content }), None)
                } else {
                    let delta = Delta { role: piece.role.then_some("assistant"), content: piece.text };
                    ("chat.completion.chunk", None, Some(delta))
                };
                (object, to_json(&ChatChoice { index: 0, message, delta, logprobs, finish_reason }))
            }
        };
        to_json(&Generation {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices: if piece.usage_only { vec![] } else { vec![choice] },
            usage: piece.usage,
        })
    }
}

fn to_json(v: &impl Serialize) -> serde_json::Value {
    // These types have only string keys, so serializing cannot fail.
    serde_json::to_value(v).unwrap_or_default()
}

/// Waits for the whole sequence and renders one response.
async fn collect(mut events: mpsc::Receiver<SeqEvent>, shaper: &Shaper) -> Result<Json<serde_json::Value>, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    loop {
        match events.recv().await {
            Some(SeqEvent::Token { id, logprob, text: delta }) => {
                text.push_str(&delta);
                tokens.extend(shaper.sampled(id, logprob));
            }
            Some(SeqEvent::Done { finish, text: rest, completion_tokens, timing }) => {
                text.push_str(&rest);
                tracing::debug!(?finish, completion_tokens, "completed");
                let piece = Piece {
                    text: Some(text),
                    tokens,
                    finish: Some(finish),
                    usage: Some(shaper.usage(completion_tokens).with_cached(timing.cached_tokens as usize)),
                    whole: true,
                    ..Piece::default()
                };
                return Ok(Json(shaper.render(piece)));
            }
            Some(SeqEvent::Failed { error, completion_tokens }) => {
                tracing::warn!(error = %error, completion_tokens, "generation failed");
                return Err(error.into());
            }
            None => return Err(dropped().into()),
        }
    }
}

fn dropped() -> ServiceError {
    ServiceError::internal("the pipeline dropped the sequence")
}

/// Where a stream is.
struct StreamState {
    events: mpsc::Receiver<SeqEvent>,
    shaper: Shaper,
    include_usage: bool,
    /// Bytes of token text sent so far (log-probability offsets).
    offset: usize,
    span: tracing::Span,
}

fn data(v: &serde_json::Value) -> Event {
    Event::default().data(v.to_string())
}

/// The SSE body: chat's role chunk, one chunk per token with text (or log-probabilities), the finish chunk, the
/// usage chunk if asked, `[DONE]`. A failure mid-stream is sent as an `{"error": ...}` event before `[DONE]`.
/// Each step runs in the request's `span`.
fn sse_stream(
    events: mpsc::Receiver<SeqEvent>,
    shaper: Shaper,
    include_usage: bool,
    span: tracing::Span,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let opening = (shaper.endpoint == Endpoint::Chat)
        .then(|| data(&shaper.render(Piece { role: true, text: Some(String::new()), ..Piece::default() })));
    let state = StreamState { events, shaper, include_usage, offset: 0, span };
    let rest = stream::unfold(Some(state), |state| {
        let span = state.as_ref().map_or_else(tracing::Span::none, |s| s.span.clone());
        next_events(state).instrument(span)
    });
    stream::iter(opening.map(|e| vec![e])).chain(rest).flat_map(|batch| stream::iter(batch.into_iter().map(Ok)))
}

/// The events for the sequence's next event, and the state to continue from (`None` once `[DONE]` is sent).
async fn next_events(state: Option<StreamState>) -> Option<(Vec<Event>, Option<StreamState>)> {
    let mut st = state?;
    let mut out = Vec::new();
    match st.events.recv().await {
        Some(SeqEvent::Token { id, logprob, text }) => {
            let tokens: Vec<Sampled> = st.shaper.sampled(id, logprob).into_iter().collect();
            // Text held back (a partial character or stop string) and no log-probabilities: nothing to send.
            if !text.is_empty() || !tokens.is_empty() {
                let offset = st.offset;
                st.offset += tokens.iter().map(|t| t.text.len()).sum::<usize>();
                out.push(data(&st.shaper.render(Piece { text: Some(text), tokens, offset, ..Piece::default() })));
            }
            return Some((out, Some(st)));
        }
        Some(SeqEvent::Done { finish, text, completion_tokens, timing }) => {
            tracing::debug!(?finish, completion_tokens, "stream completed");
            if !text.is_empty() {
                out.push(data(&st.shaper.render(Piece { text: Some(text), ..Piece::default() })));
            }
            // Chat's finish chunk has an empty delta; a completion's has empty text.
            let text = (st.shaper.endpoint == Endpoint::Completions).then(String::new);
            out.push(data(&st.shaper.render(Piece { text, finish: Some(finish), ..Piece::default() })));
            if st.include_usage {
                let usage = Some(st.shaper.usage(completion_tokens).with_cached(timing.cached_tokens as usize));
                out.push(data(&st.shaper.render(Piece { usage, usage_only: true, ..Piece::default() })));
            }
        }
        Some(SeqEvent::Failed { error, completion_tokens }) => {
            tracing::warn!(error = %error, completion_tokens, "generation failed mid-stream");
            out.push(data(&ApiError::from(error).to_json()));
        }
        None => out.push(data(&ApiError::from(dropped()).to_json())),
    }
    out.push(Event::default().data("[DONE]"));
    Some((out, None))
}
