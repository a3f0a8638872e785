//! What a caller sees of its sequence: each sampled token turned into text (the incremental detokenizer, held back
//! while it could still grow into a stop string), its log-probability, and the decision whether the sequence ends
//! there (EOS unless `ignore_eos`, a stop string, `max_tokens`), as [`SeqEvent`]s. The scheduler knows nothing of
//! text; the actor runs every sampled token through here and tells the scheduler when a sequence ended.

use strata_engine::generate::StopState;
use strata_engine::tokenizer::IncrementalDecoder;
use strata_proto::{ServiceError, pb};

use super::{Finish, ModelInfo, SeqEvent, SeqRequest, StepTiming};

/// Whether a sequence goes on after a token.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Verdict {
    /// Generate the next token.
    Continue,
    /// It ended normally; send [`SeqOutput::done`].
    Finish(Finish),
    /// It failed; send [`SeqOutput::failed`].
    Fail(ServiceError),
}

/// One sequence's output state, alive across recomputes.
#[derive(Debug)]
pub(super) struct SeqOutput {
    decoder: IncrementalDecoder,
    stop: StopState,
    max_tokens: usize,
    ignore_eos: bool,
    /// Tokens generated (EOS excluded unless `ignore_eos`).
    generated: usize,
}

impl SeqOutput {
    /// The output of `req`, nothing generated yet.
    pub(super) fn new(req: &SeqRequest) -> Self {
        SeqOutput {
            decoder: IncrementalDecoder::default(),
            stop: StopState::new(req.stop.clone()),
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            generated: 0,
        }
    }

    /// Tokens generated so far.
    pub(super) fn generated(&self) -> usize {
        self.generated
    }

    /// Takes one sampled token: the event to stream for it (none for an EOS that ends the sequence, or when it
    /// cannot be decoded) and whether the sequence goes on.
    pub(super) fn push(&mut self, model: &ModelInfo, token: &pb::SampledToken) -> (Option<SeqEvent>, Verdict) {
        if !self.ignore_eos && model.eos_token_ids.contains(&token.token_id) {
            return (None, Verdict::Finish(Finish::Eos));
        }
        self.generated += 1;
        let piece = match &model.tokenizer {
            Some(tok) => match self.decoder.push(tok, token.token_id) {
                Ok(p) => p,
                Err(e) => {
                    let error = ServiceError::internal(format!("decoding token {}: {e}", token.token_id));
                    return (None, Verdict::Fail(error));
                }
            },
            None => String::new(),
        };
        let (text, hit) = self.stop.push(&piece);
        let event = SeqEvent::Token { id: token.token_id, logprob: token.logprob, text };
        let verdict = if hit {
            Verdict::Finish(Finish::Stop)
        } else if self.generated >= self.max_tokens {
            Verdict::Finish(Finish::Length)
        } else {
            Verdict::Continue
        };
        (Some(event), verdict)
    }

    /// The final event of a sequence that ended with `finish`, carrying the text still held back.
    pub(super) fn done(&mut self, finish: Finish, timing: StepTiming) -> SeqEvent {
        let stop = std::mem::replace(&mut self.stop, StopState::new(Vec::new()));
        let (text, _) = stop.finish();
        SeqEvent::Done { finish, text, completion_tokens: self.generated, timing }
    }

    /// The final event of a sequence that failed with `error`.
    pub(super) fn failed(&self, error: ServiceError) -> SeqEvent {
        SeqEvent::Failed { error, completion_tokens: self.generated }
    }
}

#[cfg(test)]
mod tests {
    use strata_engine::testing::{GgufOverrides, TinySpec, random_weights, tiny_config, write_gguf};

    use super::*;

    const EOS: u32 = 2;

    fn request(max_tokens: usize, stop: &[&str], ignore_eos: bool) -> SeqRequest {
        SeqRequest {
            prompt_ids: vec![1],
            max_tokens,
            sampling: pb::SamplingParams::default(),
            stop: stop.iter().map(|s| (*s).to_owned()).collect(),
            logprobs: false,
            ignore_eos,
        }
    }

    fn sampled(token_id: u32) -> pb::SampledToken {
        pb::SampledToken { seq_id: 1, token_id, logprob: Some(-0.5) }
    }

    /// Without a tokenizer (token-id prompts) there is no text.
    fn no_tokenizer() -> ModelInfo {
        ModelInfo { name: "m".into(), vocab_size: 300, context: 256, eos_token_ids: vec![EOS], tokenizer: None }
    }

    /// The tiny GGUF's byte-level tokenizer: ids below 256 are single bytes (`b'a'` is "a").
    fn byte_tokenizer(dir: &tempfile::TempDir) -> anyhow::Result<ModelInfo> {
        let spec = TinySpec { config: tiny_config(), dtype: strata_engine::tensor::DType::F32, seed: 1 };
        let path = dir.path().join("tiny.gguf");
        write_gguf(&path, &spec, &random_weights(&spec), &GgufOverrides::default())?;
        let model = ModelInfo::open(&path)?;
        anyhow::ensure!(model.tokenizer.is_some(), "the tiny GGUF has a tokenizer");
        Ok(model)
    }

    #[test]
    fn eos_ends_without_a_token_unless_ignored() {
        let model = no_tokenizer();
        let mut out = SeqOutput::new(&request(8, &[], false));
        let (event, verdict) = out.push(&model, &sampled(7));
        assert_eq!(event, Some(SeqEvent::Token { id: 7, logprob: Some(-0.5), text: String::new() }));
        assert_eq!(verdict, Verdict::Continue);
        assert_eq!(out.push(&model, &sampled(EOS)), (None, Verdict::Finish(Finish::Eos)));
        let timing = StepTiming { steps: 2, compute_micros: 10, pipeline_micros: 20, ..StepTiming::default() };
        let done = out.done(Finish::Eos, timing);
        assert_eq!(done, SeqEvent::Done { finish: Finish::Eos, text: String::new(), completion_tokens: 1, timing });

        let mut out = SeqOutput::new(&request(8, &[], true));
        let (event, verdict) = out.push(&model, &sampled(EOS));
        assert!(matches!(event, Some(SeqEvent::Token { id: EOS, .. })), "{event:?}");
        assert_eq!((verdict, out.generated()), (Verdict::Continue, 1));
    }

    #[test]
    fn max_tokens_ends_on_the_last_token() {
        let model = no_tokenizer();
        let mut out = SeqOutput::new(&request(3, &[], false));
        assert_eq!(out.push(&model, &sampled(5)).1, Verdict::Continue);
        assert_eq!(out.push(&model, &sampled(6)).1, Verdict::Continue);
        let (event, verdict) = out.push(&model, &sampled(7));
        assert!(event.is_some(), "the last token is streamed too");
        assert_eq!(verdict, Verdict::Finish(Finish::Length));
        let failed = out.failed(ServiceError::unavailable("gone"));
        assert_eq!(failed, SeqEvent::Failed { error: ServiceError::unavailable("gone"), completion_tokens: 3 });
    }

    #[test]
    fn text_is_held_back_until_it_cannot_be_a_stop_string() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let model = byte_tokenizer(&dir)?;
        let mut out = SeqOutput::new(&request(10, &["cd"], false));
        let text = |(event, _): (Option<SeqEvent>, Verdict)| match event {
            Some(SeqEvent::Token { text, .. }) => text,
            other => format!("not a token: {other:?}"),
        };
        assert_eq!(text(out.push(&model, &sampled(u32::from(b'a')))), "");
        assert_eq!(text(out.push(&model, &sampled(u32::from(b'b')))), "a", "'a' can no longer start \"cd\"");
        let (event, verdict) = out.push(&model, &sampled(u32::from(b'c')));
        assert_eq!(text((event, Verdict::Continue)), "b", "'c' may start the stop string");
        assert_eq!(verdict, Verdict::Continue);
        let (event, verdict) = out.push(&model, &sampled(u32::from(b'd')));
        assert_eq!(text((event, Verdict::Continue)), "", "the stop string is cut");
        assert_eq!(verdict, Verdict::Finish(Finish::Stop));
        let done = out.done(Finish::Stop, StepTiming::default());
        assert!(matches!(&done, SeqEvent::Done { text, completion_tokens: 4, .. } if text.is_empty()), "{done:?}");

        // Without a stop string, what is held back at the end comes with the final event.
        let mut out = SeqOutput::new(&request(2, &["zz"], false));
        assert_eq!(text(out.push(&model, &sampled(u32::from(b'x')))), "");
        let (event, verdict) = out.push(&model, &sampled(u32::from(b'z')));
        assert_eq!(text((event, Verdict::Continue)), "x");
        assert_eq!(verdict, Verdict::Finish(Finish::Length));
        assert!(matches!(out.done(Finish::Length, StepTiming::default()), SeqEvent::Done { text, .. } if text == "z"));
        Ok(())
    }
}
