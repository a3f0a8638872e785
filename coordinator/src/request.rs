//! Turning a client's generation request into a validated [`SeqRequest`]: the one path both public APIs (gRPC
//! `Generate` and the OpenAI-compatible HTTP endpoints) take, so they accept and refuse exactly the same requests.

use strata_engine::generate::{GenerateRequest as EngineRequest, validate_request};
use strata_engine::sampling::SamplingParams;
use strata_engine::tokenizer::ChatMessage;
use strata_proto::pb;

use crate::pipeline::{ModelInfo, SeqRequest};
use crate::{Error, Result};

/// `max_tokens` used when a request leaves it unset (capped by the context left after the prompt).
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// Most stop strings a request may carry: every generated token is checked against each of them.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

/// What to generate from, before tokenizing.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Plain text, tokenized as is.
    Text(String),
    /// A conversation, rendered through the model's chat template (ending with the assistant's turn).
    Chat(Vec<ChatMessage>),
    /// Token ids, used as given.
    Ids(Vec<u32>),
}

impl Prompt {
    /// The request field that carries this prompt, named in errors (`prompt` or `messages`).
    fn param(&self) -> &'static str {
        match self {
            Prompt::Chat(_) => "messages",
            Prompt::Text(_) | Prompt::Ids(_) => "prompt",
        }
    }
}

/// A generation request as either API received it, in the API-neutral form [`prepare`] validates.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// The model asked for; `None` means the served one.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Most tokens to generate; `None` means [`DEFAULT_MAX_TOKENS`] capped by the context left.
    pub max_tokens: Option<usize>,
    /// Sampling parameters (wire convention: zeros mean "off").
    pub sampling: pb::SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Return each token's log-probability.
    pub logprobs: bool,
    /// Generate past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
}

/// Checks the model name, tokenizes (through the chat template when asked), fills in the default `max_tokens`
/// and validates the result against the vocabulary and context of `model`.
pub fn prepare(model: &ModelInfo, params: GenerateParams) -> Result<SeqRequest> {
    if let Some(asked) = params.model.filter(|m| *m != model.name) {
        return Err(Error::UnknownModel { requested: asked, served: model.name.clone() });
    }
    check_stop(&params.stop)?;
    let param = params.prompt.param();
    let invalid = |message: String| Error::InvalidRequest { param: Some(param), message };
    let prompt_ids = prompt_ids(model, params.prompt)?;
    if prompt_ids.is_empty() {
        return Err(invalid("the prompt is empty".into()));
    }
    if prompt_ids.len() >= model.context {
        return Err(invalid(format!(
            "the prompt is {} tokens but the model's context is {} tokens, which leaves none to generate",
            prompt_ids.len(),
            model.context
        )));
    }
    let max_tokens = params.max_tokens.unwrap_or_else(|| DEFAULT_MAX_TOKENS.min(model.context - prompt_ids.len()));
    let s = &params.sampling;
    let engine_req = EngineRequest {
        prompt_ids,
        max_tokens,
        sampling: SamplingParams::with_zeros_off(s.temperature, s.top_k, s.top_p, s.seed, s.repetition_penalty)
            .with_penalties(s.presence_penalty, s.frequency_penalty)
            .with_min_p(s.min_p),
        stop: params.stop.clone(),
    };
    validate_request(&engine_req, model.vocab_size, model.context).map_err(|e| match e {
        strata_engine::Error::InvalidParam { param, message } => Error::InvalidRequest { param: Some(param), message },
        e => Error::InvalidRequest { param: None, message: e.to_string() },
    })?;
    Ok(SeqRequest {
        prompt_ids: engine_req.prompt_ids,
        max_tokens,
        sampling: params.sampling,
        stop: params.stop,
        logprobs: params.logprobs,
        ignore_eos: params.ignore_eos,
    })
}

/// The token ids generation starts from: text tokenized as is, a conversation through the chat template, ids as
/// given. `/tokenize` answers with the same ids.
pub fn prompt_ids(model: &ModelInfo, prompt: Prompt) -> Result<Vec<u32>> {
    tokenize(model, prompt, TokenizeOptions::default())
}

/// How `/tokenize` may tokenize otherwise than generation does (vLLM's options); the default is generation's way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizeOptions {
    /// Add the model's BOS/EOS tokens as it asks (when the text does not start with BOS already).
    pub add_special_tokens: bool,
    /// End a conversation with the template's opening of the assistant's turn.
    pub add_generation_prompt: bool,
}

impl Default for TokenizeOptions {
    fn default() -> Self {
        TokenizeOptions { add_special_tokens: true, add_generation_prompt: true }
    }
}

/// The token ids of `prompt` tokenized as `options` say.
pub fn tokenize(model: &ModelInfo, prompt: Prompt, options: TokenizeOptions) -> Result<Vec<u32>> {
    let param = prompt.param();
    let invalid = |message: String| Error::InvalidRequest { param: Some(param), message };
    let encode = |text: &str| {
        let tok = model.tokenizer.as_ref().ok_or_else(|| invalid(no_tokenizer()))?;
        tok.encode_with(text, options.add_special_tokens).map_err(|e| invalid(format!("tokenizing: {e}")))
    };
    Ok(match prompt {
        Prompt::Ids(ids) => ids,
        // Checked before tokenizing: a tokenizer that adds BOS would turn "" into a one-token prompt.
        Prompt::Text(text) if text.is_empty() => Vec::new(),
        Prompt::Chat(messages) if messages.is_empty() => return Err(invalid("messages is empty".into())),
        Prompt::Text(text) => encode(&text)?,
        Prompt::Chat(messages) => {
            let tok = model.tokenizer.as_ref().ok_or_else(|| invalid(no_tokenizer()))?;
            let text = tok
                .render_chat(&messages, options.add_generation_prompt)
                .map_err(|e| invalid(format!("chat template: {e}")))?;
            encode(&text)?
        }
    })
}

/// The text of `ids` (`/detokenize`); ids outside the vocabulary are refused.
pub fn detokenize(model: &ModelInfo, ids: &[u32]) -> Result<String> {
    let invalid = |message: String| Error::InvalidRequest { param: Some("tokens"), message };
    if let Some(id) = ids.iter().find(|&&id| id as usize >= model.vocab_size) {
        return Err(invalid(format!("token id {id} is outside the vocabulary of {} tokens", model.vocab_size)));
    }
    let tok = model.tokenizer.as_ref().ok_or_else(|| invalid(no_tokenizer()))?;
    tok.decode(ids).map_err(|e| invalid(format!("detokenizing: {e}")))
}

/// Refuses more than [`MAX_STOP_STRINGS`] stop strings, or one longer than [`MAX_STOP_BYTES`] or empty.
fn check_stop(stop: &[String]) -> Result<()> {
    let invalid = |message: String| Error::InvalidRequest { param: Some("stop"), message };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(format!("{} stop strings; at most {MAX_STOP_STRINGS} are accepted", stop.len())));
    }
    if let Some((i, s)) = stop.iter().enumerate().find(|(_, s)| s.len() > MAX_STOP_BYTES || s.is_empty()) {
        return Err(invalid(format!("stop string {i} is {} bytes; each must be 1 to {MAX_STOP_BYTES} bytes", s.len())));
    }
    Ok(())
}

fn no_tokenizer() -> String {
    "the model has no tokenizer; send token ids".into()
}

/// A fresh id for a request that came without one (logs, traces, response ids).
pub fn new_request_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    format!("{:016x}", RandomState::new().hash_one(std::time::SystemTime::now()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelInfo {
        ModelInfo { name: "m".into(), vocab_size: 10, context: 8, eos_token_ids: vec![], tokenizer: None }
    }

    fn ids(ids: &[u32], max_tokens: Option<usize>) -> GenerateParams {
        GenerateParams {
            model: None,
            prompt: Prompt::Ids(ids.to_vec()),
            max_tokens,
            sampling: pb::SamplingParams::default(),
            stop: vec![],
            logprobs: false,
            ignore_eos: false,
        }
    }

    fn param_of(r: Result<SeqRequest>) -> Option<&'static str> {
        match r {
            Err(Error::InvalidRequest { param, .. }) => param,
            other => panic!("expected InvalidRequest, got {other:?}"),
        }
    }

    #[test]
    fn the_default_max_tokens_is_capped_by_the_context_left() -> Result<()> {
        assert_eq!(prepare(&model(), ids(&[1, 2, 3], None))?.max_tokens, 5);
        assert_eq!(prepare(&model(), ids(&[1, 2, 3], Some(5)))?.max_tokens, 5);
        Ok(())
    }

    #[test]
    fn bad_requests_name_the_field_at_fault() {
        let wrong_model = GenerateParams { model: Some("other".into()), ..ids(&[1], None) };
        assert!(matches!(prepare(&model(), wrong_model), Err(Error::UnknownModel { .. })));
        assert_eq!(param_of(prepare(&model(), ids(&[], None))), Some("prompt"));
        assert_eq!(param_of(prepare(&model(), ids(&[1; 8], None))), Some("prompt"), "no room to generate");
        assert_eq!(param_of(prepare(&model(), ids(&[1], Some(8)))), None, "max_tokens beyond the context");
        assert_eq!(param_of(prepare(&model(), ids(&[1], Some(0)))), Some("max_tokens"));
        // Sampling parameters out of range, named by the engine's check (the HTTP API's `param`).
        let sampling = |s: pb::SamplingParams| GenerateParams { sampling: s, ..ids(&[1], None) };
        for (field, s) in [
            ("temperature", pb::SamplingParams { temperature: -1.0, ..Default::default() }),
            ("top_p", pb::SamplingParams { top_p: 1.5, ..Default::default() }),
            ("min_p", pb::SamplingParams { min_p: 2.0, ..Default::default() }),
            ("repetition_penalty", pb::SamplingParams { repetition_penalty: -1.0, ..Default::default() }),
            ("presence_penalty", pb::SamplingParams { presence_penalty: 3.0, ..Default::default() }),
            ("frequency_penalty", pb::SamplingParams { frequency_penalty: -3.0, ..Default::default() }),
        ] {
            assert_eq!(param_of(prepare(&model(), sampling(s))), Some(field), "{field}");
        }
        assert_eq!(param_of(prepare(&model(), ids(&[10], None))), None, "outside the vocabulary");
        let empty_text = GenerateParams { prompt: Prompt::Text(String::new()), ..ids(&[], None) };
        assert_eq!(param_of(prepare(&model(), empty_text)), Some("prompt"));
        let no_messages = GenerateParams { prompt: Prompt::Chat(vec![]), ..ids(&[], None) };
        assert_eq!(param_of(prepare(&model(), no_messages)), Some("messages"));
        let chat = vec![ChatMessage { role: "user".into(), content: "hi".into() }];
        let no_tokenizer = GenerateParams { prompt: Prompt::Chat(chat), ..ids(&[], None) };
        assert_eq!(param_of(prepare(&model(), no_tokenizer)), Some("messages"));
    }

    #[test]
    fn stop_strings_are_capped_in_count_and_length() -> Result<()> {
        let with_stop = |stop: Vec<String>| GenerateParams { stop, ..ids(&[1], None) };
        prepare(&model(), with_stop(vec!["x".repeat(MAX_STOP_BYTES); MAX_STOP_STRINGS]))?;
        let too_many = with_stop(vec!["x".into(); MAX_STOP_STRINGS + 1]);
        assert_eq!(param_of(prepare(&model(), too_many)), Some("stop"));
        assert_eq!(param_of(prepare(&model(), with_stop(vec!["x".repeat(MAX_STOP_BYTES + 1)]))), Some("stop"));
        assert_eq!(param_of(prepare(&model(), with_stop(vec![String::new()]))), Some("stop"));
        Ok(())
    }
}
