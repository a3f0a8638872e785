//! The data path: one actor that owns a long-lived `Forward` stream to stage 0 and schedules every sequence.
//!
//! Requests wait in a bounded queue (full: `RESOURCE_EXHAUSTED`) and join the running set when the KV cache of
//! the tightest stage has room for them (`kv_budget`). Every loop iteration packs the running sequences' next
//! steps (prompt chunks of at most `max_batch_tokens`, then one-token decode steps) into micro-batches, so that
//! up to 2 per stage (stages + 1 = 2 for a single stage) are in flight, each an equal share of the running set, and
//! no stage waits while work exists; each response feeds the sampled tokens back (EOS, `max_tokens` and stop strings
//! are checked in `output`) and streams them to the callers. When the KV cache is full the youngest running sequence is
//! preempted: released on every stage and later recomputed from its prompt and the tokens it already produced.
//! Finished, cancelled and failed sequences are released on every stage once no batch of theirs is in flight.
//!
//! Faults lose nothing: a stage that fails a batch for want of a stage, a broken stream or a batch unanswered for
//! the batch timeout requeues every active sequence the same way, and the actor probes the stages again (in the
//! background; stage I/O never blocks the loop), reports the ones that do not answer as [`Suspect`]s so the
//! control loop plans around them, and recomputes through the next pipeline it can connect; work fails (with
//! `UNAVAILABLE`) only when none is found within the recovery timeout. A new plan epoch abandons the batches in
//! flight and requeues every active sequence likewise (its callers see no error), then connects to the new stages.
//!
//! Who owns what: `scheduler` is the policy and its bookkeeping, synchronous and without I/O (queue, running set,
//! KV budget, batches in flight → effects); `output` turns a sequence's sampled tokens into events (detokenizing,
//! stop strings, EOS and `max_tokens`); `actor` is the task around them (the `select!` loop, the stream and
//! client, the callers' channels, metrics); `link` connects to a plan's stages.
//!
//! The actor runs on a thread of its own with a current-thread runtime, which also carries everything it spawns:
//! its connections to the stages, their `Forward` and `Answers` streams, and releases. So an answer is read, the
//! next micro-batch scheduled and written to stage 0 on one thread, with no thread wake-up in a step's round trip
//! (each costs 20-50 µs on the development VMs); the stage workers do the same on their side. Callers (the APIs,
//! on the process's runtime) talk to it through channels, which work across runtimes.

mod actor;
mod kv_budget;
mod link;
mod output;
mod prefix_cache;
mod scheduler;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_engine::loader::ModelFiles;
use strata_engine::tokenizer::Tokenizer;
use strata_proto::{Keepalive, ServiceError, Tls, pb};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::metrics::Metrics;
pub use link::Suspect;
use strata_membership::Plan;

/// Commands waiting for the actor.
const COMMAND_BUFFER: usize = 256;

/// Scheduler limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerLimits {
    /// Requests queued or running at once; more are refused with `RESOURCE_EXHAUSTED` (HTTP 429).
    pub max_concurrent_requests: usize,
    /// Tokens per micro-batch: longer prompts are prefilled in chunks of at most this many tokens.
    pub max_batch_tokens: usize,
    /// Whether to keep the KV blocks of prompts on the stages and reuse them for prompts that start with the same
    /// tokens.
    pub prefix_caching: PrefixCaching,
    /// Micro-batches kept in flight per stage (at least one in all), the running set split evenly over them.
    /// Fewer make bigger batches (the CPU kernels unpack each weight block once for up to 8 tokens, so a batch of 2
    /// costs nearly what one of 8 does) and a steadier inter-token latency; more lower the time to first token
    /// under bursts (a new request goes out in the next free slot, and with more slots one frees sooner) and
    /// overlap more wire time with compute. Measured 2026-12 against 2 per stage: one stage at 16 streams made 4%
    /// more tokens/s with 1, its ITL p99 a quarter, its TTFT p50 1.5 s instead of 1.1 s; two stages made 6% more;
    /// at 4 streams, 2 slots through one stage split the streams into two batches of 2 and served 0.68x of the
    /// engine's rate. An earlier run (2026-11-30, 2 stages, 16 streams) had 113 tok/s with 4 per stage, 140-153
    /// with 2 and 137 with 1.
    pub micro_batches_per_stage: usize,
    /// The most micro-batches in flight through the whole pipeline, 0 for no cap (`micro_batches_per_stage` times
    /// the stages). Stages that share a host's cores cannot all compute at once: three CPU stages on two cores
    /// time-slice three small micro-batches, which served 0.77-0.78x of one stage at 16 streams (2026-12-05),
    /// while one batch in flight, each stage with all the cores, served 0.95-0.96x. `strata local` sets it from
    /// its cores and threads.
    pub max_batches_in_flight: usize,
}

/// The most micro-batches per stage the coordinator accepts (`--micro-batches-per-stage`).
pub const MAX_MICRO_BATCHES_PER_STAGE: usize = 16;

impl Default for SchedulerLimits {
    fn default() -> Self {
        Self {
            max_concurrent_requests: 128,
            max_batch_tokens: 512,
            prefix_caching: PrefixCaching::Auto,
            micro_batches_per_stage: 1,
            max_batches_in_flight: 0,
        }
    }
}

/// The prefix-caching setting (`--enable-prefix-caching`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PrefixCaching {
    /// On where it changes no token: every stage's results are the same bits however tokens are batched (the
    /// CPU kernels, but for f32 weights). Elsewhere (GPUs, f32 weights) a reused prefix may differ in the last
    /// bits from a recomputed one.
    #[default]
    Auto,
    /// Always on.
    #[value(alias = "true")]
    On,
    /// Off.
    #[value(alias = "false")]
    Off,
}

impl PrefixCaching {
    /// Whether to cache with stages that are (or are not) batch-invariant.
    pub(crate) fn enabled(self, batch_invariant: bool) -> bool {
        match self {
            PrefixCaching::Auto => batch_invariant,
            PrefixCaching::On => true,
            PrefixCaching::Off => false,
        }
    }
}

/// How long the pipeline waits for the stages before it calls them failed, and for a pipeline before it fails work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// A micro-batch unanswered this long means a stage (or a link) hangs: every sequence is requeued.
    pub batch: Duration,
    /// Requests wait this long for a working pipeline (a new plan after a crash, a leader after a failover)
    /// before they fail with `UNAVAILABLE`.
    pub recovery: Duration,
    /// How long one stage may take to answer `Status` when the pipeline connects; slower stages are suspects.
    pub probe: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { batch: Duration::from_secs(30), recovery: Duration::from_secs(120), probe: Duration::from_secs(2) }
    }
}

/// How a [`Pipeline`] runs: scheduler limits, TLS and keep-alive towards the stages, timeouts, and where to report
/// stages it could not reach.
#[derive(Debug, Clone, Default)]
pub struct PipelineOptions {
    /// Scheduler limits.
    pub limits: SchedulerLimits,
    /// TLS towards the stages; `None`: plaintext.
    pub tls: Option<Tls>,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// HTTP/2 keep-alive towards the stages.
    pub keepalive: Keepalive,
    /// Where stages that failed are reported (the control loop plans around them); `None`: nowhere.
    pub suspects: Option<mpsc::Sender<Suspect>>,
}

/// Where the time of a sequence's steps went, summed over the micro-batches that carried it, and how much of its
/// prompt the prefix cache held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTiming {
    /// Micro-batches that carried the sequence (prefill chunks and decode steps).
    pub steps: u32,
    /// Compute time of those batches summed over every stage, in microseconds.
    pub compute_micros: u64,
    /// Send-to-response time of those batches at the coordinator, in microseconds.
    pub pipeline_micros: u64,
    /// Of that, time the batches waited on the stages before their compute started, summed over stages.
    pub queue_micros: u64,
    /// Of that, time from the end of a stage's compute to the hand-off of its output, summed over stages.
    pub handoff_micros: u64,
    /// Prompt tokens found in the prefix cache when the sequence started, so not computed (OpenAI's
    /// `cached_tokens`); a recompute after preemption, which finds its own blocks, does not count.
    pub cached_tokens: u32,
}

/// What the coordinator knows about the served model: enough to tokenize, validate and detect EOS.
#[derive(Clone)]
pub struct ModelInfo {
    /// The model's name ([`model_name`]), checked against the requests' `model`.
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

/// The name a model is served under: its file or directory name, less a `.gguf` extension. Not `file_stem`, which
/// would serve a directory `Llama-3.1-8B-Instruct` as `Llama-3`.
pub fn model_name(path: &Path) -> String {
    let name = path.file_name().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
    match name.strip_suffix(".gguf") {
        Some(stem) if !stem.is_empty() => stem.to_owned(),
        _ => name,
    }
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
        Ok(ModelInfo {
            name: model_name(path),
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
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: bool,
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
    /// A short name (`length`, `eos`, `stop`), as the metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Eos => "eos",
            Finish::Stop => "stop",
        }
    }

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
        /// Where the time went.
        timing: StepTiming,
    },
    /// Generation failed.
    Failed {
        /// What went wrong.
        error: ServiceError,
        /// Tokens generated before the failure.
        completion_tokens: usize,
    },
}

pub(crate) enum Command {
    Submit {
        req: SeqRequest,
        span: tracing::Span,
        reply: oneshot::Sender<Result<mpsc::Receiver<SeqEvent>, ServiceError>>,
    },
    SetPlan(Plan),
    /// Refuse new requests; answer once none is left.
    Quiesce(oneshot::Sender<()>),
}

/// Handle to the pipeline actor. Cheap to share behind an `Arc`; the actor stops when `shutdown` fires or every
/// handle is dropped.
pub struct Pipeline {
    tx: mpsc::Sender<Command>,
    model: Arc<ModelInfo>,
    metrics: Arc<Metrics>,
    tls: Option<Tls>,
}

impl Pipeline {
    /// Starts the actor serving through `plan` with the default [`PipelineOptions`].
    pub fn start(model: ModelInfo, plan: Plan, shutdown: CancellationToken) -> crate::Result<Self> {
        Self::start_with(model, plan, PipelineOptions::default(), shutdown)
    }

    /// Starts the actor serving through `plan` as `options` say, on a thread of its own (the module doc says why);
    /// the thread ends with the actor.
    pub fn start_with(
        model: ModelInfo,
        plan: Plan,
        options: PipelineOptions,
        shutdown: CancellationToken,
    ) -> crate::Result<Self> {
        let model = Arc::new(model);
        let (tx, rx) = mpsc::channel(COMMAND_BUFFER);
        let metrics = Arc::new(Metrics::new());
        metrics.set_model(&model.name);
        let tls = options.tls.clone();
        let actor = actor::Actor::new(model.clone(), plan, options, metrics.clone());
        let runtime = OwnRuntime(Some(
            tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(crate::Error::Thread)?,
        ));
        // Created here, so that the actor's span has the caller's as its parent.
        let run = actor.run(rx, shutdown).instrument(tracing::info_span!("pipeline"));
        std::thread::Builder::new()
            .name("strata-pipeline".into())
            .spawn(move || {
                if let Some(rt) = &runtime.0 {
                    rt.block_on(run);
                }
            })
            .map_err(crate::Error::Thread)?;
        Ok(Pipeline { tx, model, metrics, tls })
    }

    /// How many times a sequence was preempted (KV cache full) and queued for recompute, since start.
    pub fn preemptions(&self) -> u64 {
        self.metrics.preemptions_total()
    }

    /// How the stages are dialled (TLS or plaintext).
    pub fn stage_tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
    }

    /// The pipeline's metrics (`GET /metrics`).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The served model.
    pub fn model(&self) -> &ModelInfo {
        &self.model
    }

    /// Switches to `plan` if its epoch, term or stages differ: batches in flight are abandoned, active sequences are
    /// recomputed from their prompt and output through the new stages, and the actor connects to them. A plan
    /// without stages stops serving (a deposed leader): new requests are refused and running ones wait for a plan.
    pub async fn set_plan(&self, plan: Plan) -> Result<(), ServiceError> {
        self.tx.send(Command::SetPlan(plan)).await.map_err(|_| stopped())
    }

    /// Stops admitting (new requests get `UNAVAILABLE`) and resolves once every admitted request has ended: the
    /// first half of a graceful shutdown.
    pub async fn quiesce(&self) -> Result<(), ServiceError> {
        let (done, rx) = oneshot::channel();
        self.tx.send(Command::Quiesce(done)).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// Starts generating for `req`; events arrive on the returned receiver. Dropping it cancels the sequence.
    pub async fn submit(&self, req: SeqRequest) -> Result<mpsc::Receiver<SeqEvent>, ServiceError> {
        let (reply, rx) = oneshot::channel();
        let span = tracing::Span::current();
        self.tx.send(Command::Submit { req, span, reply }).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}

/// The actor's runtime, shut down without waiting for what it still runs (releases in flight, connections), so
/// that it may be dropped anywhere: on its thread when the actor ends, or where the thread failed to start.
struct OwnRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

pub(crate) fn stopped() -> ServiceError {
    ServiceError::unavailable("the pipeline is shut down")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_is_named_by_its_file_or_directory() {
        let name = |p: &str| model_name(Path::new(p));
        assert_eq!(name("/m/SmolLM2-135M-Instruct.Q4_1.gguf"), "SmolLM2-135M-Instruct.Q4_1");
        assert_eq!(name("/models/Llama-3.1-8B-Instruct"), "Llama-3.1-8B-Instruct");
        assert_eq!(name("/models/Llama-3.1-8B-Instruct/"), "Llama-3.1-8B-Instruct");
        assert_eq!(name("/models/model"), "model");
        assert_eq!(name(".gguf"), ".gguf");
    }
}
