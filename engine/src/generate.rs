//! Single-process generation: one stage holding every layer, a KV cache, a tokenizer and a sampler.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::kv_cache::KvCache;
use crate::model::{LogitRows, SeqChunk, StageInput, StageModel};
use crate::sampling::{Sampler, SamplingParams, TokenHistory};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::{Error, KvDtype, Result};

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string appeared.
    Stop,
}

/// A generation request in token space.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop when the text contains any of these (the stop string is cut from the text).
    pub stop: Vec<String>,
}

/// The outcome of a generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// Ids fed to the model.
    pub prompt_ids: Vec<u32>,
    /// Generated ids.
    pub token_ids: Vec<u32>,
    /// Generated text.
    pub text: String,
    /// Why it stopped.
    pub finish_reason: FinishReason,
}

/// Checks a request against the model before any work is done.
pub fn validate_request(req: &GenerateRequest, vocab_size: usize, context: usize) -> Result<()> {
    if req.prompt_ids.is_empty() {
        return Err(Error::InvalidRequest("empty prompt".into()));
    }
    if let Some(bad) = req.prompt_ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(Error::InvalidRequest(format!(
            "prompt token id {bad} is outside the vocabulary (size {vocab_size})"
        )));
    }
    if req.max_tokens == 0 {
        return Err(Error::InvalidParam { param: "max_tokens", message: "max_tokens must be at least 1".into() });
    }
    if req.prompt_ids.len() + req.max_tokens > context {
        return Err(Error::InvalidRequest(format!(
            "prompt ({} tokens) + max_tokens ({}) exceeds the context length {context}",
            req.prompt_ids.len(),
            req.max_tokens
        )));
    }
    req.sampling.validate()
}

/// Tracks generated text and stop strings.
#[derive(Debug)]
pub struct StopState {
    stop: Vec<String>,
    /// The longest stop string, in bytes.
    longest: usize,
    text: String,
    sent: usize,
}

impl StopState {
    /// Starts tracking with the given stop strings.
    pub fn new(stop: Vec<String>) -> Self {
        let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        let longest = stop.iter().map(String::len).max().unwrap_or(0);
        StopState { stop, longest, text: String::new(), sent: 0 }
    }

    /// Adds newly decoded text; returns the text safe to emit now and whether a stop string was hit. Only the new
    /// text and the few bytes before it a match could start in are searched: earlier matches were looked for
    /// when their text arrived, so a step costs O(new text), not O(all text).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        let mut from = self.text.len().saturating_sub(self.longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.text.push_str(piece);
        let tail = &self.text[from..];
        if let Some(cut) = self.stop.iter().filter_map(|s| tail.find(s.as_str())).min() {
            self.text.truncate(from + cut);
            let delta = self.text.get(self.sent..).unwrap_or("").to_string();
            self.sent = self.text.len();
            return (delta, true);
        }
        // Hold back a tail that could still grow into a stop string.
        let mut upto = self.text.len().saturating_sub(self.longest.saturating_sub(1)).max(self.sent);
        while !self.text.is_char_boundary(upto) {
            upto -= 1;
        }
        let delta = self.text[self.sent..upto.max(self.sent)].to_string();
        self.sent = upto.max(self.sent);
        (delta, false)
    }

    /// Emits whatever was held back and returns the full text.
    pub fn finish(mut self) -> (String, String) {
        let rest = self.text.get(self.sent..).unwrap_or("").to_string();
        self.sent = self.text.len();
        (rest, self.text)
    }
}

/// A whole model in one process.
pub struct Engine<B: Backend> {
    model: StageModel<B>,
    kv: KvCache<B>,
    tokenizer: Option<Arc<Tokenizer>>,
    next_seq: u64,
}

/// Tokens per KV block on the CPU engine.
pub const BLOCK_SIZE: usize = 16;

impl<B: Backend> Engine<B> {
    /// Wraps a full model (all layers) with a KV cache for `kv_tokens` positions in the backend's default KV
    /// type. Without a tokenizer the engine works in token space only (no text, no stop strings).
    pub fn new(model: StageModel<B>, tokenizer: Option<Arc<Tokenizer>>, kv_tokens: usize) -> Result<Self> {
        let kv_dtype = model.backend().default_kv_dtype();
        Self::with_kv_dtype(model, tokenizer, kv_tokens, kv_dtype)
    }

    /// [`Engine::new`] with the KV cache stored as `kv_dtype`.
    pub fn with_kv_dtype(
        model: StageModel<B>,
        tokenizer: Option<Arc<Tokenizer>>,
        kv_tokens: usize,
        kv_dtype: KvDtype,
    ) -> Result<Self> {
        if !(model.is_first() && model.is_last()) {
            return Err(Error::Config("the single-process engine needs every layer".into()));
        }
        let mut kv = model.new_kv_cache(kv_tokens.div_ceil(BLOCK_SIZE).max(1), BLOCK_SIZE, kv_dtype)?;
        // Sized for what the caller runs, so every page gets written anyway: taken now, not one page fault at a
        // time inside the steps (each costly on a VM; batch-1 decode ran ~6 % slower with the faults).
        kv.prefault(model.backend());
        Ok(Engine { model, kv, tokenizer, next_seq: 0 })
    }

    /// The model.
    pub fn model(&self) -> &StageModel<B> {
        &self.model
    }

    /// The tokenizer, when the model has one.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// The KV cache (to inspect capacity).
    pub fn kv(&self) -> &KvCache<B> {
        &self.kv
    }

    /// Runs `f` on this engine in the backend's execution context (the CPU backend's pool), so the steps it
    /// takes run on the thread that called them: a [`Engine::step`] outside it hands its work into the pool and
    /// waits for it, two thread wake-ups per step (50-150 µs each on the development VMs).
    pub fn scoped<R: Send>(&mut self, f: impl FnOnce(&mut Self) -> R + Send) -> R {
        let backend = Arc::clone(self.model.backend());
        backend.scope(|| f(self))
    }

    /// Runs one forward step for several sequences and returns each one's last-token logits, host-side.
    pub fn step(&mut self, chunks: &[SeqChunk], ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let logits = self.model.forward(&mut self.kv, chunks, StageInput::Tokens(ids), LogitRows::Last)?;
        let be = self.model.backend();
        let vocab = be.act_shape(&logits).1;
        Ok(be.act_to_host(&logits)?.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }

    /// Runs `ids` as a new sequence from position 0 and returns every position's logits, host-side (a row of the
    /// vocabulary per token); the sequence's KV is freed after, whatever the outcome. Ids outside the vocabulary
    /// are refused by the backend's embedding lookup, as in [`Engine::step`].
    pub fn logits_of(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let chunk = SeqChunk { seq_id: seq, start_pos: 0, len: ids.len() };
        let logits = self.model.forward(&mut self.kv, &[chunk], StageInput::Tokens(ids), LogitRows::All);
        self.kv.release(seq);
        self.model.backend().act_to_host(&logits?)
    }

    /// Frees a sequence's KV blocks.
    pub fn release(&mut self, seq: u64) {
        self.kv.release(seq);
    }

    /// Generates for one request, calling `on_text` with each new piece of text.
    pub fn generate(&mut self, req: &GenerateRequest, mut on_text: impl FnMut(&str)) -> Result<Generation> {
        let cfg = self.model.config();
        validate_request(req, cfg.vocab_size, cfg.max_position_embeddings)?;
        let eos = cfg.eos_token_ids.clone();
        let seq = self.next_seq;
        self.next_seq += 1;
        let result = self.run(seq, req, &eos, &mut on_text);
        self.kv.release(seq);
        result
    }

    fn run(
        &mut self,
        seq: u64,
        req: &GenerateRequest,
        eos: &[u32],
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut history = TokenHistory::from_prompt(&req.prompt_ids);
        let mut stop = StopState::new(req.stop.clone());
        let mut out = Vec::new();
        let mut chunk = SeqChunk { seq_id: seq, start_pos: 0, len: req.prompt_ids.len() };
        let mut input = req.prompt_ids.clone();
        let tok = self.tokenizer.clone();
        let mut decoder = IncrementalDecoder::default();
        let finish = loop {
            let mut logits = self.step(&[chunk], &input)?.remove(0);
            let next = sampler.sample(&mut logits, &history);
            if eos.contains(&next) {
                break FinishReason::Eos;
            }
            out.push(next);
            history.push(next);
            let piece = match &tok {
                Some(t) => decoder.push(t, next)?,
                None => String::new(),
            };
            let (delta, hit) = stop.push(&piece);
            on_text(&delta);
            if hit {
                break FinishReason::Stop;
            }
            if out.len() >= req.max_tokens {
                break FinishReason::Length;
            }
            chunk = SeqChunk { seq_id: seq, start_pos: chunk.start_pos + chunk.len, len: 1 };
            input = vec![next];
        };
        let (rest, text) = stop.finish();
        on_text(&rest);
        Ok(Generation { prompt_ids: req.prompt_ids.clone(), token_ids: out, text, finish_reason: finish })
    }
}
