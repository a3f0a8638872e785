//! The engine in this process as the cluster benchmark's yardstick: its batch-1 decode latency, and the
//! benchmark's own workload batched by rounds (no scheduler, no transport), so serving is compared with the engine
//! on the same work by one command in one run.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use strata_engine::CpuIsa;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::generate::{BLOCK_SIZE, Engine};
use strata_engine::model::SeqChunk;
use strata_engine::sampling::{Draw, SamplingParams, SequenceSampler, TokenHistory, draw_all};

use super::report::SingleProcess;
use super::{Tenth, percentile, tenth_mean};

/// The whole model on the CPU backend in this process.
pub(super) struct EngineBaseline {
    engine: Engine<CpuBackend>,
    vocab: u32,
    threads: usize,
}

/// The engine's rates on one workload.
#[derive(Debug, Clone, Copy)]
pub(super) struct EngineRate {
    /// Tokens generated per second over the whole workload (prefill steps included).
    pub tokens_per_s: f64,
    /// Tokens per second over the decode steps alone.
    pub decode_tokens_per_s: f64,
}

impl EngineBaseline {
    /// Loads `model` with `threads` threads and KV room for `sequences` sequences of `tokens_per_seq` tokens.
    pub fn load(
        model: &Path,
        threads: usize,
        cpu_isa: CpuIsa,
        sequences: usize,
        tokens_per_seq: usize,
    ) -> Result<Self> {
        let backend = Arc::new(CpuBackend::with_isa(threads, cpu_isa)?);
        let device = crate::load::DeviceArgs {
            device: strata_engine::Device::Cpu,
            dtype: None,
            quantize: None,
            threads,
            cpu_isa,
            kv_dtype: None,
        };
        let loaded = crate::load::load(model, &device, backend, false)?;
        let vocab = u32::try_from(loaded.model.config().vocab_size)?;
        // Every sequence holds whole blocks.
        let kv_tokens = sequences.max(1) * (tokens_per_seq + 1).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        Ok(Self { engine: Engine::new(loaded.model, None, kv_tokens)?, vocab, threads })
    }

    /// Batch-1 decode latency per token after `prompt`, picking tokens as `sampling` says (seed 0): p50, and the
    /// means over the first and last tenth.
    pub fn decode_latency(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        sampling: &SamplingParams,
    ) -> Result<SingleProcess> {
        let prompt: Vec<u32> = prompt.iter().map(|&id| id % self.vocab).collect();
        let mut picker = Picker::new(sampling, [(0, prompt.as_slice())]);
        // In the backend's context, as a stage's executor runs its batches.
        let mut times = self.engine.scoped(|engine| -> Result<Vec<f64>> {
            let logits = engine.step(&[SeqChunk { seq_id: 0, start_pos: 0, len: prompt.len() }], &prompt)?;
            let mut next = picker.pick(logits);
            let mut times = Vec::with_capacity(max_tokens);
            for i in 0..max_tokens {
                let t = Instant::now();
                let l = engine.step(&[SeqChunk { seq_id: 0, start_pos: prompt.len() + i, len: 1 }], &next)?;
                next = picker.pick(l);
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok(times)
        })?;
        self.engine.release(0);
        Ok(SingleProcess {
            threads: self.threads,
            itl_ms_first_tenth: tenth_mean(&times, Tenth::First).unwrap_or(0.0),
            itl_ms_last_tenth: tenth_mean(&times, Tenth::Last).unwrap_or(0.0),
            itl_ms_p50: percentile(&mut times, 0.5),
        })
    }

    /// Runs `rounds` (each a set of (seed, prompt) that start together) with no scheduler or transport: all of
    /// a round's prompts in one step, then `max_tokens - 1` decode steps of the whole round (the first token comes
    /// from the prompt's step, as in serving), picking tokens as `sampling` says.
    pub fn workload(
        &mut self,
        rounds: &[Vec<(u64, Vec<u32>)>],
        max_tokens: usize,
        sampling: &SamplingParams,
    ) -> Result<EngineRate> {
        let vocab = self.vocab;
        // In the backend's context, as a stage's executor runs its batches.
        let (total, decode_s, tokens, decode_tokens) = self.engine.scoped(|engine| -> Result<_> {
            let (mut total, mut decode_s, mut tokens, mut decode_tokens) = (0.0, 0.0, 0usize, 0usize);
            for round in rounds {
                let prompts: Vec<Vec<u32>> =
                    round.iter().map(|(_, p)| p.iter().map(|&id| id % vocab).collect()).collect();
                let mut chunks: Vec<SeqChunk> = (prompts.iter().enumerate())
                    .map(|(seq, p)| SeqChunk { seq_id: seq as u64, start_pos: 0, len: p.len() })
                    .collect();
                let ids = prompts.concat();
                let mut picker =
                    Picker::new(sampling, round.iter().zip(&prompts).map(|((seed, _), p)| (*seed, p.as_slice())));
                let start = Instant::now();
                let logits = engine.step(&chunks, &ids)?;
                let mut next = picker.pick(logits);
                let decode_start = Instant::now();
                for _ in 1..max_tokens {
                    for c in &mut chunks {
                        c.start_pos += c.len;
                        c.len = 1;
                    }
                    let logits = engine.step(&chunks, &next)?;
                    next = picker.pick(logits);
                }
                decode_s += decode_start.elapsed().as_secs_f64();
                total += start.elapsed().as_secs_f64();
                tokens += round.len() * max_tokens;
                decode_tokens += round.len() * max_tokens.saturating_sub(1);
                for seq in 0..round.len() {
                    engine.release(seq as u64);
                }
            }
            Ok((total, decode_s, tokens, decode_tokens))
        })?;
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        Ok(EngineRate { tokens_per_s: rate(tokens, total), decode_tokens_per_s: rate(decode_tokens, decode_s) })
    }
}

/// How the engine picks its sequences' next tokens, as the last stage does: each sequence with its own sampler
/// (seeded) over its prompt and output, drawn together as the last stage draws them
/// ([`strata_engine::sampling::draw_all`]; greedy picks stay on the calling thread).
struct Picker(Vec<SequenceSampler>);

impl Picker {
    /// A picker for sequences given as (seed, prompt), in batch order.
    fn new<'a>(sampling: &SamplingParams, seqs: impl IntoIterator<Item = (u64, &'a [u32])>) -> Self {
        Picker(
            seqs.into_iter()
                .map(|(seed, prompt)| {
                    let params = SamplingParams { seed: Some(seed), ..sampling.clone() };
                    SequenceSampler::new(params, TokenHistory::from_prompt(prompt))
                })
                .collect(),
        )
    }

    /// The next token of each sequence from its row of `logits`.
    fn pick(&mut self, mut logits: Vec<Vec<f32>>) -> Vec<u32> {
        let mut draws: Vec<Draw<'_>> = (self.0.iter_mut().zip(logits.iter_mut()))
            .map(|(sequence, row)| Draw { sequence, logits: row, want_logprob: false })
            .collect();
        let tokens: Vec<u32> = draw_all(&mut draws).into_iter().map(|(token, _)| token).collect();
        drop(draws);
        for (seq, &token) in self.0.iter_mut().zip(&tokens) {
            seq.extend(&[token]);
        }
        tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_engine::sampling::argmax;

    #[test]
    fn the_workload_counts_every_generated_token_and_frees_its_sequences() -> Result<()> {
        let mut engine = EngineBaseline::load(Path::new("random:tiny"), 1, CpuIsa::Auto, 3, 8 + 5)?;
        // Two rounds of 3 prompts: 3 x 5 tokens each, 4 of them decoded per sequence.
        let rounds: Vec<Vec<(u64, Vec<u32>)>> =
            (0..2).map(|r| (0..3).map(|s| (s as u64, vec![1 + r + s; 8])).collect()).collect();
        let sampled = SamplingParams { temperature: 1.0, top_p: 0.9, ..SamplingParams::default() };
        for sampling in [SamplingParams::default(), sampled] {
            let rate = engine.workload(&rounds, 5, &sampling)?;
            assert!(rate.tokens_per_s > 0.0 && rate.decode_tokens_per_s > 0.0, "{rate:?}");
            // The KV cache holds exactly 3 sequences: a second round only fits if the first one's were freed.
            assert_eq!(engine.engine.kv().free_blocks(), engine.engine.kv().num_blocks());
            let latency = engine.decode_latency(&[1, 2, 3], 4, &sampling)?;
            assert!(latency.threads == 1 && latency.itl_ms_p50 > 0.0, "{latency:?}");
        }
        Ok(())
    }

    /// Seeded pickers draw the same tokens however the pool splits them, each sequence its own; greedy takes the
    /// largest logit.
    #[test]
    fn each_sequence_draws_from_its_own_seed() -> Result<()> {
        let logits: Vec<Vec<f32>> =
            (0..6).map(|_| (0..500).map(|i| ((i * 37) % 101) as f32 / 10.0).collect()).collect();
        let prompt = [1u32, 2, 3];
        let sampling = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
        let picker = |seeds: &[u64]| Picker::new(&sampling, seeds.iter().map(|&s| (s, prompt.as_slice())));
        let seeds = [0, 1, 2, 3, 4, 5];
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build()?;
        let a = pool.install(|| picker(&seeds).pick(logits.clone()));
        let b = picker(&seeds).pick(logits.clone());
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "different seeds draw differently here: {a:?}");
        let mut greedy = Picker::new(&SamplingParams::default(), seeds.iter().map(|&s| (s, prompt.as_slice())));
        assert_eq!(greedy.pick(logits.clone()), vec![argmax(&logits[0]); 6]);
        Ok(())
    }
}
