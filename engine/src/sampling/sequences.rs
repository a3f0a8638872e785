//! Sampling a batch: each sequence keeps its own seeded sampler and the tokens its penalties read, and a batch's
//! sequences draw their next tokens together, in parallel where that pays. The last stage of a pipeline and the
//! engine baselines that serving is compared with both draw through here, so they pick alike.

use rayon::prelude::*;

use super::{Sampler, SamplingParams, TokenHistory, log_softmax_at};

/// One sequence's sampling state: its sampler and the tokens (prompt and output) the penalties read, whose count is
/// the position a seeded draw depends on.
pub struct SequenceSampler {
    sampler: Sampler,
    history: TokenHistory,
}

impl SequenceSampler {
    /// A sequence that samples with `params` after the tokens `history` holds.
    pub fn new(params: SamplingParams, history: TokenHistory) -> Self {
        SequenceSampler { sampler: Sampler::new(params), history }
    }

    /// Records tokens the sequence went on with (the ones it drew, as its next batch carries them back).
    pub fn extend(&mut self, ids: &[u32]) {
        self.history.extend(ids);
    }

    /// The next token from `logits` (changed in place by the penalties and temperature) and, with `want_logprob`,
    /// its log-probability under the raw logits (their log-softmax).
    pub fn draw(&mut self, logits: &mut [f32], want_logprob: bool) -> (u32, Option<f32>) {
        let raw = want_logprob.then(|| logits.to_vec());
        let token = self.sampler.sample(logits, &self.history);
        (token, raw.and_then(|raw| log_softmax_at(raw, token)))
    }

    /// Whether a draw costs more than a greedy pick: a temperature draw, or a wanted log-probability (each a few
    /// passes over the vocabulary, ~50-180 µs over SmolLM2's 49k tokens, against ~6 µs for an argmax).
    fn is_heavy(&self, want_logprob: bool) -> bool {
        want_logprob || !self.sampler.is_greedy()
    }
}

/// One sequence's next token to draw.
pub struct Draw<'a> {
    /// The sequence's sampling state.
    pub sequence: &'a mut SequenceSampler,
    /// Its row of logits, changed in place by the penalties and temperature.
    pub logits: &'a mut [f32],
    /// Whether the drawn token's log-probability is wanted.
    pub want_logprob: bool,
}

/// Draws every sequence's next token, in order, as [`SequenceSampler::draw`] one by one would. When two or more
/// draws are heavy (a temperature, or a log-probability) they run in parallel on the current rayon pool: a batch
/// of 64 in turn would hold a step for ~10 ms while the pool's other threads wait. Otherwise they stay on this
/// thread (a greedy pick costs less than waking another).
pub fn draw_all(draws: &mut [Draw<'_>]) -> Vec<(u32, Option<f32>)> {
    let draw = |d: &mut Draw<'_>| d.sequence.draw(d.logits, d.want_logprob);
    let heavy = draws.iter().filter(|d| d.sequence.is_heavy(d.want_logprob)).count();
    if heavy >= 2 { draws.par_iter_mut().map(draw).collect() } else { draws.iter_mut().map(draw).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parallel draws pick what the same sequences pick one at a time, with the same log-probabilities.
    #[test]
    fn a_batch_draws_what_its_sequences_draw_one_by_one() {
        let vocab = 3000;
        let rows: Vec<Vec<f32>> =
            (0..6u32).map(|s| (0..vocab).map(|i| ((i * 7919 + s * 104_729) % 997) as f32 / 97.0).collect()).collect();
        let params = |s: u64| match s % 3 {
            0 => SamplingParams::default(),
            1 => SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(s), ..Default::default() },
            _ => SamplingParams { temperature: 1.2, top_k: 50, seed: Some(s), ..Default::default() },
        };
        let fresh = || -> Vec<SequenceSampler> {
            (0..6).map(|s| SequenceSampler::new(params(s), TokenHistory::from_prompt(&[1, 2, 3]))).collect()
        };
        let (mut one_by_one, mut batch) = (fresh(), fresh());
        let want: Vec<_> = one_by_one
            .iter_mut()
            .zip(rows.clone())
            .enumerate()
            .map(|(s, (seq, mut row))| seq.draw(&mut row, s % 2 == 0))
            .collect();
        let mut rows = rows;
        let mut draws: Vec<Draw<'_>> = batch
            .iter_mut()
            .zip(rows.iter_mut())
            .enumerate()
            .map(|(s, (sequence, row))| Draw { sequence, logits: row, want_logprob: s % 2 == 0 })
            .collect();
        let got = draw_all(&mut draws);
        assert_eq!(got.len(), 6);
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.0, w.0, "sequence {s}");
            assert_eq!(g.1.map(f32::to_bits), w.1.map(f32::to_bits), "sequence {s}");
            assert_eq!(g.1.is_some(), s % 2 == 0, "sequence {s}");
        }
    }
}
