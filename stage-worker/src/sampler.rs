//! Per-sequence sampling state on the last stage: a seeded sampler and the token history that the
//! penalties read, both built from the token ids the batches carry.

use std::collections::HashMap;

use strata_engine::sampling::{Sampler, SamplingParams, TokenHistory};
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

struct SeqState {
    sampler: Sampler,
    history: TokenHistory,
}

/// The sampling state of every sequence this stage has seen and not released.
#[derive(Default)]
pub struct SeqSamplers {
    seqs: HashMap<u64, SeqState>,
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
            SeqState { sampler: Sampler::new(params.clone()), history }
        });
        state.history.extend(tokens);
    }

    /// Samples the next token of `seq_id` from its logits; with `want_logprob`, also the chosen token's
    /// log-probability under the model (log-softmax of the raw logits).
    pub fn sample(
        &mut self,
        seq_id: u64,
        logits: &mut [f32],
        want_logprob: bool,
    ) -> Result<(u32, Option<f32>), ServiceError> {
        let state = self
            .seqs
            .get_mut(&seq_id)
            .ok_or_else(|| ServiceError::internal(format!("sequence {seq_id} has no sampling state")))?;
        let lse = want_logprob.then(|| log_sum_exp(logits));
        let raw = want_logprob.then(|| logits.to_vec());
        let token = state.sampler.sample(logits, &state.history);
        let logprob = match (lse, raw) {
            (Some(lse), Some(raw)) => raw.get(token as usize).map(|l| l - lse),
            _ => None,
        };
        Ok((token, logprob))
    }

    /// Forgets a sequence; unknown ids are ignored.
    pub fn release(&mut self, seq_id: u64) {
        self.seqs.remove(&seq_id);
    }
}

fn log_sum_exp(xs: &[f32]) -> f32 {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    max + xs.iter().map(|x| (x - max).exp()).sum::<f32>().ln()
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
