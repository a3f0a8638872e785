//! `strata generate`: one request, in this process.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use strata_engine::OnBackend;
use strata_engine::backend::Backend;
use strata_engine::generate::{Engine, GenerateRequest};
use strata_engine::sampling::SamplingParams;
use strata_engine::tokenizer::{ChatMessage, Tokenizer};

use crate::load::{DeviceArgs, load};

/// Prompt and sampling flags, shared with the cluster client.
#[derive(clap::Args, Debug, Clone)]
pub struct PromptArgs {
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, fed as is.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Random seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Presence penalty, OpenAI's: subtracted from the logits of tokens the output holds (-2..2; 0: off).
    #[arg(long, env = "STRATA_PRESENCE_PENALTY", default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty, OpenAI's: subtracted once per occurrence in the output (-2..2; 0: off).
    #[arg(long, env = "STRATA_FREQUENCY_PENALTY", default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Min-p: keep only tokens at least this likely relative to the most likely one (0..1; 0: off).
    #[arg(long, env = "STRATA_MIN_P", default_value_t = 0.0)]
    pub min_p: f32,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
}

/// How results are printed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Stream the text.
    Text,
    /// One JSON object at the end.
    Json,
}

impl PromptArgs {
    /// The sampling parameters.
    pub fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            min_p: self.min_p,
        }
    }

    /// Token ids of the prompt.
    pub fn prompt_ids(&self, tok: Option<&Tokenizer>) -> Result<Vec<u32>> {
        if let Some(ids) = &self.prompt_ids {
            if self.chat {
                bail!("--chat needs --prompt text, not --prompt-ids");
            }
            return Ok(ids.clone());
        }
        let text = self.prompt.as_deref().unwrap_or_default();
        let tok = tok.context("this model has no tokenizer; pass --prompt-ids")?;
        let text = if self.chat {
            tok.apply_chat_template(&[ChatMessage { role: "user".into(), content: text.to_string() }])?
        } else {
            text.to_string()
        };
        Ok(tok.encode(&text)?)
    }
}

/// Arguments of `strata generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Hugging Face directory or `.gguf` file.
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Runs `strata generate`.
pub fn run(a: GenerateArgs) -> Result<()> {
    a.device.clone().run(a)
}

impl OnBackend for GenerateArgs {
    type Out = ();
    type Error = anyhow::Error;

    fn run<B: Backend>(self, backend: Arc<B>) -> Result<()> {
        generate(self, backend)
    }
}

fn generate<B: Backend>(a: GenerateArgs, backend: Arc<B>) -> Result<()> {
    let needs_tok = a.prompt.prompt_ids.is_none();
    let loaded = load(&a.model, &a.device, backend, needs_tok)?;
    let prompt_ids = a.prompt.prompt_ids(loaded.tokenizer.as_deref())?;
    let req = GenerateRequest {
        prompt_ids,
        max_tokens: a.prompt.max_tokens,
        sampling: a.prompt.sampling(),
        stop: a.prompt.stop.clone(),
    };
    let kv_tokens = req.prompt_ids.len() + req.max_tokens;
    let kv_dtype = a.device.kv_dtype(&**loaded.model.backend());
    let mut engine = Engine::with_kv_dtype(loaded.model, loaded.tokenizer, kv_tokens, kv_dtype)?;
    let stream = a.prompt.format == Format::Text;
    let mut stdout = std::io::stdout().lock();
    let output = engine.generate(&req, |delta| {
        if stream && !delta.is_empty() {
            // A closed stdout (e.g. piped to `head`) must not abort generation bookkeeping.
            let _ = stdout.write_all(delta.as_bytes()).and_then(|_| stdout.flush());
        }
    })?;
    if stream {
        writeln!(stdout)?;
    } else {
        writeln!(stdout, "{}", serde_json::to_string(&output)?)?;
    }
    Ok(())
}
