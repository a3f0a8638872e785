//! Perplexity over a text, scored as llama.cpp's `llama-perplexity` scores it so that the two engines' numbers
//! compare, and with them the memory levers: what a weight format or KV type costs in perplexity is what a user
//! weighs against the memory it saves. The tokens are cut into chunks of `ctx`; each chunk runs from an empty
//! cache, its first token replaced by BOS where the tokenizer adds one, and only its second half is scored, so
//! every scored token sees at least `ctx / 2` tokens before it.

use serde::Serialize;

use crate::backend::Backend;
use crate::generate::Engine;
use crate::{Error, Result};

/// How a text is scored.
#[derive(Debug, Clone, Copy)]
pub struct PerplexityOptions {
    /// Tokens per chunk (llama-perplexity's `-c`).
    pub ctx: usize,
    /// Score at most this many chunks; `None`: every whole chunk the text holds.
    pub max_chunks: Option<usize>,
    /// Put in place of each chunk's first token: the tokenizer's BOS where it adds one.
    pub bos: Option<u32>,
}

/// A scored text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Perplexity {
    /// Tokens per chunk.
    pub ctx: usize,
    /// Chunks scored.
    pub chunks: usize,
    /// Tokens scored (`ctx - ctx / 2 - 1` per chunk).
    pub scored_tokens: usize,
    /// Perplexity over the chunks so far, after each one (llama-perplexity's `[i]` values).
    pub running: Vec<f64>,
    /// e to the mean negative log-likelihood.
    pub perplexity: f64,
    /// One standard error of `perplexity` (llama-perplexity's `+/-`).
    pub std_error: f64,
    /// Mean negative log-likelihood per scored token, in nats.
    pub mean_nll: f64,
}

/// Sums of the scored tokens' negative log-likelihoods.
#[derive(Debug, Default, Clone, Copy)]
struct Nll {
    sum: f64,
    sum_sq: f64,
    count: usize,
}

impl Nll {
    /// Scores one row of logits against the token that followed.
    fn add(&mut self, logits: &[f32], next: u32) {
        let v = -log_softmax(logits, next as usize);
        self.sum += v;
        self.sum_sq += v * v;
        self.count += 1;
    }

    /// The mean negative log-likelihood (0 before any token).
    fn mean(&self) -> f64 {
        self.sum / self.count.max(1) as f64
    }

    fn perplexity(&self) -> f64 {
        self.mean().exp()
    }

    /// The standard error of the perplexity, from that of the mean log-likelihood (as llama-perplexity's).
    fn std_error(&self) -> f64 {
        let (n, mean) = (self.count as f64, self.mean());
        let var = self.sum_sq / n - mean * mean;
        if self.count < 2 || var <= 0.0 { 0.0 } else { (var / (n - 1.0)).sqrt() * mean.exp() }
    }
}

/// `ln softmax(logits)[tok]`, with llama-perplexity's arithmetic: the exponentials in `f32`, their sum and the
/// logarithm in `f64`.
fn log_softmax(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum: f64 = logits.iter().map(|&x| f64::from((x - max).exp())).sum();
    f64::from(logits[tok] - max) - sum.ln()
}

/// The chunks a text of `tokens` tokens gives at `opts`; checked before any work is done.
fn chunks(tokens: usize, vocab: usize, opts: &PerplexityOptions) -> Result<usize> {
    let PerplexityOptions { ctx, max_chunks, bos } = *opts;
    if ctx < 4 {
        return Err(Error::InvalidRequest(format!("a chunk of {ctx} tokens scores none: give at least 4")));
    }
    if max_chunks == Some(0) {
        return Err(Error::InvalidRequest("at most 0 chunks: nothing to score".into()));
    }
    if let Some(b) = bos.filter(|&b| b as usize >= vocab) {
        return Err(Error::InvalidRequest(format!("BOS token {b} is outside the vocabulary (size {vocab})")));
    }
    // As llama-perplexity, which also asks for two chunks' worth.
    if tokens < 2 * ctx {
        return Err(Error::InvalidRequest(format!(
            "the text is {tokens} tokens: scoring chunks of {ctx} needs at least {}",
            2 * ctx
        )));
    }
    Ok(max_chunks.map_or(tokens / ctx, |m| m.min(tokens / ctx)))
}

/// Scores `tokens` with `engine` (whose KV cache holds at least `opts.ctx` tokens), calling `on_chunk(i, n,
/// running perplexity)` after each of the `n` chunks.
pub fn perplexity<B: Backend>(
    engine: &mut Engine<B>,
    tokens: &[u32],
    opts: PerplexityOptions,
    mut on_chunk: impl FnMut(usize, usize, f64),
) -> Result<Perplexity> {
    let vocab = engine.model().config().vocab_size;
    let n = chunks(tokens.len(), vocab, &opts)?;
    if let Some(bad) = tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::InvalidRequest(format!("token id {bad} is outside the vocabulary (size {vocab})")));
    }
    let (ctx, first) = (opts.ctx, opts.ctx / 2);
    let mut nll = Nll::default();
    let mut running = Vec::with_capacity(n);
    for i in 0..n {
        let chunk = &tokens[i * ctx..(i + 1) * ctx];
        let mut ids = chunk.to_vec();
        if let Some(bos) = opts.bos {
            ids[0] = bos;
        }
        let logits = engine.logits_of(&ids)?;
        for (j, row) in logits.chunks_exact(vocab).enumerate().take(ctx - 1).skip(first) {
            nll.add(row, chunk[j + 1]);
        }
        running.push(nll.perplexity());
        on_chunk(i, n, running[i]);
    }
    Ok(Perplexity {
        ctx,
        chunks: n,
        scored_tokens: nll.count,
        running,
        perplexity: nll.perplexity(),
        std_error: nll.std_error(),
        mean_nll: nll.mean(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_score_the_vocabulary_size() {
        let mut nll = Nll::default();
        for t in 0..10 {
            nll.add(&[0.5; 50], t);
        }
        assert!((nll.perplexity() - 50.0).abs() < 1e-9, "{}", nll.perplexity());
        // Every token scored alike: no spread (but the rounding of sum_sq / n - mean²).
        assert!(nll.std_error() < 1e-5, "{}", nll.std_error());
    }

    #[test]
    fn log_softmax_matches_the_definition() {
        let logits = [1.0f32, 3.0, -2.0, 0.25];
        let z: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        for (t, &x) in logits.iter().enumerate() {
            let want = f64::from(x) - z.ln();
            assert!((log_softmax(&logits, t) - want).abs() < 1e-6, "token {t}");
        }
        // Large logits do not overflow (the maximum is taken out first).
        assert!((log_softmax(&[1000.0, 1000.0], 0) - 0.5f64.ln()).abs() < 1e-9);
    }

    #[test]
    fn std_error_is_that_of_the_mean_scaled_by_the_perplexity() {
        let mut nll = Nll::default();
        // Two tokens, of probability 1/2 and 1/4 (uniform logits over 2 and over 4).
        nll.add(&[0.0, 0.0], 0);
        nll.add(&[0.0, 0.0, 0.0, 0.0], 0);
        let (a, b) = (2f64.ln(), 4f64.ln());
        let mean = (a + b) / 2.0;
        // The population variance over n - 1 = 1, as llama-perplexity divides.
        let sd = (((a - mean).powi(2) + (b - mean).powi(2)) / 2.0).sqrt();
        assert!((nll.perplexity() - mean.exp()).abs() < 1e-9);
        assert!((nll.std_error() - sd * mean.exp()).abs() < 1e-9);
    }

    #[test]
    fn chunks_are_whole_and_at_least_two() {
        let opts = |ctx, max_chunks| PerplexityOptions { ctx, max_chunks, bos: None };
        assert_eq!(chunks(1000, 100, &opts(128, None)).ok(), Some(7));
        assert_eq!(chunks(1000, 100, &opts(128, Some(3))).ok(), Some(3));
        assert_eq!(chunks(1000, 100, &opts(128, Some(30))).ok(), Some(7));
        for (tokens, o) in [(255, opts(128, None)), (100, opts(3, None)), (1000, opts(128, Some(0)))] {
            assert!(matches!(chunks(tokens, 100, &o), Err(Error::InvalidRequest(_))), "{tokens} {o:?}");
        }
        let bad_bos = PerplexityOptions { bos: Some(100), ..opts(128, None) };
        assert!(matches!(chunks(1000, 100, &bad_bos), Err(Error::InvalidRequest(_))));
    }
}
