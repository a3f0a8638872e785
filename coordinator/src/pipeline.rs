//! The data path: one actor that owns a long-lived `Forward` stream to stage 0 and runs a continuous-batching
//! loop over every active sequence.
//!
//! Each sequence has one next step (its whole prompt as one prefill chunk, then one-token decode steps). Every
//! loop iteration packs the ready steps into micro-batches, splitting them so that up to one batch per stage is
//! in flight; each response feeds the sampled tokens back (EOS, `max_tokens` and stop strings are checked here)
//! and streams them to the callers. Finished, cancelled and failed sequences are released on every stage, but
//! only once no batch of theirs is in flight. A broken stream fails the sequences it carried; the next request
//! reconnects. A new plan epoch fails the active sequences and reconnects to the new stage 0.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use strata_engine::generate::StopState;
use strata_engine::loader::ModelFiles;
use strata_engine::tokenizer::{IncrementalDecoder, Tokenizer};
use strata_proto::{ServiceError, pb};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::membership::Plan;
use crate::stage_client::{self, ForwardStream, TracedStageClient};

/// Commands waiting for the actor.
const COMMAND_BUFFER: usize = 256;
/// Events buffered per sequence before the actor waits for its caller.
const EVENT_BUFFER: usize = 64;
/// How long a `Release` may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the coordinator knows about the served model: enough to tokenize, validate and detect EOS.
#[derive(Clone)]
pub struct ModelInfo {
    /// The model's name (file stem), checked against `GenerateRequest.model`.
    pub name: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context length (prompt + generated tokens).
    pub context: usize,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
    /// The tokenizer, when the model has one (token-id prompts work without).
    pub tokenizer: Option<Arc<Tokenizer>>,
}

impl ModelInfo {
    /// Reads the config and tokenizer of the model at `path` (a Hugging Face directory or a `.gguf` file).
    pub fn open(path: &Path) -> crate::Result<Self> {
        let files = ModelFiles::open(path)?;
        let cfg = files.config();
        let tokenizer = match files.tokenizer() {
            Ok(t) => Some(Arc::new(t)),
            Err(e) => {
                tracing::warn!(error = %e, "model has no usable tokenizer; only token-id prompts are served");
                None
            }
        };
        let name = path
            .file_stem()
            .or_else(|| path.file_name())
            .map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
        Ok(ModelInfo {
            name,
            vocab_size: cfg.vocab_size,
            context: cfg.max_position_embeddings,
            eos_token_ids: cfg.eos_token_ids.clone(),
            tokenizer,
        })
    }
}

/// One validated generation request in token space.
#[derive(Debug, Clone)]
pub struct SeqRequest {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Sampling parameters, passed to the last stage.
    pub sampling: pb::SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Return each token's log-probability.
    pub logprobs: bool,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached.
    Length,
    /// End-of-sequence token.
    Eos,
    /// A stop string matched.
    Stop,
}

impl Finish {
    /// The wire value.
    pub fn to_pb(self) -> pb::FinishReason {
        match self {
            Finish::Length => pb::FinishReason::Length,
            Finish::Eos => pb::FinishReason::Eos,
            Finish::Stop => pb::FinishReason::Stop,
        }
    }
}

/// What a caller receives for its sequence, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// One generated token and the text it releases (possibly empty).
    Token {
        /// The token id.
        id: u32,
        /// Its log-probability, if asked for.
        logprob: Option<f32>,
        /// UTF-8 text delta.
        text: String,
    },
    /// Generation ended normally; `text` is whatever text was still held back.
    Done {
        /// Why it ended.
        finish: Finish,
        /// Remaining text.
        text: String,
        /// Tokens generated.
        completion_tokens: usize,
    },
    /// Generation failed.
    Failed {
        /// What went wrong.
        error: ServiceError,
        /// Tokens generated before the failure.
        completion_tokens: usize,
    },
}

enum Command {
    Submit {
        req: SeqRequest,
        span: tracing::Span,
        reply: oneshot::Sender<Result<mpsc::Receiver<SeqEvent>, ServiceError>>,
    },
    SetPlan(Plan),
}

/// Handle to the pipeline actor. Cheap to share behind an `Arc`; the actor stops when `shutdown` fires or every
/// handle is dropped.
pub struct Pipeline {
    tx: mpsc::Sender<Command>,
    model: Arc<ModelInfo>,
}

impl Pipeline {
    /// Starts the actor serving through `plan`.
    pub fn start(model: ModelInfo, plan: Plan, shutdown: CancellationToken) -> Self {
        let model = Arc::new(model);
        let (tx, rx) = mpsc::channel(COMMAND_BUFFER);
        let actor = Actor {
            model: model.clone(),
            plan,
            client: None,
            stream: None,
            seqs: HashMap::new(),
            batches: HashMap::new(),
            next_seq: 1,
            next_batch: 1,
        };
        tokio::spawn(actor.run(rx, shutdown).instrument(tracing::info_span!("pipeline")));
        Pipeline { tx, model }
    }

    /// The served model.
    pub fn model(&self) -> &ModelInfo {
        &self.model
    }

    /// Switches to `plan` if its epoch differs: active sequences fail with `UNAVAILABLE` and the next request
    /// connects to the new stage 0.
    pub async fn set_plan(&self, plan: Plan) -> Result<(), ServiceError> {
        self.tx.send(Command::SetPlan(plan)).await.map_err(|_| stopped())
    }

    /// Starts generating for `req`; events arrive on the returned receiver. Dropping it cancels the sequence.
    pub async fn submit(&self, req: SeqRequest) -> Result<mpsc::Receiver<SeqEvent>, ServiceError> {
        let (reply, rx) = oneshot::channel();
        let span = tracing::Span::current();
        self.tx.send(Command::Submit { req, span, reply }).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}

fn stopped() -> ServiceError {
    ServiceError::unavailable("the pipeline is shut down")
}

struct Seq {
    pos: u32,
    input: Vec<u32>,
    generated: usize,
    max_tokens: usize,
    sampling: pb::SamplingParams,
    logprobs: bool,
    in_flight: bool,
    done: bool,
    stop: StopState,
    decoder: IncrementalDecoder,
    tx: mpsc::Sender<SeqEvent>,
    span: tracing::Span,
}

impl Seq {
    fn gone(&self) -> bool {
        self.done || self.tx.is_closed()
    }

    fn fail(&mut self, error: ServiceError) {
        if !self.done {
            self.done = true;
            let _ = self.tx.try_send(SeqEvent::Failed { error, completion_tokens: self.generated });
        }
    }
}

struct Actor {
    model: Arc<ModelInfo>,
    plan: Plan,
    client: Option<TracedStageClient>,
    stream: Option<ForwardStream>,
    seqs: HashMap<u64, Seq>,
    /// Batch id -> the sequences it carries.
    batches: HashMap<u64, Vec<u64>>,
    next_seq: u64,
    next_batch: u64,
}

impl Actor {
    async fn run(mut self, mut commands: mpsc::Receiver<Command>, shutdown: CancellationToken) {
        loop {
            self.reap();
            self.schedule().await;
            let waiting = !self.batches.is_empty();
            tokio::select! {
                () = shutdown.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    None => break,
                    Some(Command::Submit { req, span, reply }) => {
                        let result = self.admit(req, span).await;
                        let _ = reply.send(result);
                    }
                    Some(Command::SetPlan(plan)) => self.set_plan(plan),
                },
                resp = next_response(&mut self.stream), if waiting => self.on_response(resp),
            }
        }
        self.fail_all(&ServiceError::unavailable("the coordinator is shutting down"));
        self.reap();
    }

    fn set_plan(&mut self, plan: Plan) {
        if plan.epoch == self.plan.epoch && plan.stages == self.plan.stages {
            return;
        }
        tracing::info!(epoch = %plan.epoch, stages = plan.stages.len(), "switching to a new plan");
        self.fail_all(&ServiceError::unavailable(format!("the plan changed to {}", plan.epoch)));
        self.reap();
        self.plan = plan;
        self.client = None;
        self.stream = None;
    }

    async fn ensure_connected(&mut self) -> Result<(), ServiceError> {
        if self.stream.is_some() {
            return Ok(());
        }
        let Some(stage0) = self.plan.stages.first() else {
            return Err(ServiceError::unavailable("the plan has no stages"));
        };
        let mut client = stage_client::connect(&stage0.address).await?;
        let stream = stage_client::open_forward(&mut client).await?;
        tracing::info!(address = %stage0.address, epoch = %self.plan.epoch, "Forward stream to stage 0 open");
        self.client = Some(client);
        self.stream = Some(stream);
        Ok(())
    }

    async fn admit(&mut self, req: SeqRequest, span: tracing::Span) -> Result<mpsc::Receiver<SeqEvent>, ServiceError> {
        self.ensure_connected().instrument(span.clone()).await?;
        let id = self.next_seq;
        self.next_seq += 1;
        let (tx, rx) = mpsc::channel(EVENT_BUFFER.max(req.max_tokens + 2).min(4096));
        span.in_scope(|| tracing::debug!(seq = id, prompt = req.prompt_ids.len(), "sequence admitted"));
        self.seqs.insert(
            id,
            Seq {
                pos: 0,
                input: req.prompt_ids,
                generated: 0,
                max_tokens: req.max_tokens,
                sampling: req.sampling,
                logprobs: req.logprobs,
                in_flight: false,
                done: false,
                stop: StopState::new(req.stop),
                decoder: IncrementalDecoder::default(),
                tx,
                span,
            },
        );
        Ok(rx)
    }

    /// Packs the ready steps into at most one micro-batch per free pipeline slot and sends them.
    async fn schedule(&mut self) {
        let slots = self.plan.stages.len().max(1).saturating_sub(self.batches.len());
        if slots == 0 || self.stream.is_none() {
            return;
        }
        let mut ready: Vec<u64> =
            self.seqs.iter().filter(|(_, s)| !s.in_flight && !s.gone()).map(|(id, _)| *id).collect();
        if ready.is_empty() {
            return;
        }
        ready.sort_unstable();
        let per_batch = ready.len().div_ceil(slots.min(ready.len()));
        for group in ready.chunks(per_batch) {
            let batch = self.build_batch(group);
            let batch_id = batch.batch_id;
            let sent = match &self.stream {
                Some(s) => s.tx.send(batch).await.is_ok(),
                None => false,
            };
            if !sent {
                self.stream_broken(ServiceError::unavailable("the Forward stream to stage 0 closed"));
                return;
            }
            tracing::trace!(batch_id, seqs = group.len(), "batch sent");
            self.batches.insert(batch_id, group.to_vec());
        }
    }

    fn build_batch(&mut self, group: &[u64]) -> pb::ForwardRequest {
        let batch_id = self.next_batch;
        self.next_batch += 1;
        let mut chunks = Vec::with_capacity(group.len());
        let mut token_ids = Vec::new();
        for id in group {
            let Some(seq) = self.seqs.get_mut(id) else { continue };
            let len = u32::try_from(seq.input.len()).unwrap_or(u32::MAX);
            chunks.push(pb::SeqChunk {
                seq_id: *id,
                start_pos: seq.pos,
                len,
                sampling: Some(seq.sampling),
                want_logprobs: seq.logprobs,
                skip_sampling: false,
            });
            token_ids.append(&mut seq.input);
            seq.pos += len;
            seq.in_flight = true;
        }
        pb::ForwardRequest { plan_epoch: self.plan.epoch.0, batch_id, chunks, token_ids, hidden: None }
    }

    fn on_response(&mut self, resp: Option<Result<pb::ForwardResponse, tonic::Status>>) {
        let resp = match resp {
            Some(Ok(r)) => r,
            Some(Err(status)) => return self.stream_broken(ServiceError::from(status)),
            None => return self.stream_broken(ServiceError::unavailable("stage 0 closed the Forward stream")),
        };
        let Some(ids) = self.batches.remove(&resp.batch_id) else {
            tracing::warn!(batch_id = resp.batch_id, "response for an unknown batch");
            return;
        };
        for id in &ids {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.in_flight = false;
            }
        }
        if let Some(err) = resp.error {
            let err = ServiceError::from(err);
            tracing::warn!(batch_id = resp.batch_id, error = %err, "batch failed");
            for id in &ids {
                if let Some(seq) = self.seqs.get_mut(id) {
                    seq.fail(err.clone());
                }
            }
            return;
        }
        for t in resp.tokens {
            self.on_token(t);
        }
    }

    fn on_token(&mut self, t: pb::SampledToken) {
        let tokenizer = self.model.tokenizer.clone();
        let eos = self.model.eos_token_ids.contains(&t.token_id);
        let Some(seq) = self.seqs.get_mut(&t.seq_id) else { return };
        if seq.gone() {
            seq.done = true;
            return;
        }
        if eos {
            return finish(seq, Finish::Eos);
        }
        seq.generated += 1;
        let piece = match &tokenizer {
            Some(tok) => match seq.decoder.push(tok, t.token_id) {
                Ok(p) => p,
                Err(e) => return seq.fail(ServiceError::internal(format!("decoding token {}: {e}", t.token_id))),
            },
            None => String::new(),
        };
        let (text, hit) = seq.stop.push(&piece);
        let event = SeqEvent::Token { id: t.token_id, logprob: t.logprob, text };
        if seq.tx.try_send(event).is_err() {
            // Caller gone (or hopelessly behind): cancel.
            seq.done = true;
            return;
        }
        if hit {
            finish(seq, Finish::Stop);
        } else if seq.generated >= seq.max_tokens {
            finish(seq, Finish::Length);
        } else {
            seq.input = vec![t.token_id];
        }
    }

    fn stream_broken(&mut self, err: ServiceError) {
        tracing::warn!(error = %err, in_flight = self.batches.len(), "Forward stream to stage 0 broke");
        self.stream = None;
        self.batches.clear();
        self.fail_all(&err);
    }

    fn fail_all(&mut self, err: &ServiceError) {
        for seq in self.seqs.values_mut() {
            seq.in_flight = false;
            seq.fail(err.clone());
        }
        self.batches.clear();
    }

    /// Forgets finished and cancelled sequences with no batch in flight and releases them on every stage.
    fn reap(&mut self) {
        let gone: Vec<u64> = self.seqs.iter().filter(|(_, s)| s.gone() && !s.in_flight).map(|(id, _)| *id).collect();
        if gone.is_empty() {
            return;
        }
        for id in &gone {
            if let Some(seq) = self.seqs.remove(id) {
                seq.span.in_scope(|| tracing::debug!(seq = id, generated = seq.generated, "sequence released"));
            }
        }
        let Some(mut client) = self.client.clone() else { return };
        tokio::spawn(async move {
            let req = pb::ReleaseRequest { seq_ids: gone, propagate: true };
            match tokio::time::timeout(RELEASE_TIMEOUT, client.release(req)).await {
                Ok(Ok(_)) => {}
                Ok(Err(status)) => tracing::warn!(error = %status, "release failed"),
                Err(_) => tracing::warn!("release timed out"),
            }
        });
    }
}

fn finish(seq: &mut Seq, finish: Finish) {
    let stop = std::mem::replace(&mut seq.stop, StopState::new(Vec::new()));
    let (text, _) = stop.finish();
    seq.done = true;
    let _ = seq.tx.try_send(SeqEvent::Done { finish, text, completion_tokens: seq.generated });
}

async fn next_response(stream: &mut Option<ForwardStream>) -> Option<Result<pb::ForwardResponse, tonic::Status>> {
    match stream {
        Some(s) => s.rx.next().await,
        None => std::future::pending().await,
    }
}
