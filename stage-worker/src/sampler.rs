//! Per-sequence sampling state on the last stage: a seeded sampler and the token history that the
//! penalties read, both built from the token ids the batches carry.

use std::collections::HashMap;

use strata_engine::sampling::{self, SamplingParams, SequenceSampler, TokenHistory};
use strata_proto::ServiceError;
use strata_proto::pb;

/// Converts wire sampling params (zeros mean "off") into the engine's, validated.
pub fn engine_params(p: Option<&pb::SamplingParams>) -> Result<SamplingParams, ServiceError> {
    let Some(p) = p else { return Ok(SamplingParams::default()) };
    let params = SamplingParams::with_zeros_off(p.temperature, p.top_k, p.top_p, p.seed, p.repetition_penalty)
        .with_penalties(p.presence_penalty, p.frequency_penalty)
        .with_min_p(p.min_p);
    params.validate().map_err(|e| ServiceError::invalid_argument(e.to_string()))?;
    Ok(params)
}

/// One sequence's next token to sample: its id, its row of logits (changed by the penalties and temperature), and
/// whether the token's log-probability is wanted.
pub struct Draw<'a> {
    pub seq_id: u64,
    pub logits: &'a mut [f32],
    pub want_logprob: bool,
}

/// The sampling state of every sequence this stage has seen and not released.
#[derive(Default)]
pub struct SeqSamplers {
    seqs: HashMap<u64, SequenceSampler>,
}

impl SeqSamplers {
    /// Records a chunk's `tokens`. A chunk at position 0, or one starting on cached blocks (whose tokens it
    /// carries), starts the sequence over with a fresh sampler; the chunk's `prompt_len` tells its prompt from its
    /// output.
    pub fn observe(&mut self, chunk: &pb::SeqChunk, tokens: &[u32], params: &SamplingParams) {
        let cached = &chunk.cached_token_ids;
        if chunk.start_pos == 0 || !cached.is_empty() {
            self.seqs.remove(&chunk.seq_id);
        }
        let state = self.seqs.entry(chunk.seq_id).or_insert_with(|| {
            let mut history = TokenHistory::new(chunk.prompt_len as usize);
            history.extend(cached);
            SequenceSampler::new(params.clone(), history)
        });
        state.extend(tokens);
    }

    /// Samples the next token of `seq_id` from its logits; with `want_logprob`, also the chosen token's
    /// log-probability under the model (log-softmax of the raw logits).
    #[cfg(test)]
    pub fn sample(
        &mut self,
        seq_id: u64,
        logits: &mut [f32],
        want_logprob: bool,
    ) -> Result<(u32, Option<f32>), ServiceError> {
        let mut draws = [Draw { seq_id, logits, want_logprob }];
        Ok(self.sample_all(&mut draws)?[0])
    }

    /// Samples the next token of every draw's sequence (distinct sequences), as [`SeqSamplers::sample`] would one
    /// by one, several in parallel where that pays ([`sampling::draw_all`]).
    pub fn sample_all(&mut self, draws: &mut [Draw<'_>]) -> Result<Vec<(u32, Option<f32>)>, ServiceError> {
        let mut states = Vec::with_capacity(draws.len());
        for d in draws.iter() {
            match self.seqs.remove(&d.seq_id) {
                Some(state) => states.push(state),
                None => {
                    // Put back what was taken, so a bad batch changes nothing.
                    for (d, state) in draws.iter().zip(states) {
                        self.seqs.insert(d.seq_id, state);
                    }
                    return Err(ServiceError::internal(format!("sequence {} has no sampling state", d.seq_id)));
                }
            }
        }
        let mut batch: Vec<sampling::Draw<'_>> = states
            .iter_mut()
            .zip(draws.iter_mut())
            .map(|(sequence, d)| sampling::Draw { sequence, logits: &mut *d.logits, want_logprob: d.want_logprob })
            .collect();
        let picks = sampling::draw_all(&mut batch);
        drop(batch);
        for (d, state) in draws.iter().zip(states) {
            self.seqs.insert(d.seq_id, state);
        }
        Ok(picks)
    }

    /// Forgets a sequence; unknown ids are ignored.
    pub fn release(&mut self, seq_id: u64) {
        self.seqs.remove(&seq_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(seq_id: u64, start_pos: u32, cached: &[u32], prompt_len: u32) -> pb::SeqChunk {
        pb::SeqChunk { seq_id, start_pos, cached_token_ids: cached.to_vec(), prompt_len, ..Default::default() }
    }

    #[test]
    fn zeros_mean_off() -> Result<(), ServiceError> {
        let p = engine_params(Some(&pb::SamplingParams::default()))?;
        assert_eq!(p, SamplingParams::default());
        let bad = pb::SamplingParams { temperature: -1.0, ..Default::default() };
        assert!(engine_params(Some(&bad)).is_err());
        Ok(())
    }

    #[test]
    fn greedy_with_logprob_matches_log_softmax() -> Result<(), ServiceError> {
        let mut s = SeqSamplers::default();
        s.observe(&chunk(1, 0, &[], 1), &[0], &SamplingParams::default());
        let (tok, lp) = s.sample(1, &mut [1.0, 2.0, 0.5], true)?;
        assert_eq!(tok, 1);
        let expected = 2.0 - (1f32.exp() + 2f32.exp() + 0.5f32.exp()).ln();
        assert!((lp.unwrap_or(f32::NAN) - expected).abs() < 1e-6);
        assert!(s.sample(2, &mut [0.0], false).is_err());
        s.release(1);
        assert!(s.sample(1, &mut [0.0], false).is_err(), "a released sequence has no state");
        Ok(())
    }

    /// A batch's draws on a pool of threads pick what the same samplers pick one by one, log-probabilities
    /// included; a draw for an unknown sequence fails the batch and leaves every other sequence's state as it was.
    #[test]
    fn a_batch_samples_in_parallel_as_one_by_one() -> Result<(), Box<dyn std::error::Error>> {
        let vocab = 4000;
        let logits: Vec<Vec<f32>> =
            (0..12).map(|s| (0..vocab).map(|i| ((i * 7919 + s * 104_729) % 1000) as f32 / 97.0).collect()).collect();
        let params = |s: usize| {
            SamplingParams {
                temperature: [0.0, 0.7, 1.0, 1.3][s % 4],
                top_p: [1.0, 0.9][s % 2],
                seed: Some(s as u64),
                ..SamplingParams::default()
            }
            .with_penalties(0.5, 0.1)
        };
        let fill = |samplers: &mut SeqSamplers| {
            for s in 0..12 {
                samplers.observe(&chunk(s as u64, 0, &[], 2), &[1, 2, 3], &params(s));
            }
        };
        let (mut one, mut all) = (SeqSamplers::default(), SeqSamplers::default());
        fill(&mut one);
        fill(&mut all);
        let mut rows = logits.clone();
        let want: Vec<_> = rows
            .iter_mut()
            .enumerate()
            .map(|(s, row)| one.sample(s as u64, row, s % 3 == 0))
            .collect::<Result<_, _>>()?;
        let mut rows = logits.clone();
        let mut draws: Vec<Draw<'_>> = rows
            .iter_mut()
            .enumerate()
            .map(|(s, row)| Draw { seq_id: s as u64, logits: row, want_logprob: s % 3 == 0 })
            .collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build()?;
        let got = pool.install(|| all.sample_all(&mut draws))?;
        assert_eq!(got, want);
        assert!(got.iter().any(|(t, _)| *t != got[0].0), "the draws differ, so the test can tell them apart");

        let mut row = logits[0].clone();
        let mut bad = vec![Draw { seq_id: 1, logits: &mut row, want_logprob: false }];
        let mut other = logits[1].clone();
        bad.push(Draw { seq_id: 99, logits: &mut other, want_logprob: false });
        assert!(all.sample_all(&mut bad).is_err());
        assert!(all.sample(1, &mut logits[1].clone(), false).is_ok(), "sequence 1 kept its state");
        Ok(())
    }

    #[test]
    fn history_drives_the_repetition_penalty_and_restarts_at_position_zero() -> Result<(), ServiceError> {
        let params = SamplingParams { repetition_penalty: 4.0, ..Default::default() };
        let mut s = SeqSamplers::default();
        s.observe(&chunk(7, 0, &[], 2), &[0, 5], &params);
        assert_eq!(s.sample(7, &mut [3.0, 2.0], false)?.0, 1, "token 0 was seen and is penalized");
        s.observe(&chunk(7, 0, &[], 1), &[1], &params);
        assert_eq!(s.sample(7, &mut [3.0, 2.0], false)?.0, 0, "a new sequence forgets the old history");
        s.observe(&chunk(8, 4, &[5, 0, 5, 5], 5), &[5], &params);
        assert_eq!(s.sample(8, &mut [3.0, 2.0], false)?.0, 1, "the cached prompt tokens are history too");
        Ok(())
    }

    #[test]
    fn presence_penalty_counts_output_past_prompt_len_also_when_recomputed() -> Result<(), ServiceError> {
        let params = SamplingParams::default().with_penalties(1.5, 0.0);
        let mut s = SeqSamplers::default();
        // Prompt [0, 1]; then the output 0 is fed back in decode.
        s.observe(&chunk(3, 0, &[], 2), &[0, 1], &params);
        assert_eq!(s.sample(3, &mut [3.0, 2.0], false)?.0, 0, "prompt tokens are not penalized");
        s.observe(&chunk(3, 2, &[], 2), &[0], &params);
        assert_eq!(s.sample(3, &mut [3.0, 2.0], false)?.0, 1, "the output's 0 is");
        // Recomputed after a preemption: prompt and output arrive as one chunk, under a new id, half of it cached.
        s.observe(&chunk(4, 2, &[0, 1], 2), &[0], &params);
        assert_eq!(s.sample(4, &mut [3.0, 2.0], false)?.0, 1, "prompt_len still tells the output apart");
        Ok(())
    }
}
