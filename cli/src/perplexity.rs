//! `strata perplexity`: a model's perplexity over a text file, in this process, scored as llama.cpp's
//! `llama-perplexity` scores it (see `strata_engine::perplexity`), so the same file and text give comparable
//! numbers in both, and the weight formats and KV types can be weighed by what they cost.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use serde::Serialize;
use strata_engine::OnBackend;
use strata_engine::backend::Backend;
use strata_engine::generate::Engine;
use strata_engine::perplexity::{Perplexity, PerplexityOptions, perplexity};

use crate::host::Host;
use crate::load::{DeviceArgs, load};

/// Arguments of `strata perplexity`.
#[derive(clap::Args)]
pub struct PerplexityArgs {
    /// Hugging Face directory or `.gguf` file.
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    /// The text to score (UTF-8; at least two chunks' worth of tokens).
    #[arg(long, env = "STRATA_PERPLEXITY_FILE")]
    file: PathBuf,
    /// Tokens per chunk, each scored from an empty cache over its second half (llama-perplexity's `-c`).
    #[arg(long, env = "STRATA_PERPLEXITY_CTX", default_value_t = 512)]
    ctx: usize,
    /// Score at most this many chunks (default: every whole chunk of the text).
    #[arg(long, env = "STRATA_PERPLEXITY_CHUNKS")]
    chunks: Option<usize>,
    /// Where to write the JSON report.
    #[arg(long, env = "STRATA_PERPLEXITY_OUT", default_value = "target/bench/perplexity.json")]
    out: PathBuf,
    #[command(flatten)]
    device: DeviceArgs,
}

/// The JSON report.
#[derive(Serialize)]
struct Report {
    model: String,
    file: String,
    backend: String,
    kv_dtype: String,
    text_tokens: usize,
    seconds: f64,
    #[serde(flatten)]
    scored: Perplexity,
    host: Host,
}

/// Runs `strata perplexity`.
pub fn run(a: PerplexityArgs) -> Result<()> {
    a.device.clone().run(a)
}

impl OnBackend for PerplexityArgs {
    type Out = ();
    type Error = anyhow::Error;

    fn run<B: Backend>(self, backend: Arc<B>) -> Result<()> {
        score(self, backend)
    }
}

fn score<B: Backend>(a: PerplexityArgs, backend: Arc<B>) -> Result<()> {
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let loaded = load(&a.model, &a.device, backend.clone(), true)?;
    let tok = loaded.tokenizer.clone().context("this model has no tokenizer")?;
    let tokens = tok.encode(&text)?;
    let kv_dtype = a.device.kv_dtype(&*backend);
    let mut engine = Engine::with_kv_dtype(loaded.model, loaded.tokenizer, a.ctx, kv_dtype)?;
    let opts = PerplexityOptions { ctx: a.ctx, max_chunks: a.chunks, bos: tok.add_bos };
    let started = std::time::Instant::now();
    let scored = engine.scoped(|e| {
        let mut stdout = std::io::stdout().lock();
        perplexity(e, &tokens, opts, |i, n, ppl| {
            // As llama-perplexity prints them: `[chunk]perplexity so far`. A closed stdout must not stop the run.
            let _ = write!(stdout, "[{}]{ppl:.4},", i + 1).and_then(|_| stdout.flush());
            if i + 1 == n {
                let _ = writeln!(stdout);
            }
        })
    })?;
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}  ({} chunks of {} tokens, {} scored; {:.1} s)",
        scored.perplexity, scored.std_error, scored.chunks, scored.ctx, scored.scored_tokens, seconds
    );
    let report = Report {
        model: a.model.display().to_string(),
        file: a.file.display().to_string(),
        backend: backend.name(),
        kv_dtype: kv_dtype.to_string(),
        text_tokens: tokens.len(),
        seconds,
        scored,
        host: Host::detect(),
    };
    crate::json_file::write(&a.out, &report)?;
    println!("wrote {}", a.out.display());
    Ok(())
}
