//! The compute actor: one OS thread owns the stage's model, its KV cache and (on the last stage) the
//! per-sequence samplers, and runs commands in the order they arrive over a bounded channel. Before each command
//! it frees the sequences of older coordinator terms (see [`crate::term`]). A panic on the thread is contained:
//! the handle reports the executor dead ([`ExecutorHandle::death`]) and every later batch is `UNAVAILABLE`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use strata_engine::HiddenDtype;
use strata_engine::backend::Backend;
use strata_engine::kv_cache::KvCache;
use strata_engine::model::{LogitRows, StageInput, StageModel};
use strata_engine::sampling::SamplingParams;
use strata_proto::pb;
use strata_proto::{ServiceError, decode_to_f32, encode_f32, wire_micros};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::config::WorkerConfig;
use crate::error::{Error, Result, engine_to_service};
use crate::io_runtime::IoRuntime;
use crate::sampler::{Draw, SeqSamplers, engine_params};
use crate::term::TermFence;

mod checks;

/// Commands queued before the executor blocks the sender (backpressure on the `Forward` readers).
const QUEUE_DEPTH: usize = 16;
/// Longest a decode batch may have taken for the next one to run while the executor drives the network runtime:
/// far below the keepalive timeouts, so no PING goes unanswered for long.
const SHORT_COMPUTE: Duration = Duration::from_millis(100);

/// What a batch produced on this stage.
#[derive(Debug)]
pub enum Output {
    /// Hidden states to send to the next stage, already encoded in the wire dtype.
    Hidden(pb::HiddenStates),
    /// Tokens sampled by the last stage, one per chunk without `skip_sampling`.
    Tokens(Vec<pb::SampledToken>),
}

/// A batch's output and where its time went on the executor.
#[derive(Debug)]
pub struct BatchOutput {
    /// What the stage produced.
    pub output: Output,
    /// Microseconds spent in the executor on this batch.
    pub compute_micros: u64,
    /// Microseconds from the batch's arrival (as given to [`ExecutorHandle::submit`]) to the start of its compute.
    pub queue_micros: u64,
    /// When the compute ended: the hand-off to the next stream is timed from here.
    pub finished: Instant,
}

/// The outcome of one batch: its output, or the error to answer it with.
pub type BatchResult = Result<BatchOutput, ServiceError>;

/// What to do with a batch's outcome, run on the executor thread the moment the batch is computed: the output goes
/// straight to the next stream, with no task to wake in between (a cross-thread wake-up costs 20-50 µs here). Never
/// blocks: waiting for room in a bounded queue goes into the hand-off it returns. Dropped without being run (the
/// executor stopped), it answers the batch itself.
pub trait Completion: Send {
    /// Hands on the batch's outcome; what it returns (if anything) runs on the executor's runtime before the next
    /// command (waiting for room in the next stage's queue, as the executor waits for nothing else).
    fn complete(self: Box<Self>, result: BatchResult) -> Option<Handoff>;
}

/// The rest of a batch's hand-off, awaited by the executor before its next command.
pub type Handoff = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

enum Command {
    Forward {
        batch: Box<pb::ForwardRequest>,
        done: Box<dyn Completion>,
        /// The batch's spans in its requests' traces (see `server`); its compute is recorded under each.
        traced: Vec<tracing::Span>,
        /// When the batch came off its stream.
        received: Instant,
    },
    /// Releases are waiting in the pending list.
    Wake,
}

/// A `Release` waiting for the executor.
struct PendingRelease {
    seq_ids: Vec<u64>,
    reply: oneshot::Sender<u32>,
}

/// Releases jump the batch queue: the coordinator releases only sequences with no batch in flight, so they
/// need not wait behind other sequences' batches (which, on a busy stage, can take seconds), and the blocks
/// come back as early as possible.
type Releases = Arc<Mutex<Vec<PendingRelease>>>;

/// Fixed facts about the loaded stage.
#[derive(Debug, Clone)]
pub struct StageFacts {
    /// Layers held.
    pub layers: std::ops::Range<usize>,
    /// KV cache capacity in blocks.
    pub kv_total_blocks: u64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Bytes of weights loaded.
    pub weight_bytes: u64,
    /// Backend device name.
    pub device: String,
    /// Layers kept in host memory and streamed to the device per batch (the end of `layers`; empty without
    /// offload).
    pub offloaded_layers: std::ops::Range<usize>,
    /// Results do not depend on batching ([`StageModel::batch_invariant`]).
    pub batch_invariant: bool,
}

impl StageFacts {
    /// KV cache capacity in tokens: blocks times the tokens a block holds.
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.kv_total_blocks.saturating_mul(u64::from(self.block_size))
    }
}

/// How the executor thread ended, once it has: `Some(why)` after a panic.
#[derive(Default)]
struct Death {
    /// Cancelled when the thread stops running commands.
    token: CancellationToken,
    /// The panic message.
    panic: OnceLock<String>,
}

/// A cheap, cloneable handle to the executor thread.
#[derive(Clone)]
pub struct ExecutorHandle {
    tx: mpsc::Sender<Command>,
    releases: Releases,
    kv_counts: Arc<KvCounts>,
    facts: Arc<StageFacts>,
    death: Arc<Death>,
    /// The worker's network runtime, which the executor thread drives between and during short batches.
    io: tokio::runtime::Handle,
}

/// The KV cache's block counts after the executor's last command, for status and metrics.
#[derive(Default)]
struct KvCounts {
    free: AtomicU64,
    cached: AtomicU64,
}

impl KvCounts {
    fn store<B: Backend>(&self, kv: &KvCache<B>) {
        // Cached blocks no sequence holds count as free, as the coordinator counts them: a drained, idle stage
        // reports all its blocks free.
        self.free.store((kv.free_blocks() + kv.idle_cached_blocks()) as u64, Ordering::Relaxed);
        self.cached.store(kv.cached_blocks() as u64, Ordering::Relaxed);
    }
}

impl ExecutorHandle {
    /// Starts the executor thread, which owns `model` and a KV cache of `kv_blocks` × `config.block_size`
    /// tokens, and frees its sequences whenever `term` rises. It stops when every handle is dropped, or when it
    /// panics; [`ExecutorHandle::death`] fires once it has stopped and freed the weights and the KV cache.
    pub fn spawn<B: Backend>(
        model: StageModel<B>,
        config: &WorkerConfig,
        kv_blocks: usize,
        term: TermFence,
        io: IoRuntime,
    ) -> Result<Self> {
        let block_size = config.block_size;
        let mut kv = model.new_kv_cache(kv_blocks, block_size, crate::device::kv_dtype(config, &**model.backend()))?;
        if config.memory_limit.is_some() {
            // Under an explicit limit the cache's memory is taken at start, so the limit holds by construction
            // and a host that cannot give it fails now, not mid-request.
            kv.prefault(model.backend());
        }
        let facts = Arc::new(StageFacts {
            layers: model.range(),
            kv_total_blocks: kv.num_blocks() as u64,
            block_size: u32::try_from(block_size).map_err(|_| Error::Config("block_size is too large".into()))?,
            weight_bytes: model.weight_bytes() as u64,
            device: model.backend().name(),
            offloaded_layers: model.offloaded_layers(),
            batch_invariant: model.batch_invariant(),
        });
        let kv_counts = Arc::new(KvCounts::default());
        kv_counts.store(&kv);
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let releases = Releases::default();
        let death = Arc::new(Death::default());
        let exec = Executor {
            model,
            kv,
            samplers: SeqSamplers::default(),
            hidden_dtype: wire_dtype(config.hidden_dtype),
            kv_term: term.current(),
            term,
            kv_counts: kv_counts.clone(),
            releases: releases.clone(),
            batches_run: 0,
            panic_after_batches: config.fault_panic_after_batches,
            last_decode: None,
        };
        let thread_death = death.clone();
        let handle = io.handle().clone();
        std::thread::Builder::new()
            .name("strata-executor".into())
            .spawn(move || run_contained(exec, rx, &io, &thread_death))
            .map_err(|e| Error::Executor(format!("cannot start the executor thread: {e}")))?;
        Ok(ExecutorHandle { tx, releases, kv_counts, facts, death, io: handle })
    }

    /// Queues a batch that came off its stream at `received` (waiting while the queue is full); `done` gets its
    /// outcome on the executor thread. Its compute is recorded as a child span of each of `traced`. An error means
    /// the executor has stopped: `done` was dropped unrun, and answers the batch itself.
    pub async fn submit(
        &self,
        batch: pb::ForwardRequest,
        traced: Vec<tracing::Span>,
        received: Instant,
        done: Box<dyn Completion>,
    ) -> Result<(), ServiceError> {
        let batch = Box::new(batch);
        self.tx.send(Command::Forward { batch, done, traced, received }).await.map_err(|_| self.gone())
    }

    /// Frees the sequences' KV blocks and sampling state before the next queued batch runs (the caller
    /// guarantees none of their batches is queued); returns how many were known.
    pub async fn release(&self, seq_ids: Vec<u64>) -> Result<u32, ServiceError> {
        let (reply, rx) = oneshot::channel();
        self.releases.lock().map_err(|_| self.gone())?.push(PendingRelease { seq_ids, reply });
        if !self.wake() {
            return Err(self.gone());
        }
        rx.await.map_err(|_| self.gone())
    }

    /// Makes the executor look at pending releases (and the term) now, even with no batch queued; false if it
    /// has stopped.
    fn wake(&self) -> bool {
        // A full queue means the executor will look before its next batch anyway.
        !matches!(self.tx.try_send(Command::Wake), Err(mpsc::error::TrySendError::Closed(_)))
    }

    /// Whether the executor thread has stopped (it panicked): nothing runs on this stage any more.
    pub fn is_dead(&self) -> bool {
        self.death.token.is_cancelled()
    }

    /// A token cancelled when the executor thread stops.
    pub fn death(&self) -> CancellationToken {
        self.death.token.clone()
    }

    /// The error for a batch or release that the executor can no longer run: `UNAVAILABLE`, so the caller
    /// retries elsewhere (this worker takes itself out of placement and reloads when a plan asks it to).
    pub fn gone(&self) -> ServiceError {
        match self.death.panic.get() {
            Some(why) => ServiceError::unavailable(format!(
                "the stage's executor failed ({why}); this worker serves nothing until a plan reloads it"
            )),
            None => ServiceError::unavailable("the stage's executor has stopped"),
        }
    }

    /// KV blocks free after the last command, counting cached blocks no sequence holds.
    pub fn kv_free_blocks(&self) -> u64 {
        self.kv_counts.free.load(Ordering::Relaxed)
    }

    /// KV blocks in the prefix cache after the last command.
    pub fn kv_cached_blocks(&self) -> u64 {
        self.kv_counts.cached.load(Ordering::Relaxed)
    }

    /// Fixed facts about the stage.
    pub fn facts(&self) -> &StageFacts {
        &self.facts
    }

    /// The worker's network runtime.
    pub(crate) fn io(&self) -> &tokio::runtime::Handle {
        &self.io
    }
}

/// The wire's name for the element type of hidden states.
fn wire_dtype(d: HiddenDtype) -> pb::Dtype {
    match d {
        HiddenDtype::F32 => pb::Dtype::F32,
        HiddenDtype::F16 => pb::Dtype::F16,
        HiddenDtype::Bf16 => pb::Dtype::Bf16,
    }
}

/// One token per sequence: a decode step, whose compute time the previous one predicts.
fn is_decode(batch: &pb::ForwardRequest) -> bool {
    batch.chunks.iter().all(|c| c.len <= 1)
}

/// Whether `batch` runs while the executor thread drives the network runtime: a decode step, when the last one
/// (`last_decode`) took under [`SHORT_COMPUTE`]; the first one, and every prompt chunk, run with it let go.
fn runs_inline(batch: &pb::ForwardRequest, last_decode: Option<Duration>) -> bool {
    is_decode(batch) && last_decode.is_some_and(|d| d < SHORT_COMPUTE)
}

/// Runs the executor until its channel closes, turning a panic into a recorded death: the thread ends, but
/// the process and the other stages' work go on, and the worker reports itself failed.
fn run_contained<B: Backend>(mut exec: Executor<B>, mut rx: mpsc::Receiver<Command>, io: &IoRuntime, death: &Death) {
    // The loop itself runs in the backend's execution context (on the CPU, a thread of its pool), so a batch's
    // compute starts and ends on the thread that took it off the queue: handing each batch into the pool and its
    // result back cost two thread wake-ups per batch (50-150 µs each on the development VMs).
    let backend = Arc::clone(exec.model.backend());
    let outcome = catch_unwind(AssertUnwindSafe(|| backend.scope(|| exec.run(&mut rx, io))));
    // Weights and KV cache are freed before the death is announced, so a reload that waits for it has the room:
    // the backend too, whose weight arena holds the chunk it last copied weights into.
    drop(exec);
    drop(backend);
    if let Err(payload) = outcome {
        let why = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        tracing::error!(error = %why, "the executor panicked; the stage is out of service");
        let _ = death.panic.set(why);
    }
    // Set before the channel closes, so no batch sees a closed queue without the reason.
    death.token.cancel();
    drop(rx);
}

struct Executor<B: Backend> {
    model: StageModel<B>,
    kv: KvCache<B>,
    samplers: SeqSamplers,
    hidden_dtype: pb::Dtype,
    /// The worker's highest term seen.
    term: TermFence,
    /// The term the sequences in `kv` belong to; below `term`, they belong to a deposed leader.
    kv_term: u64,
    kv_counts: Arc<KvCounts>,
    releases: Releases,
    batches_run: u64,
    /// Testing hook ([`WorkerConfig::fault_panic_after_batches`]).
    panic_after_batches: Option<u64>,
    /// How long the last decode batch (one token per sequence) computed.
    last_decode: Option<Duration>,
}

impl<B: Backend> Executor<B> {
    /// Frees every sequence if the worker has seen a newer term than the one they were admitted under.
    fn sync_term(&mut self) {
        let highest = self.term.current();
        if highest <= self.kv_term {
            return;
        }
        let seqs: Vec<u64> = self.kv.sequences().collect();
        for &seq in &seqs {
            self.kv.release(seq);
        }
        self.samplers = SeqSamplers::default();
        if !seqs.is_empty() {
            tracing::info!(
                old = self.kv_term,
                new = highest,
                sequences = seqs.len(),
                "new coordinator term: freed its predecessor's sequences"
            );
        }
        self.kv_term = highest;
    }

    /// Frees every pending release's sequences and answers how many were known.
    fn run_releases(&mut self) {
        let pending = match self.releases.lock() {
            Ok(mut p) => std::mem::take(&mut *p),
            Err(_) => return,
        };
        let mut answers = Vec::with_capacity(pending.len());
        for PendingRelease { seq_ids, reply } in pending {
            let mut released = 0;
            for seq in seq_ids {
                if self.kv.table(seq).is_some() {
                    released += 1;
                }
                self.kv.release(seq);
                self.samplers.release(seq);
            }
            answers.push((reply, released));
        }
        // Counted before anyone hears back, so a status read after the answer sees the freed blocks.
        self.kv_counts.store(&self.kv);
        for (reply, released) in answers {
            let _ = reply.send(released);
        }
    }

    /// Runs commands until the channel closes. Short ones run while this thread drives the network runtime (see
    /// [`IoRuntime`]); a long one lets the helper drive it during the compute and takes it back for the hand-off.
    fn run(&mut self, rx: &mut mpsc::Receiver<Command>, io: &IoRuntime) {
        while let Some(cmd) = io.drive(self.run_short(rx)) {
            if let Some(handoff) = self.run_command(cmd) {
                io.drive(handoff);
            }
        }
    }

    /// Runs short commands as they come; returns the first long one, or `None` once the channel has closed.
    async fn run_short(&mut self, rx: &mut mpsc::Receiver<Command>) -> Option<Command> {
        loop {
            let cmd = rx.recv().await?;
            if !self.is_short(&cmd) {
                return Some(cmd);
            }
            if let Some(handoff) = self.run_command(cmd) {
                handoff.await;
            }
            // Lets the hand-off's writes (and other connections) run before the next compute.
            tokio::task::yield_now().await;
        }
    }

    /// Whether `cmd` can run without the network waiting too long for it: a decode batch (one token per
    /// sequence) when the last one took less than [`SHORT_COMPUTE`]; prompts can take seconds.
    fn is_short(&self, cmd: &Command) -> bool {
        match cmd {
            Command::Wake => true,
            Command::Forward { batch, .. } => runs_inline(batch, self.last_decode),
        }
    }

    /// Runs one command; returns the rest of its hand-off, to be driven on the network runtime.
    fn run_command(&mut self, cmd: Command) -> Option<Handoff> {
        self.sync_term();
        self.run_releases();
        match cmd {
            Command::Forward { batch, done, traced, received } => {
                let span = tracing::debug_span!("compute", batch_id = batch.batch_id, chunks = batch.chunks.len());
                let _enter = span.enter();
                // Open until the batch is computed: each request's trace shows this stage's compute.
                let _computing: Vec<tracing::Span> =
                    traced.iter().map(|parent| tracing::info_span!(parent: parent, "stage_compute")).collect();
                if self.panic_after_batches.is_some_and(|n| self.batches_run >= n) {
                    panic!("injected fault: panic after {} batches (fault_panic_after_batches)", self.batches_run);
                }
                self.batches_run += 1;
                let started = Instant::now();
                let result = self.forward(&batch).map(|output| {
                    let finished = Instant::now();
                    BatchOutput {
                        output,
                        compute_micros: wire_micros(finished - started),
                        queue_micros: wire_micros(started.saturating_duration_since(received)),
                        finished,
                    }
                });
                if is_decode(&batch) {
                    self.last_decode = Some(started.elapsed());
                }
                if let Err(e) = &result {
                    tracing::debug!(batch_id = batch.batch_id, error = %e, "batch failed");
                }
                self.kv_counts.store(&self.kv);
                done.complete(result)
            }
            // `run_releases` above stored the counts after `sync_term` freed anything.
            Command::Wake => None,
        }
    }

    /// The coordinator's prefix-cache orders that come before a batch's chunks: drop blocks to free their space.
    fn evict(&mut self, batch: &pb::ForwardRequest) {
        if batch.clear_prefix_cache {
            self.kv.clear_prefix_cache();
        }
        for &key in &batch.evict_blocks {
            self.kv.evict(key);
        }
    }

    fn forward(&mut self, batch: &pb::ForwardRequest) -> Result<Output, ServiceError> {
        // Checked again here: a newer term may have arrived (on another stream, or in a plan) after the service
        // admitted this batch, and its sequences must not come back into the freed cache.
        self.term.check(batch.term, format_args!("batch {}", batch.batch_id))?;
        self.evict(batch);
        let (chunks, n_tokens) = self.check_chunks(batch)?;
        for c in batch.chunks.iter().filter(|c| !c.cached_blocks.is_empty()) {
            self.kv.attach(c.seq_id, &c.cached_blocks).map_err(|e| engine_to_service(&e))?;
        }
        let params = if self.model.is_last() {
            batch.chunks.iter().map(|c| engine_params(c.sampling.as_ref())).collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let backend = self.model.backend().clone();
        let cfg = self.model.config();
        let input = if self.model.is_first() {
            let vocab = cfg.vocab_size;
            if let Some(bad) = batch.token_ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ServiceError::invalid_argument(format!(
                    "token id {bad} is outside the vocabulary (size {vocab})"
                )));
            }
            StageInput::Tokens(&batch.token_ids)
        } else {
            let hidden = batch.hidden.as_ref().ok_or_else(|| {
                ServiceError::invalid_argument("this stage needs hidden states and the batch has none")
            })?;
            let (values, rows, cols) = decode_to_f32(hidden)?;
            if (rows, cols) != (n_tokens, cfg.hidden_size) {
                return Err(ServiceError::invalid_argument(format!(
                    "hidden states are {rows}x{cols}, expected {n_tokens}x{} ({n_tokens} tokens in the chunks)",
                    cfg.hidden_size
                )));
            }
            StageInput::Hidden(backend.act_from_host(&values, rows, cols).map_err(|e| engine_to_service(&e))?)
        };
        let out =
            self.model.forward(&mut self.kv, &chunks, input, LogitRows::Last).map_err(|e| engine_to_service(&e))?;
        for c in &batch.chunks {
            for b in &c.publish {
                self.kv.publish(c.seq_id, b.index as usize, b.key).map_err(|e| engine_to_service(&e))?;
            }
        }
        let host = backend.act_to_host(&out).map_err(|e| engine_to_service(&e))?;
        let (rows, cols) = backend.act_shape(&out);
        if !self.model.is_last() {
            return Ok(Output::Hidden(encode_f32(&host, rows, cols, self.hidden_dtype)?));
        }
        if rows != chunks.len() {
            return Err(ServiceError::internal(format!("{rows} logit rows for {} chunks", chunks.len())));
        }
        Ok(Output::Tokens(self.sample(batch, &params, host, cols)?))
    }

    fn sample(
        &mut self,
        batch: &pb::ForwardRequest,
        params: &[SamplingParams],
        mut logits: Vec<f32>,
        vocab: usize,
    ) -> Result<Vec<pb::SampledToken>, ServiceError> {
        let mut draws = Vec::with_capacity(batch.chunks.len());
        let mut offset = 0;
        for ((chunk, params), row) in batch.chunks.iter().zip(params).zip(logits.chunks_exact_mut(vocab)) {
            let len = chunk.len as usize;
            let ids = batch.token_ids.get(offset..offset + len).unwrap_or_default();
            offset += len;
            self.samplers.observe(chunk, ids, params);
            if !chunk.skip_sampling {
                draws.push(Draw { seq_id: chunk.seq_id, logits: row, want_logprob: chunk.want_logprobs });
            }
        }
        let picks = self.samplers.sample_all(&mut draws)?;
        let tokens = draws.iter().zip(picks).map(|(d, (token_id, logprob))| pb::SampledToken {
            seq_id: d.seq_id,
            token_id,
            logprob,
        });
        Ok(tokens.collect())
    }
}

#[cfg(test)]
mod tests {
    use strata_engine::backend::cpu::CpuBackend;
    use strata_engine::loader::ModelFiles;
    use strata_engine::model::LoadOptions;
    use strata_engine::tensor::DType;
    use strata_engine::testing::{TinySpec, random_weights, tiny_config, write_hf};

    use super::*;

    /// Reports the thread a batch's outcome was handed on from, and whether it succeeded.
    struct OnThread(std::sync::mpsc::Sender<(Option<String>, bool)>);

    impl Completion for OnThread {
        fn complete(self: Box<Self>, result: BatchResult) -> Option<Handoff> {
            let _ = self.0.send((std::thread::current().name().map(str::to_owned), result.is_ok()));
            None
        }
    }

    #[test]
    fn decode_steps_run_inline_while_the_last_one_was_short() {
        let batch = |lens: &[u32]| pb::ForwardRequest {
            chunks: lens.iter().map(|&len| pb::SeqChunk { len, ..Default::default() }).collect(),
            ..Default::default()
        };
        let short = Some(Duration::from_millis(5));
        assert!(runs_inline(&batch(&[1, 1, 1]), short));
        assert!(!runs_inline(&batch(&[1, 7, 1]), short), "a prompt chunk can take seconds");
        assert!(!runs_inline(&batch(&[1]), None), "no decode step measured yet");
        assert!(!runs_inline(&batch(&[1]), Some(SHORT_COMPUTE)), "the last step was long");
    }

    #[test]
    fn batches_run_and_answer_on_a_thread_of_the_cpu_pool() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let spec = TinySpec { config: tiny_config(), dtype: DType::F32, seed: 5 };
        write_hf(dir.path(), &spec, &random_weights(&spec))?;
        let files = ModelFiles::open(dir.path())?;
        let layers = 0..files.config().num_layers;
        let model = StageModel::load(&files, layers, Arc::new(CpuBackend::new(2)?), &LoadOptions::default())?;
        let config = WorkerConfig { block_size: 4, ..WorkerConfig::new("n", dir.path(), None) };
        let exec = ExecutorHandle::spawn(model, &config, 8, TermFence::default(), IoRuntime::start()?)?;
        let chunk = pb::SeqChunk { seq_id: 1, start_pos: 0, len: 3, ..Default::default() };
        let batch =
            pb::ForwardRequest { batch_id: 1, chunks: vec![chunk], token_ids: vec![1, 2, 3], ..Default::default() };
        let (tx, rx) = std::sync::mpsc::channel();
        let runtime = tokio::runtime::Builder::new_current_thread().build()?;
        runtime.block_on(exec.submit(batch, Vec::new(), Instant::now(), Box::new(OnThread(tx))))?;
        let (thread, ok) = rx.recv_timeout(Duration::from_secs(60))?;
        assert!(ok, "the batch failed");
        // Not the executor's own thread: the loop runs inside the pool, so no batch is handed across threads.
        assert!(thread.as_deref().is_some_and(|t| t.starts_with("strata-cpu-")), "answered on {thread:?}");
        Ok(())
    }
}
