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
use crate::request::{self, Prompt, TokenizeOptions};

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
    /// Whether the tokenizer adds the model's special tokens (BOS/EOS); absent: as generation does (true).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// Whether a conversation ends with the template's opening of the assistant's turn; absent: as generation
    /// does (true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Return each token's vocabulary string too.
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
    /// Each token's vocabulary string (`return_token_strs`), else `null`.
    pub token_strs: Option<Vec<Option<String>>>,
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

/// `POST /tokenize`.
pub async fn tokenize(State(state): State<Arc<HttpState>>, req: Request) -> Result<Json<TokenizeResponse>, ApiError> {
    let body: TokenizeRequest = from_json(&read_json(req, &()).await?)?;
    check_model(&state, body.model)?;
    let prompt = match (body.prompt, body.messages) {
        (Some(text), None) => Prompt::Text(text),
        (None, Some(messages)) => Prompt::Chat(chat_messages(&messages)?),
        _ => return Err(ApiError::invalid("send either prompt or messages", None)),
    };
    let defaults = TokenizeOptions::default();
    let options = TokenizeOptions {
        add_special_tokens: body.add_special_tokens.unwrap_or(defaults.add_special_tokens),
        add_generation_prompt: body.add_generation_prompt.unwrap_or(defaults.add_generation_prompt),
    };
    let model = state.pipeline.model();
    let tokens = request::tokenize(model, prompt, options)?;
    let token_strs = match (body.return_token_strs, &model.tokenizer) {
        (Some(true), Some(tok)) => Some(tok.token_strs(&tokens)),
        _ => None,
    };
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: model.context, tokens, token_strs }))
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
