//! Starting and stopping a worker: load the stage, serve `Stage` + health + reflection on a bound listener
//! until the shutdown token is cancelled.

use std::net::SocketAddr;
use std::sync::Arc;

use strata_engine::backend::Backend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::StageModel;
use strata_engine::{LayerRange, OnBackend, on_device};
use strata_membership::Registry;
use strata_proto::pb::stage_server::StageServer;
use strata_proto::{STAGE_SERVICE, Tls, health_service, reflection_service, set_serving};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;

use crate::config::WorkerConfig;
use crate::device::load_options;
use crate::downstream::{Downstream, MAX_MESSAGE_BYTES};
use crate::error::{Error, Result};
use crate::executor::ExecutorHandle;
use crate::registration::{RegistrationOptions, run_registered};
use crate::server::{ActiveStage, StageService, StageSlot};

/// A stage whose weights are loaded and whose executor is running, ready to serve.
pub struct LoadedStage {
    config: WorkerConfig,
    tls: Option<Tls>,
    executor: ExecutorHandle,
}

impl LoadedStage {
    /// Validates `config` (reading its TLS files), opens the model and loads its layer range onto the device (on a
    /// blocking thread).
    pub async fn load(config: WorkerConfig) -> Result<Self> {
        let layers = config.validate()?;
        let tls = config.tls()?;
        let cfg = config.clone();
        let executor = tokio::task::spawn_blocking(move || -> Result<ExecutorHandle> {
            let files = ModelFiles::open(&cfg.model)?;
            cfg.validate_against_model(layers, files.config().num_layers)?;
            on_device(&(&cfg).into(), LoadStage { config: &cfg, files: &files, layers })
        })
        .await
        .map_err(|e| Error::Executor(format!("model loading panicked or was cancelled: {e}")))??;
        let facts = executor.facts();
        tracing::info!(
            node = %config.node_id,
            layers = ?facts.layers,
            weight_bytes = facts.weight_bytes,
            kv_blocks = facts.kv_total_blocks,
            offloaded_layers = ?facts.offloaded_layers,
            device = %facts.device,
            "stage loaded"
        );
        Ok(LoadedStage { config, tls, executor })
    }

    /// The stage as the service runs it, connected to its next stage.
    pub fn into_active(self) -> Result<ActiveStage> {
        let LoadedStage { config, tls, executor } = self;
        let downstream = config.next_uri().map(|uri| Downstream::spawn(&uri, tls.as_ref())).transpose()?;
        Ok(ActiveStage {
            executor,
            downstream,
            stage_index: config.stage_index.unwrap_or(0),
            plan_epoch: config.plan_epoch.unwrap_or(0),
        })
    }

    /// Serves the stage on `listener` until `shutdown` is cancelled, then drains open streams.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
        let node_id = self.config.node_id.clone();
        let next = self.config.next.clone();
        tracing::info!(node = %node_id, next = ?next, tls = self.tls.is_some(), "stage ready");
        let tls = self.tls.clone();
        let slot = StageSlot::new(self.into_active()?);
        serve_slot(node_id, slot, listener, tls, shutdown).await
    }
}

/// Loads a stage onto whichever backend the config opened and starts its executor.
struct LoadStage<'a> {
    config: &'a WorkerConfig,
    files: &'a ModelFiles,
    layers: LayerRange,
}

impl OnBackend for LoadStage<'_> {
    type Out = ExecutorHandle;
    type Error = Error;

    fn run<B: Backend>(self, backend: Arc<B>) -> Result<ExecutorHandle> {
        let cfg = self.config;
        let opts = load_options(cfg, self.files.config(), self.layers.end - self.layers.start, &*backend);
        let model = StageModel::load(self.files, self.layers.to_range(), backend, &opts)?;
        ExecutorHandle::spawn(model, cfg.kv_blocks, cfg.block_size, cfg.hidden_dtype, cfg.plan_epoch)
    }
}

/// Serves whatever stage `slot` holds (possibly none yet) on `listener` until `shutdown` is cancelled; over TLS
/// when `tls` is given (with a CA, callers must present a certificate it signed).
pub async fn serve_slot(
    node_id: String,
    slot: StageSlot,
    listener: TcpListener,
    tls: Option<Tls>,
    shutdown: CancellationToken,
) -> Result<()> {
    let service = StageService::new(node_id.clone(), slot, shutdown.clone());
    let (health_reporter, health) = health_service();
    set_serving(&health_reporter, STAGE_SERVICE, true).await;
    let stage = StageServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let addr = listener.local_addr()?;
    tracing::info!(node = %node_id, %addr, tls = tls.is_some(), "serving");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let stopping = shutdown.clone();
    let reporter = health_reporter.clone();
    strata_proto::tls::server(tls.as_ref())
        .map_err(Error::Tls)?
        .add_service(health)
        .add_service(reflection_service()?)
        .add_service(stage)
        .serve_with_incoming_shutdown(incoming, async move {
            stopping.cancelled().await;
            set_serving(&reporter, STAGE_SERVICE, false).await;
        })
        .await?;
    tracing::info!(node = %node_id, "stopped");
    Ok(())
}

/// Loads the stage described by `config` and serves it on `listener` until `shutdown` is cancelled.
pub async fn run(config: WorkerConfig, listener: TcpListener, shutdown: CancellationToken) -> Result<()> {
    LoadedStage::load(config).await?.serve(listener, shutdown).await
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
        let stage = LoadedStage::load(config).await?;
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
