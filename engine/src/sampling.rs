//! Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty, seeded.

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    pub top_p: f32,
    /// Seed for reproducible sampling (None: from the OS).
    pub seed: Option<u64>,
    /// Divide positive logits (multiply negative ones) of already-seen tokens by this (1: off).
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None, repetition_penalty: 1.0 }
    }
}

impl SamplingParams {
    /// Rejects values that make no sense.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::InvalidRequest(format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidRequest(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(Error::InvalidRequest(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            )));
        }
        Ok(())
    }
}

/// A sampler with its own random stream (one per sequence).
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest value (the first on ties).
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler { params, rng }
    }

    /// Picks a token. `history` holds the prompt and generated ids (for the repetition penalty).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = history.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut total = 0f32;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            total += c.1;
        }
        if p.top_p < 1.0 {
            let mut acc = 0f32;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
            total = cand.iter().map(|c| c.1).sum();
        }
        let mut r = self.rng.random::<f32>() * total;
        for &(id, w) in &cand {
            if r < w {
                return id;
            }
            r -= w;
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 2.0, 2.0, -1.0], &[]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let params = SamplingParams { temperature: 1.0, top_k: 2, seed: Some(7), ..Default::default() };
        let logits = vec![1.0, 3.0, 2.9, 0.5, 2.8];
        let run = || {
            let mut s = Sampler::new(params.clone());
            (0..50).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.iter().all(|&t| t == 1 || t == 2), "{a:?}");
        assert!(a.contains(&1) && a.contains(&2));
    }

    #[test]
    fn top_p_keeps_only_the_head() {
        let params = SamplingParams { temperature: 1.0, top_p: 0.5, seed: Some(1), ..Default::default() };
        let mut s = Sampler::new(params);
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [0.0, 10.0, 0.0], &[]), 1);
        }
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..Default::default() });
        assert_eq!(s.sample(&mut [3.0, 2.0], &[0]), 1);
    }

    #[test]
    fn rejects_bad_params() {
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
    }
}
