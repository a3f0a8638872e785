//! vLLM's `/tokenize`, `/detokenize` and `/version`, in vLLM's request and response shapes. `/tokenize` answers
//! with exactly the ids generation would start from (`request::prompt_ids`, the chat template included), so a
//! client can count a prompt's tokens before sending it.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Request, State};
use serde::{Deserialize, Serialize};

use super::HttpState;
use super::errors::{ApiError, from_json, read_json};
use super::openai::{ChatMessageInput, chat_messages};
use crate::Error;
use crate::request::{self, Prompt};

/// `POST /tokenize`: a `prompt` (text) or the `messages` of a chat, as vLLM takes them.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    /// The model; `None` means the served one.
    #[serde(default)]
    pub model: Option<String>,
    /// Text to tokenize as a completion prompt.
    #[serde(default)]
    pub prompt: Option<String>,
    /// A conversation to tokenize through the chat template.
    #[serde(default)]
    pub messages: Option<Vec<ChatMessageInput>>,
    /// Whether the tokenizer adds its special tokens (BOS); only what generation does is served (true for a prompt).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// Whether the template ends with the assistant's turn; only what generation does is served (true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Return each token's string too (not served).
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

/// The answer of `/tokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    /// Tokens in `tokens`.
    pub count: usize,
    /// The longest sequence (prompt plus generated tokens) served.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Always `null`: token strings are not served.
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// The model; `None` means the served one.
    #[serde(default)]
    pub model: Option<String>,
    /// The token ids.
    pub tokens: Vec<u32>,
}

/// The answer of `/detokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    /// The text of the tokens.
    pub prompt: String,
}

/// The answer of `/version`.
#[derive(Debug, Clone, Serialize)]
pub struct VersionResponse {
    /// strata's version.
    pub version: &'static str,
}

/// `GET /version`.
pub async fn version() -> Json<VersionResponse> {
    Json(VersionResponse { version: env!("CARGO_PKG_VERSION") })
}

/// Refuses a request for a model other than the served one.
pub(super) fn check_model(state: &HttpState, model: Option<String>) -> Result<(), ApiError> {
    let served = &state.pipeline.model().name;
    match model {
        Some(asked) if &asked != served => Err(Error::UnknownModel { requested: asked, served: served.clone() }.into()),
        _ => Ok(()),
    }
}

/// An option only its generation value of which is served.
fn only(value: Option<bool>, served: bool, field: &str) -> Result<(), ApiError> {
    match value {
        Some(v) if v != served => {
            Err(ApiError::invalid(format!("{field} = {v} is not supported; generation uses {served}"), Some(field)))
        }
        _ => Ok(()),
    }
}

/// `POST /tokenize`.
pub async fn tokenize(State(state): State<Arc<HttpState>>, req: Request) -> Result<Json<TokenizeResponse>, ApiError> {
    let body: TokenizeRequest = from_json(&read_json(req, &()).await?)?;
    check_model(&state, body.model)?;
    only(body.return_token_strs, false, "return_token_strs")?;
    only(body.add_special_tokens, true, "add_special_tokens")?;
    only(body.add_generation_prompt, true, "add_generation_prompt")?;
    let prompt = match (body.prompt, body.messages) {
        (Some(text), None) => Prompt::Text(text),
        (None, Some(messages)) => Prompt::Chat(chat_messages(&messages)?),
        _ => return Err(ApiError::invalid("send either prompt or messages", None)),
    };
    let model = state.pipeline.model();
    let tokens = request::prompt_ids(model, prompt)?;
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: model.context, tokens, token_strs: None }))
}

/// `POST /detokenize`.
pub async fn detokenize(
    State(state): State<Arc<HttpState>>,
    req: Request,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let body: DetokenizeRequest = from_json(&read_json(req, &()).await?)?;
    check_model(&state, body.model)?;
    Ok(Json(DetokenizeResponse { prompt: request::detokenize(state.pipeline.model(), &body.tokens)? }))
}
