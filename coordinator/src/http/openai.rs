//! OpenAI's request and response shapes for `/v1/completions`, `/v1/chat/completions` and `/v1/models`, and their
//! conversion into the API-neutral [`GenerateParams`].
//!
//! Request types do not deny unknown fields: OpenAI ignores fields it does not know and clients send many (`user`,
//! `metadata`, ...). A known field of the wrong type is still a 400, and so is a field asking for something strata
//! does not do ([`UNSUPPORTED`]: tools, response formats, logit biases, several choices, ...): silently ignoring
//! it would return an answer the client did not ask for.

use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use strata_engine::tokenizer::ChatMessage;
use strata_proto::pb;

use super::completions::Endpoint;
use super::errors::{ApiError, from_json, parse_json, read_json};
use crate::request::{GenerateParams, Prompt};

/// A request body: the endpoint's own fields and the [`CommonFields`], both read from the same JSON object (not
/// with `#[serde(flatten)]`, which would lose the path of a field of the wrong type).
#[derive(Debug, Clone)]
pub struct Body<T> {
    /// The endpoint's own fields.
    pub fields: T,
    /// The fields every generation endpoint takes.
    pub common: CommonFields,
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Body::from_value(&read_json(req, state).await?)
    }
}

impl<T: DeserializeOwned> Body<T> {
    /// Reads a request body as the HTTP handlers do (the fuzz target's entry).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ApiError> {
        Body::from_value(&parse_json(bytes)?)
    }

    fn from_value(value: &serde_json::Value) -> Result<Self, ApiError> {
        refuse_unsupported(value)?;
        Ok(Body { fields: from_json(value)?, common: from_json(value)? })
    }
}

/// Fields of OpenAI's (and vLLM's) requests that ask for what strata does not do, with the values that ask for
/// nothing (also accepted, as clients send defaults explicitly). `null` is always accepted.
pub const UNSUPPORTED: [(&str, &[&str]); 18] = [
    ("tools", &["[]"]),
    ("tool_choice", &["\"none\""]),
    ("parallel_tool_calls", &["false", "true"]),
    ("functions", &["[]"]),
    ("function_call", &["\"none\""]),
    ("response_format", &["{\"type\":\"text\"}"]),
    ("logit_bias", &["{}"]),
    ("echo", &["false"]),
    ("best_of", &["1"]),
    ("suffix", &["\"\""]),
    ("audio", &[]),
    ("modalities", &["[\"text\"]"]),
    ("prediction", &[]),
    ("min_tokens", &["0"]),
    ("use_beam_search", &["false"]),
    ("prompt_logprobs", &[]),
    ("guided_json", &[]),
    ("guided_regex", &[]),
];

/// Refuses a body with a field of [`UNSUPPORTED`] that asks for something, naming it.
fn refuse_unsupported(body: &serde_json::Value) -> Result<(), ApiError> {
    for (field, harmless) in UNSUPPORTED {
        let Some(value) = body.get(field).filter(|v| !v.is_null()) else { continue };
        let written = value.to_string();
        if !harmless.contains(&written.as_str()) {
            return Err(ApiError::invalid(
                format!("{field} is not supported by this server (got {written})"),
                Some(field),
            ));
        }
    }
    Ok(())
}

/// `prompt` of a completion: text, a batch of one text, token ids, or a batch of one token-id list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// `"text"`.
    Text(String),
    /// `[1, 2, 3]`.
    Ids(Vec<u32>),
    /// `["text"]`.
    Texts(Vec<String>),
    /// `[[1, 2, 3]]`.
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    /// `"\n"`.
    One(String),
    /// `["\n", "."]`.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `choices: []`) before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The fields completions and chat completions share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    /// The model; `None` means the served one.
    #[serde(default)]
    pub model: Option<String>,
    /// Sampling temperature; OpenAI's default is 1 (0 is greedy).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass (1 = off).
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens (vLLM's extension; 0 or -1 = off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Divide the logits of tokens already seen by this (vLLM's extension; 1 = off).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Subtract this from the logits of tokens the output holds (OpenAI's; -2..2, 0 = off).
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Subtract this once per occurrence in the output (OpenAI's; -2..2, 0 = off).
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Keep only tokens at least this likely relative to the most likely one (vLLM's extension; 0 = off).
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Seed of the sampler's random stream.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop strings (not included in the output).
    #[serde(default)]
    pub stop: Option<StopInput>,
    /// Choices to generate; only 1 is served.
    #[serde(default)]
    pub n: Option<u32>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Generate past end-of-sequence tokens (not OpenAI's; vLLM's extension, for benchmarks).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

impl CommonFields {
    /// Whether the response is streamed, and whether the stream ends with a usage chunk.
    pub fn streaming(&self) -> (bool, bool) {
        let include_usage = self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
        (self.stream.unwrap_or(false), include_usage)
    }

    fn params(&self, prompt: Prompt, max_tokens: Option<u32>, logprobs: bool) -> Result<GenerateParams, ApiError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid(format!("n = {n} is not supported; only n = 1 is served"), Some("n")));
        }
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) => u32::try_from(k).map_err(|_| {
                ApiError::invalid(format!("top_k must be -1 (off), 0 (off) or positive, got {k}"), Some("top_k"))
            })?,
        };
        let sampling = pb::SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: nonzero("top_p", self.top_p, 1.0, "in (0, 1]")?,
            top_k,
            seed: self.seed,
            repetition_penalty: nonzero("repetition_penalty", self.repetition_penalty, 1.0, "> 0")?,
            // Ranges are checked by the engine's validation (`request::prepare`), which names the parameter.
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            min_p: self.min_p.unwrap_or(0.0),
        };
        let stop = match self.stop.clone() {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s],
            Some(StopInput::Many(v)) => v,
        };
        Ok(GenerateParams {
            model: self.model.clone(),
            prompt,
            max_tokens: max_tokens.map(|n| n as usize),
            sampling,
            stop,
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: PromptInput,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Return the sampled tokens' log-probabilities (only 0 is served: no alternatives).
    #[serde(default)]
    pub logprobs: Option<u32>,
}

/// A generation endpoint's own request fields.
pub trait GenerationRequest: DeserializeOwned {
    /// The endpoint they belong to.
    const ENDPOINT: Endpoint;
    /// The API-neutral request, with the `common` fields read from the same body.
    fn params(&self, common: &CommonFields) -> Result<GenerateParams, ApiError>;
}

impl GenerationRequest for CompletionRequest {
    const ENDPOINT: Endpoint = Endpoint::Completions;

    fn params(&self, common: &CommonFields) -> Result<GenerateParams, ApiError> {
        let one =
            |what: &str| ApiError::invalid(format!("send one {what}; batched prompts are not served"), Some("prompt"));
        let prompt = match self.prompt.clone() {
            PromptInput::Text(t) => Prompt::Text(t),
            PromptInput::Ids(ids) => Prompt::Ids(ids),
            PromptInput::Texts(v) => Prompt::Text(single(v).ok_or_else(|| one("string"))?),
            PromptInput::IdLists(v) => Prompt::Ids(single(v).ok_or_else(|| one("token-id list"))?),
        };
        if let Some(k) = self.logprobs.filter(|&k| k > 0) {
            return Err(ApiError::invalid(
                format!(
                    "logprobs = {k} asks for alternatives, which are not served; logprobs = 0 returns the sampled tokens' log-probabilities"
                ),
                Some("logprobs"),
            ));
        }
        common.params(prompt, self.max_tokens, self.logprobs.is_some())
    }
}

/// `value`, or `default` when absent; 0 refused with the parameter's range (`range`). The wire's 0 means "off" for
/// these two, so a 0 would reach the engine as the default and never meet its range check, which takes every other
/// value (negative, not finite) with the same message.
fn nonzero(field: &str, value: Option<f32>, default: f32, range: &str) -> Result<f32, ApiError> {
    match value {
        Some(v) if v == 0.0 => Err(ApiError::invalid(format!("{field} must be {range}, got {v}"), Some(field))),
        v => Ok(v.unwrap_or(default)),
    }
}

fn single<T>(mut v: Vec<T>) -> Option<T> {
    if v.len() == 1 { v.pop() } else { None }
}

/// One message of a chat request.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageInput {
    /// One of [`CHAT_ROLES`].
    pub role: String,
    /// The text; absent or `null` is refused (it only comes with tool calls, which are not served).
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// The roles a chat message may have (tools and functions are not served, so neither are their roles).
pub const CHAT_ROLES: [&str; 3] = ["system", "user", "assistant"];

/// A message's `content`: text, or a list of parts of which only text parts are served.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// `"text"`.
    Text(String),
    /// `[{"type": "text", "text": "..."}]`.
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's type; only `text` is served.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessageInput>,
    /// Most tokens to generate (deprecated by OpenAI in favour of `max_completion_tokens`).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// Return the sampled tokens' log-probabilities.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per token (only 0 is served).
    #[serde(default)]
    pub top_logprobs: Option<u32>,
}

impl GenerationRequest for ChatRequest {
    const ENDPOINT: Endpoint = Endpoint::Chat;

    fn params(&self, common: &CommonFields) -> Result<GenerateParams, ApiError> {
        let messages = chat_messages(&self.messages)?;
        if let Some(k) = self.top_logprobs.filter(|&k| k > 0) {
            return Err(ApiError::invalid(
                format!("top_logprobs = {k} asks for alternatives, which are not served"),
                Some("top_logprobs"),
            ));
        }
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        common.params(Prompt::Chat(messages), max_tokens, self.logprobs.unwrap_or(false))
    }
}

/// The conversation of a chat request, refusing unknown roles, missing content and non-text parts.
pub fn chat_messages(messages: &[ChatMessageInput]) -> Result<Vec<ChatMessage>, ApiError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !CHAT_ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    format!("role {:?} is not served (one of {})", m.role, CHAT_ROLES.join(", ")),
                    Some(&format!("messages[{i}].role")),
                ));
            }
            let content = match &m.content {
                None => {
                    return Err(ApiError::invalid(
                        "content is missing or null; send the message's text",
                        Some(&format!("messages[{i}].content")),
                    ));
                }
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => parts
                    .iter()
                    .map(|p| match (&*p.kind, &p.text) {
                        ("text", Some(t)) => Ok(t.as_str()),
                        _ => Err(ApiError::invalid(
                            format!("content part of type {:?} is not served (only text)", p.kind),
                            Some(&format!("messages[{i}].content")),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
            };
            Ok(ChatMessage { role: m.role.clone(), content })
        })
        .collect()
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Tokens in the prompt (after the chat template).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Of the prompt's tokens, those found in the prefix cache; absent when generation failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// OpenAI's breakdown of the prompt's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Tokens found in the prefix cache, not computed again.
    pub cached_tokens: usize,
}

impl Usage {
    /// Usage of a prompt of `prompt` tokens that generated `completion`.
    pub fn new(prompt: usize, completion: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: None,
        }
    }

    /// The same, saying that `cached` of the prompt's tokens came from the prefix cache.
    pub fn with_cached(self, cached: usize) -> Self {
        Usage { prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: cached }), ..self }
    }
}

/// A `text_completion`, `chat.completion` or `chat.completion.chunk`: whole responses and stream chunks share
/// this envelope; `C` is the endpoint's choice.
#[derive(Debug, Clone, Serialize)]
pub struct Generation<C> {
    /// `cmpl-...` or `chatcmpl-...`.
    pub id: String,
    /// `text_completion`, `chat.completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// One choice (or none in a stream's usage chunk).
    pub choices: Vec<C>,
    /// Token counts (whole responses, and a stream's usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A completion choice.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// Always 0.
    pub index: u32,
    /// The text (a delta when streaming).
    pub text: String,
    /// Log-probabilities of the tokens, when asked.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop` or `length` on the last chunk; `null` before.
    pub finish_reason: Option<&'static str>,
}

/// Legacy completions' log-probabilities.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f32>,
    /// Alternatives: not served, always `null`.
    pub top_logprobs: Option<Vec<()>>,
    /// Each token's byte offset in the generated text.
    pub text_offset: Vec<usize>,
}

/// A chat choice: `message` in a whole response, `delta` in a chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: u32,
    /// The whole assistant message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantMessage>,
    /// What this chunk adds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    /// Log-probabilities of the tokens, when asked.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length` on the last chunk; `null` before.
    pub finish_reason: Option<&'static str>,
}

/// The assistant's reply.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The text.
    pub content: String,
}

/// A chunk's addition to the message.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// `assistant`, on the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// Chat log-probabilities.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// One entry per token.
    pub content: Vec<TokenLogprob>,
}

/// One token's log-probability.
#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
    /// Alternatives: not served, always empty.
    pub top_logprobs: Vec<()>,
}

/// `GET /v1/models` and `GET /v1/models/{id}` entries.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The model's name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds (when this coordinator started serving it).
    pub created: u64,
    /// `strata`.
    pub owned_by: &'static str,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}
