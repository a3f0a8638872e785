//! Registry-driven placement: a worker started without a layer range measures its speed, registers itself
//! (JOINING, then READY) under a kept-alive lease, and serves whatever the coordinator's plan assigns it. A new
//! plan naming the worker with a new layer range loads exactly that range and swaps the served stage between
//! batches; with the same range (and model) it keeps its executor, weights and KV cache, and only takes the new
//! epoch, stage index and next stage. A plan that leaves it out drops the weights while the worker stays
//! registered. A range it cannot load is recorded (`load_failed_epoch`) while it keeps serving what it had; an
//! executor that dies turns the node FAILED until a plan reloads it. Each plan's term raises the worker's.
//! Registry outages are ridden out: the lease keep-alive and the plan watch retry on their own, and the current
//! stage keeps serving.

use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_engine::backend::Backend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::{Device, KvDtype, LayerRange, OnBackend, on_device};
use strata_membership::{Backoff, NodeRecord, NodeRegistration, NodeState, Plan, Registry};
use strata_proto::{NodeId, PlanEpoch, Tls};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::WorkerConfig;
use crate::device::{kv_dtype, load_options};
use crate::error::{Error, Result};
use crate::io_runtime::IoRuntime;
use crate::memory::{budget, total_ram};
use crate::slot::{ActiveStage, StageSlot};
use crate::term::TermFence;
use crate::worker::{LoadedStage, retarget, serve_slot};

/// Default TTL of the worker's lease.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

/// How the worker presents itself to the registry.
#[derive(Debug, Clone, PartialEq)]
pub struct RegistrationOptions {
    /// Address other nodes reach this worker at; defaults to the bound address.
    pub advertise: Option<String>,
    /// TTL of the worker's lease.
    pub lease_ttl: Duration,
}

impl Default for RegistrationOptions {
    fn default() -> Self {
        RegistrationOptions { advertise: None, lease_ttl: DEFAULT_LEASE_TTL }
    }
}

/// The part of a plan that concerns one node: what to load and where to send its outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Epoch of the plan.
    pub epoch: PlanEpoch,
    /// The model the plan serves.
    pub model: String,
    /// Position of the stage in the pipeline.
    pub stage_index: u32,
    /// Layers to load.
    pub layers: LayerRange,
    /// The next stage's address; `None` on the last stage.
    pub next: Option<String>,
    /// KV tokens the stage must hold (0: no minimum).
    pub min_kv_tokens: u64,
    /// Largest micro-batch in tokens (0: the worker's default).
    pub max_batch_tokens: u32,
    /// The plan's quantization of float weights (`None`: the worker's own `--quantize`).
    pub quantize: Option<String>,
    /// The plan's KV cache element type (`None`: the worker's own `--kv-dtype`).
    pub kv_dtype: Option<String>,
}

impl Assignment {
    /// What `plan` asks of `node`, or `None` if it holds no stage.
    pub fn of(plan: &Plan, node: &NodeId) -> Option<Self> {
        let index = plan.stages.iter().position(|s| &s.node_id == node)?;
        let stage = &plan.stages[index];
        Some(Assignment {
            epoch: plan.epoch,
            model: plan.model.clone(),
            stage_index: u32::try_from(index).ok()?,
            // Checked: a stored plan with an empty stage gives this node nothing to load, not an empty model.
            layers: LayerRange::try_from(stage.layer_start..stage.layer_end).ok()?,
            next: plan.stages.get(index + 1).map(|s| s.address.clone()),
            min_kv_tokens: plan.min_kv_tokens,
            max_batch_tokens: plan.max_batch_tokens,
            quantize: plan.quantize.clone(),
            kv_dtype: plan.kv_dtype.clone(),
        })
    }

    /// Whether `self` can be served by the executor loaded for `other`: the same layers of the same model, in
    /// the same format.
    pub fn same_weights(&self, other: &Assignment) -> bool {
        self.layers == other.layers
            && self.model == other.model
            && self.quantize == other.quantize
            && self.kv_dtype == other.kv_dtype
    }

    /// The worker config that serves this assignment; `Err` for a quantization this build does not know.
    pub fn config(&self, base: &WorkerConfig) -> Result<WorkerConfig> {
        let quantize = match &self.quantize {
            Some(q) => Some(q.parse().map_err(Error::Engine)?),
            None => base.quantize,
        };
        let kv_dtype = match &self.kv_dtype {
            Some(d) => Some(d.parse().map_err(Error::Engine)?),
            None => base.kv_dtype,
        };
        Ok(WorkerConfig {
            layers: Some(self.layers),
            next: self.next.clone(),
            stage_index: Some(self.stage_index),
            plan_epoch: Some(self.epoch.0),
            min_kv_tokens: self.min_kv_tokens,
            max_batch_tokens: match self.max_batch_tokens {
                0 => base.max_batch_tokens,
                n => n as usize,
            },
            quantize,
            kv_dtype,
            ..base.clone()
        })
    }
}

/// Seconds one layer of the model takes on a small batch, on the configured device, resident and offloaded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpeed {
    /// A layer whose weights stay in memory.
    pub resident: f64,
    /// A layer whose weights are brought in for each batch (paged in from the model file on a CPU, streamed from
    /// host memory on a GPU).
    pub offloaded: f64,
    /// What the last stage adds besides its layers (final norm, head, logits of every token of the batch).
    pub head: f64,
}

/// Measures [`LayerSpeed`]: layer 0 is loaded alone and run on a few tokens (after one warm-up run), once kept
/// resident and once offloaded; then the last layer with the head, whose time beyond a layer's is the head's.
/// Blocking; call it off the async runtime.
pub fn measure_layer_seconds(config: &WorkerConfig) -> Result<LayerSpeed> {
    let files = ModelFiles::open(&config.model)?;
    on_device(&config.into(), MeasureLayer { config, files: &files })
}

struct MeasureLayer<'a> {
    config: &'a WorkerConfig,
    files: &'a ModelFiles,
}

impl OnBackend for MeasureLayer<'_> {
    type Out = LayerSpeed;
    type Error = Error;

    fn run<B: Backend>(self, backend: Arc<B>) -> Result<LayerSpeed> {
        let mut opts = load_options(self.config, self.files.config(), 0..1, &*backend)?;
        let kv_dtype = kv_dtype(self.config, &*backend);
        let vocab = self.files.config().vocab_size;
        opts.resident_layers = None;
        let resident = time_layer(&StageModel::load(self.files, 0..1, backend.clone(), &opts)?, vocab, kv_dtype)?;
        // The head on every token, as for a decode micro-batch of TOKENS sequences. On a small model it costs as
        // much as several layers (SmolLM2: a 49152 × 576 head beside 30 layers of ~3.5M weights), and a last
        // stage given an equal share of layers on top of it paced the whole pipeline.
        // Measured without the memory limit (the stage's own budget is planned at load; this is one layer for a
        // moment) and best effort: a node that cannot is placed as if its head were free.
        let n = self.files.config().num_layers;
        let head = load_options(self.config, self.files.config(), n - 1..n, &*backend)
            .and_then(|last| {
                let last = LoadOptions { offload: None, resident_layers: None, ..last };
                Ok(StageModel::load(self.files, n - 1..n, backend.clone(), &last)?)
            })
            .and_then(|with_head| time_rows(&with_head, vocab, kv_dtype, LogitRows::All))
            .map(|t| (t - resident).max(0.0))
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cannot measure the head's time; placing as if it were free");
                0.0
            });
        opts.resident_layers = Some(0);
        let offloaded = time_layer(&StageModel::load(self.files, 0..1, backend, &opts)?, vocab, kv_dtype)?;
        Ok(LayerSpeed { resident, offloaded, head })
    }
}

fn time_layer<B: Backend>(model: &StageModel<B>, vocab: usize, kv_dtype: KvDtype) -> Result<f64> {
    time_rows(model, vocab, kv_dtype, LogitRows::Last)
}

fn time_rows<B: Backend>(model: &StageModel<B>, vocab: usize, kv_dtype: KvDtype, logits: LogitRows) -> Result<f64> {
    const TOKENS: usize = 8;
    // The fastest of several runs: a run is ~1 ms, so one preemption or a neighbour's burst can triple a mean
    // (identical local workers measured 1.1, 2.6 and 3.2 ms/layer with the mean of 3), while the minimum is
    // what the device does undisturbed.
    const RUNS: usize = 12;
    let mut kv = model.new_kv_cache(RUNS + 1, TOKENS, kv_dtype)?;
    let ids: Vec<u32> = (0..TOKENS as u32).map(|i| i % vocab as u32).collect();
    // A later stage takes hidden states; their values do not change a kernel's time.
    let width = model.config().hidden_size;
    let hidden: Vec<f32> = (0..TOKENS * width).map(|i| (i % 7) as f32 * 0.01).collect();
    let mut fastest = Duration::MAX;
    for seq in 0..=RUNS as u64 {
        let chunk = SeqChunk { seq_id: seq, start_pos: 0, len: TOKENS };
        // Uploaded before the clock starts: the stage's compute is timed, not the copy onto the device.
        let input = if model.is_first() {
            StageInput::Tokens(&ids)
        } else {
            StageInput::Hidden(model.backend().act_from_host(&hidden, TOKENS, width)?)
        };
        let started = Instant::now();
        model.forward(&mut kv, &[chunk], input, logits)?;
        if seq > 0 {
            fastest = fastest.min(started.elapsed());
        }
        kv.release(seq);
    }
    Ok(fastest.as_secs_f64().max(f64::MIN_POSITIVE))
}

/// Memory the node offers for weights and KV cache: on a GPU `--gpu-memory-limit`, else `--memory-limit`, else
/// `--memory-fraction` of the machine's RAM. (A GPU without a limit reports RAM too: the device's size is only
/// known once it is opened, which registration does not do before it is READY.)
fn memory_bytes(config: &WorkerConfig) -> u64 {
    let gpu = match config.device {
        Device::Cuda(_) => config.gpu_memory_limit,
        Device::Cpu => None,
    };
    budget(gpu.or(config.memory_limit), config.memory_fraction, total_ram()).unwrap_or(0)
}

/// Registers with `registry`, serves on `listener` whatever the plan assigns, until `shutdown` is cancelled;
/// then leaves the cluster (the lease is revoked).
pub async fn run_registered<R: Registry>(
    config: WorkerConfig,
    registry: R,
    options: RegistrationOptions,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<()> {
    config.validate_common()?;
    if config.layers.is_some() {
        return Err(Error::Config("a registered worker takes its layers from the plan; drop the layer range".into()));
    }
    let address = match &options.advertise {
        Some(a) => a.clone(),
        None => listener.local_addr()?.to_string(),
    };
    let tls = config.tls()?;
    let slot = StageSlot::empty(TermFence::default(), IoRuntime::start()?);
    let server = {
        let (config, tls, slot, shutdown) = (config.clone(), tls.clone(), slot.clone(), shutdown.clone());
        tokio::spawn(async move { serve_slot(&config, tls, slot, listener, shutdown).await })
    };
    let outcome = match membership(&config, &registry, &options, address, &slot, tls, &shutdown).await {
        Err(e) if shutdown.is_cancelled() => {
            tracing::debug!(node = %config.node_id, error = %e, "registration cut short by shutdown");
            Ok(())
        }
        other => other,
    };
    shutdown.cancel();
    let served = server.await.map_err(|e| Error::Executor(format!("server task failed: {e}")))?;
    outcome.and(served)
}

async fn membership<R: Registry>(
    config: &WorkerConfig,
    registry: &R,
    options: &RegistrationOptions,
    address: String,
    slot: &StageSlot,
    tls: Option<Tls>,
    shutdown: &CancellationToken,
) -> Result<()> {
    let node_id = NodeId::new(config.node_id.as_str());
    let record = NodeRecord {
        node_id: node_id.clone(),
        address,
        device: config.device.to_string(),
        memory_bytes: memory_bytes(config),
        layer_seconds: 0.0,
        offload_layer_seconds: 0.0,
        head_seconds: 0.0,
        state: NodeState::Joining,
        plan_epoch_loaded: PlanEpoch(0),
        load_failed_epoch: PlanEpoch(0),
    };
    let registration = registry.register_node(record, options.lease_ttl).await?;
    let cfg = config.clone();
    let speed = tokio::task::spawn_blocking(move || measure_layer_seconds(&cfg))
        .await
        .map_err(|e| Error::Executor(format!("measuring the layer speed panicked: {e}")))??;
    let rec = update(&registration, shutdown, move |r| {
        r.layer_seconds = speed.resident;
        r.offload_layer_seconds = speed.offloaded;
        r.head_seconds = speed.head;
        r.state = NodeState::Ready;
    })
    .await?;
    tracing::info!(
        node = %node_id,
        layer_seconds = speed.resident,
        offload_layer_seconds = speed.offloaded,
        head_seconds = speed.head,
        memory_bytes = rec.memory_bytes,
        "node ready"
    );

    let plans = registry.watch_plan().await?;
    let follower =
        PlanFollower { config, registration: &registration, slot, tls, shutdown, current: None, failed: false };
    follower.follow(plans).await?;
    if let Err(e) = registration.deregister().await {
        tracing::warn!(node = %node_id, error = %e, "could not deregister; the record expires with its lease");
    }
    Ok(())
}

/// Follows the plan for a registered worker: applies each new plan, and reports an executor death.
struct PlanFollower<'a, R: Registry> {
    config: &'a WorkerConfig,
    registration: &'a NodeRegistration<R>,
    slot: &'a StageSlot,
    tls: Option<Tls>,
    shutdown: &'a CancellationToken,
    /// What the served stage was loaded for (`None`: nothing).
    current: Option<Assignment>,
    /// Whether the record says FAILED because the served stage's executor died.
    failed: bool,
}

impl<R: Registry> PlanFollower<'_, R> {
    /// Runs until `shutdown`; fails only if the plan watch stops.
    async fn follow(mut self, mut plans: watch::Receiver<Option<Plan>>) -> Result<()> {
        loop {
            let plan = plans.borrow_and_update().clone();
            if let Some(plan) = plan {
                self.apply(&plan).await?;
            }
            // Until the next plan: report the executor's death if it dies meanwhile (or did during `apply`).
            loop {
                let death = self.slot.current().map(|s| s.executor.death()).filter(|_| !self.failed);
                if death.as_ref().is_some_and(CancellationToken::is_cancelled) {
                    self.report_failed().await?;
                    continue;
                }
                let died = async {
                    match death {
                        Some(d) => d.cancelled_owned().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = self.shutdown.cancelled() => return Ok(()),
                    changed = plans.changed() => {
                        if changed.is_err() {
                            return Err(Error::Executor("the plan watch stopped".into()));
                        }
                        break;
                    }
                    () = died => {}
                }
            }
        }
    }

    /// Takes the node out of placement after its executor died: FAILED (unless an operator is already taking it
    /// out, DRAINING or CORDONED). The stage stays in the slot and answers `UNAVAILABLE`.
    async fn report_failed(&mut self) -> Result<()> {
        tracing::error!(node = %self.config.node_id, "the executor died; marking the node FAILED");
        self.failed = true;
        update(self.registration, self.shutdown, |r| {
            if matches!(r.state, NodeState::Ready | NodeState::Joining) {
                r.state = NodeState::Failed;
            }
        })
        .await?;
        Ok(())
    }

    /// Brings the served stage in line with `plan` and records the epoch applied (or the epoch that failed).
    async fn apply(&mut self, plan: &Plan) -> Result<()> {
        // A newer leader's plan: the executor frees its predecessor's sequences.
        self.slot.raise_term(plan.term).await;
        let wanted = Assignment::of(plan, self.registration.node_id());
        if wanted == self.current {
            return Ok(());
        }
        let node = &self.config.node_id;
        let mut fresh = false;
        match &wanted {
            Some(a) => {
                let keep = self.current.as_ref().is_some_and(|c| c.same_weights(a));
                // Only the stage to keep is held here: a stage being replaced must be free to stop.
                let kept = self.slot.current().filter(|s| keep && !s.executor.is_dead());
                let config = match a.config(self.config) {
                    Ok(config) => config,
                    Err(e) => {
                        tracing::error!(node = %node, epoch = a.epoch.0, error = %e, "cannot serve the planned stage");
                        let epoch = a.epoch;
                        update(self.registration, self.shutdown, move |r| r.load_failed_epoch = epoch).await?;
                        return Ok(());
                    }
                };
                let (epoch, layers, next) = (a.epoch.0, &a.layers, &a.next);
                let stage = match kept {
                    Some(stage) => {
                        tracing::info!(node = %node, epoch, %layers, ?next, "same layers: keeping weights and KV");
                        retarget(&stage, &config, self.tls.as_ref())
                    }
                    None => {
                        if self.config.memory_limit.is_some() || self.config.gpu_memory_limit.is_some() {
                            // Under a limit two copies of the weights must never coexist: free the old stage
                            // first (its sequences are recomputed under the new plan anyway).
                            self.current = None;
                            free_stage(self.slot.replace(None), node).await;
                        }
                        tracing::info!(node = %node, epoch, %layers, ?next, "loading stage");
                        fresh = true;
                        LoadedStage::load(config, self.slot.term().clone(), self.slot.io().clone())
                            .await
                            .and_then(LoadedStage::into_active)
                    }
                };
                match stage {
                    Ok(stage) => {
                        self.slot.replace(Some(stage));
                    }
                    Err(e) => {
                        // Keep serving what we have; the record tells the coordinator, which can roll back.
                        tracing::error!(node = %node, epoch = a.epoch.0, error = %e, "cannot load the planned stage");
                        let epoch = a.epoch;
                        update(self.registration, self.shutdown, move |r| r.load_failed_epoch = epoch).await?;
                        return Ok(());
                    }
                }
            }
            None => {
                if self.current.is_some() {
                    tracing::info!(node = %node, epoch = plan.epoch.0, "not in the plan; dropping the weights");
                }
                self.slot.replace(None);
            }
        }
        self.current = wanted;
        let epoch = plan.epoch;
        // A fresh executor replaces a dead one: schedulable again.
        let recovered = fresh && std::mem::take(&mut self.failed);
        update(self.registration, self.shutdown, move |r| {
            r.plan_epoch_loaded = epoch;
            if recovered && r.state == NodeState::Failed {
                r.state = NodeState::Ready;
            }
        })
        .await?;
        Ok(())
    }
}

/// How long a replaced stage's in-flight batches get to finish before the new one loads anyway.
const FREE_TIMEOUT: Duration = Duration::from_secs(30);

/// Drops `old` and waits until its executor has stopped and freed its weights and KV cache (its last in-flight
/// batches answered), or [`FREE_TIMEOUT`].
async fn free_stage(old: Option<Arc<ActiveStage>>, node: &str) {
    let Some(old) = old else { return };
    let stopped = old.executor.death();
    drop(old);
    if tokio::time::timeout(FREE_TIMEOUT, stopped.cancelled()).await.is_err() {
        tracing::warn!(node, "the replaced stage is still busy; loading the new one beside it");
    } else {
        tracing::info!(node, "freed the replaced stage's weights and KV cache");
    }
}

/// Updates the node's record, retrying with backoff while the registry is unreachable (or the record is
/// missing while the keep-alive registers it again), until it succeeds or `shutdown` is cancelled.
async fn update<R: Registry>(
    registration: &NodeRegistration<R>,
    shutdown: &CancellationToken,
    change: impl FnMut(&mut NodeRecord) + Send + Clone,
) -> Result<NodeRecord> {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let delay = match registration.update(change.clone()).await {
            Ok(rec) => return Ok(rec),
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(node = %registration.node_id(), error = %e, retry_in = ?delay, "record update failed");
                delay
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => return Err(Error::Executor("shut down before the record was updated".into())),
            () = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use strata_membership::PlanStage;

    use super::*;

    fn plan() -> Plan {
        let stage =
            |id: &str, a, b| PlanStage { node_id: id.into(), address: format!("{id}:1"), layer_start: a, layer_end: b };
        Plan {
            epoch: PlanEpoch(4),
            stages: vec![stage("a", 0, 3), stage("b", 3, 4)],
            model: "m".into(),
            num_layers: 4,
            ..Plan::default()
        }
    }

    #[test]
    fn assignments_name_the_next_stage() {
        let p = plan();
        let a = Assignment::of(&p, &NodeId::new("a"));
        assert_eq!(
            a,
            Some(Assignment {
                epoch: PlanEpoch(4),
                model: "m".into(),
                stage_index: 0,
                layers: LayerRange { start: 0, end: 3 },
                next: Some("b:1".into()),
                min_kv_tokens: 0,
                max_batch_tokens: 0,
                quantize: None,
                kv_dtype: None,
            })
        );
        let b = Assignment::of(&p, &NodeId::new("b"));
        assert_eq!(b.as_ref().map(|b| (b.stage_index, b.next.clone())), Some((1, None)));
        assert_eq!(Assignment::of(&p, &NodeId::new("c")), None);
        let cfg = b.and_then(|b| b.config(&WorkerConfig::new("b", "/m", None)).ok());
        assert_eq!(
            cfg.as_ref().map(|c| (c.layers, c.plan_epoch)),
            Some((Some(LayerRange { start: 3, end: 4 }), Some(4)))
        );
        assert!(cfg.is_some_and(|c| c.validate().is_ok()));
    }

    #[test]
    fn the_plans_memory_settings_override_the_workers_own() {
        let base = WorkerConfig {
            quantize: Some(strata_engine::QuantDtype::Q4_0),
            kv_dtype: Some(strata_engine::KvDtype::F16),
            ..WorkerConfig::new("b", "/m", None)
        };
        let mut p = plan();
        let own = Assignment::of(&p, &NodeId::new("b")).and_then(|a| a.config(&base).ok());
        assert_eq!(own.map(|c| (c.quantize, c.kv_dtype, c.min_kv_tokens)), Some((base.quantize, base.kv_dtype, 0)));
        (p.quantize, p.kv_dtype, p.min_kv_tokens, p.max_batch_tokens) =
            (Some("q8_0".into()), Some("q8_0".into()), 640, 64);
        let planned = Assignment::of(&p, &NodeId::new("b")).and_then(|a| a.config(&base).ok());
        assert_eq!(
            planned.map(|c| (c.quantize, c.kv_dtype, c.min_kv_tokens, c.max_batch_tokens)),
            Some((Some(strata_engine::QuantDtype::Q8_0), Some(strata_engine::KvDtype::Q8_0), 640, 64))
        );
        p.kv_dtype = Some("f64".into());
        let bad = Assignment::of(&p, &NodeId::new("b")).map(|a| a.config(&base).is_err());
        assert_eq!(bad, Some(true), "an unknown KV type in a plan is an error, not a default");
    }

    #[test]
    fn a_node_offers_its_limit_or_a_share_of_the_ram() {
        let cpu = WorkerConfig::new("a", "/m", None);
        let ram = total_ram().unwrap_or(0) as f64;
        assert_eq!(memory_bytes(&WorkerConfig { memory_limit: Some(7), ..cpu.clone() }), 7);
        assert_eq!(memory_bytes(&WorkerConfig { memory_fraction: 0.5, ..cpu.clone() }), (ram * 0.5) as u64);
        let gpu = WorkerConfig { device: Device::Cuda(0), gpu_memory_limit: Some(9), memory_limit: Some(7), ..cpu };
        assert_eq!(memory_bytes(&gpu), 9);
    }
}
