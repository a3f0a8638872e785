//! Starting and stopping a worker: load the stage, serve `Stage` + health + reflection on a bound listener
//! until the shutdown token is cancelled. The Stage service's health follows its executor: NOT_SERVING once it
//! has died, SERVING again when a fresh stage replaces it.

use std::net::SocketAddr;
use std::sync::Arc;

use strata_engine::backend::Backend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::StageModel;
use strata_engine::{LayerRange, OnBackend, on_device};
use strata_membership::Registry;
use strata_proto::pb::stage_server::StageServer;
use strata_proto::tonic_health::server::HealthReporter;
use strata_proto::{STAGE_SERVICE, Tls, health_service, reflection_services, set_serving};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;

use crate::config::WorkerConfig;
use crate::device::load_options;
use crate::downstream::{Downstream, MAX_MESSAGE_BYTES};
use crate::error::{Error, Result};
use crate::executor::ExecutorHandle;
use crate::io_runtime::IoRuntime;
use crate::memory::{mib, size_kv_cache};
use crate::metrics::{StageMetrics, serve_metrics};
use crate::registration::{RegistrationOptions, run_registered};
use crate::server::StageService;
use crate::slot::{ActiveStage, StageSlot};
use crate::term::TermFence;

/// A stage whose weights are loaded and whose executor is running, ready to serve.
pub struct LoadedStage {
    config: WorkerConfig,
    tls: Option<Tls>,
    executor: ExecutorHandle,
    term: TermFence,
    io: IoRuntime,
}

impl LoadedStage {
    /// Validates `config` (reading its TLS files), opens the model and loads its layer range onto the device (on a
    /// blocking thread). The executor frees its sequences whenever `term` rises, and drives `io` between batches.
    pub async fn load(config: WorkerConfig, term: TermFence, io: IoRuntime) -> Result<Self> {
        let layers = config.validate()?;
        let tls = config.tls()?;
        let cfg = config.clone();
        let exec_term = term.clone();
        let exec_io = io.clone();
        let executor = tokio::task::spawn_blocking(move || -> Result<ExecutorHandle> {
            let files = ModelFiles::open(&cfg.model)?;
            cfg.validate_against_model(layers, files.config().num_layers)?;
            on_device(&(&cfg).into(), LoadStage { config: &cfg, files: &files, layers, term: exec_term, io: exec_io })
        })
        .await
        .map_err(|e| Error::Executor(format!("model loading panicked or was cancelled: {e}")))??;
        let facts = executor.facts();
        tracing::info!(
            node = %config.node_id,
            layers = ?facts.layers,
            weight_bytes = facts.weight_bytes,
            kv_blocks = facts.kv_total_blocks,
            kv_tokens = facts.kv_capacity_tokens(),
            offloaded_layers = ?facts.offloaded_layers,
            device = %facts.device,
            "stage loaded"
        );
        Ok(LoadedStage { config, tls, executor, term, io })
    }

    /// The stage as the service runs it, connected to its next stage.
    pub fn into_active(self) -> Result<ActiveStage> {
        let LoadedStage { config, tls, executor, .. } = self;
        active_stage(&config, tls.as_ref(), executor)
    }

    /// Serves the stage on `listener` until `shutdown` is cancelled, then drains open streams.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        tracing::info!(node = %self.config.node_id, next = ?self.config.next, tls = self.tls.is_some(), "stage ready");
        let (config, tls, term, io) = (self.config.clone(), self.tls.clone(), self.term.clone(), self.io.clone());
        let slot = StageSlot::new(self.into_active()?, term, io);
        serve_slot(&config, tls, slot, listener, shutdown).await
    }
}

/// `executor` as the service runs it for `config`'s place in the plan: a fresh link to `config.next`.
pub fn active_stage(config: &WorkerConfig, tls: Option<&Tls>, executor: ExecutorHandle) -> Result<ActiveStage> {
    let keepalive = config.keepalive()?;
    // The link runs on the network runtime, which the executor thread drives: a computed batch goes out on it.
    let _io = executor.io().enter();
    let downstream = config.next_uri().map(|uri| Downstream::spawn(&uri, tls, keepalive)).transpose()?;
    Ok(ActiveStage {
        executor,
        downstream,
        stage_index: config.stage_index.unwrap_or(0),
        plan_epoch: config.plan_epoch,
    })
}

/// `stage`'s executor (weights and KV cache kept) at `config`'s place in a new plan: its stage index and epoch,
/// and its link to `config.next` (the same link if the address did not change).
pub fn retarget(stage: &ActiveStage, config: &WorkerConfig, tls: Option<&Tls>) -> Result<ActiveStage> {
    let downstream = match (&stage.downstream, config.next_uri()) {
        (Some(link), Some(uri)) if link.address() == uri => Some(link.clone()),
        (_, uri) => {
            let _io = stage.executor.io().enter();
            uri.map(|uri| Downstream::spawn(&uri, tls, config.keepalive()?)).transpose()?
        }
    };
    Ok(ActiveStage {
        executor: stage.executor.clone(),
        downstream,
        stage_index: config.stage_index.unwrap_or(0),
        plan_epoch: config.plan_epoch,
    })
}

/// Loads a stage onto whichever backend the config opened and starts its executor.
struct LoadStage<'a> {
    config: &'a WorkerConfig,
    files: &'a ModelFiles,
    layers: LayerRange,
    term: TermFence,
    io: IoRuntime,
}

impl OnBackend for LoadStage<'_> {
    type Out = ExecutorHandle;
    type Error = Error;

    fn run<B: Backend>(self, backend: Arc<B>) -> Result<ExecutorHandle> {
        let cfg = self.config;
        let opts = load_options(cfg, self.files.config(), self.layers.to_range(), &*backend)?;
        let model = StageModel::load(self.files, self.layers.to_range(), backend, &opts)?;
        let kv = size_kv_cache(&model, cfg)?;
        if let (Some(budget), Some(usage)) = (kv.budget, kv.usage) {
            tracing::info!(
                node = %cfg.node_id,
                budget = %mib(budget),
                peak = %mib(usage.peak),
                kv_blocks = kv.blocks,
                kv_tokens = kv.blocks * cfg.block_size,
                "KV cache sized from the memory budget"
            );
        }
        ExecutorHandle::spawn(model, cfg, kv.blocks, self.term, self.io)
    }
}

/// Serves whatever stage `slot` holds (possibly none yet) on `listener` until `shutdown` is cancelled; over TLS
/// when `tls` is given (with a CA, callers must present a certificate it signed). Connections are kept alive
/// with `config`'s HTTP/2 keepalive, so a hung client's streams end.
pub async fn serve_slot(
    config: &WorkerConfig,
    tls: Option<Tls>,
    slot: StageSlot,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<()> {
    let node_id = config.node_id.clone();
    let keepalive = config.keepalive()?;
    let metrics = Arc::new(StageMetrics::new(&node_id));
    let service = StageService::new(node_id.clone(), slot.clone(), metrics.clone(), shutdown.clone());
    let metrics_task = match &config.metrics_listen {
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| Error::Config(format!("cannot serve metrics on --metrics-listen {addr}: {e}")))?;
            tracing::info!(node = %node_id, addr = %listener.local_addr()?, "serving metrics");
            let (slot, inflight, shutdown) = (slot.clone(), service.inflight(), shutdown.clone());
            Some(tokio::spawn(serve_metrics(listener, metrics, slot, inflight, shutdown)))
        }
        None => None,
    };
    let (health_reporter, health) = health_service();
    let (reported, first_report) = tokio::sync::oneshot::channel();
    let health_task = tokio::spawn(report_health(slot.clone(), health_reporter, shutdown.clone(), reported));
    // Serve once the status exists: a health check that came before the task's first report was answered
    // NOT_FOUND ("service not registered").
    let _ = first_report.await;
    let stage = StageServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let addr = listener.local_addr()?;
    tracing::info!(node = %node_id, %addr, tls = tls.is_some(), "serving");
    let server = strata_proto::tls::server(tls.as_ref()).map_err(Error::Tls)?;
    let (reflection, reflection_v1alpha) = reflection_services()?;
    let router = keepalive
        .server(server)
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(stage);
    // Served on the network runtime (the executor thread drives it between batches): the listener moves there.
    let listener = listener.into_std()?;
    let served = slot.io().handle().spawn(async move {
        let incoming = TcpIncoming::from(TcpListener::from_std(listener)?).with_nodelay(Some(true));
        router
            .serve_with_incoming_shutdown(incoming, async move {
                // The health task reports NOT_SERVING as it stops.
                let _ = health_task.await;
            })
            .await
            .map_err(Error::from)
    });
    served.await.map_err(|e| Error::Executor(format!("the gRPC server stopped: {e}")))??;
    if let Some(task) = metrics_task {
        match task.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "the metrics endpoint failed"),
            Err(e) => tracing::warn!(error = %e, "the metrics endpoint panicked"),
            Ok(Ok(())) => {}
        }
    }
    tracing::info!(node = %node_id, "stopped");
    Ok(())
}

/// Keeps the Stage service's health in line with the served stage: NOT_SERVING while its executor is dead (a
/// load balancer or the coordinator stops sending), SERVING otherwise (with no stage, batches are refused but the
/// worker is healthy, waiting for a plan); NOT_SERVING on shutdown. The only writer of that health status.
/// `reported` is sent once the first status is set.
async fn report_health(
    slot: StageSlot,
    reporter: HealthReporter,
    shutdown: CancellationToken,
    reported: tokio::sync::oneshot::Sender<()>,
) {
    let mut stages = slot.subscribe();
    let mut reported = Some(reported);
    loop {
        let death = stages.borrow_and_update().as_ref().map(|s| s.executor.death());
        let alive = death.as_ref().is_none_or(|d| !d.is_cancelled());
        set_serving(&reporter, STAGE_SERVICE, alive).await;
        if let Some(first) = reported.take() {
            let _ = first.send(());
        }
        let died = async {
            match &death {
                Some(d) if alive => d.cancelled().await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            changed = stages.changed() => if changed.is_err() { break },
            () = died => {}
        }
    }
    set_serving(&reporter, STAGE_SERVICE, false).await;
}

/// Loads the stage described by `config` and serves it on `listener` until `shutdown` is cancelled.
pub async fn run(config: WorkerConfig, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
    let io = IoRuntime::start()?;
    LoadedStage::load(config, TermFence::default(), io).await?.serve(listener, shutdown).await
}

/// A worker running in this process (tests, `strata local`): loaded, listening, stoppable.
pub struct Worker {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<Result<()>>,
}

impl Worker {
    /// Binds `addr` (port 0 picks a free port), loads the stage and starts serving. When this returns the
    /// weights are loaded and connections are accepted.
    pub async fn start(config: WorkerConfig, addr: &str) -> Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Self::start_on(config, listener).await
    }

    /// Like [`Worker::start`], on an already-bound listener.
    pub async fn start_on(config: WorkerConfig, listener: TcpListener) -> Result<Self> {
        let addr = listener.local_addr()?;
        let stage = LoadedStage::load(config, TermFence::default(), IoRuntime::start()?).await?;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(stage.serve(listener, shutdown.clone()));
        Ok(Worker { addr, shutdown, task })
    }

    /// Binds `addr`, registers with `registry` and serves whatever its plan assigns (see [`run_registered`]).
    /// When this returns connections are accepted; the node turns READY shortly after.
    pub async fn start_registered<R: Registry>(
        config: WorkerConfig,
        registry: R,
        options: RegistrationOptions,
        addr: &str,
    ) -> Result<Self> {
        config.validate_common()?;
        config.tls()?;
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run_registered(config, registry, options, listener, shutdown.clone()));
        Ok(Worker { addr, shutdown, task })
    }

    /// The address the worker listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// A token that stops the worker when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops the worker and waits for it to finish.
    pub async fn shutdown(self) -> Result<()> {
        self.shutdown.cancel();
        self.task.await.map_err(|e| Error::Executor(format!("server task failed: {e}")))?
    }
}
