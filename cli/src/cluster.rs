//! `strata local` (a whole cluster in this process) and `strata client generate` (a request to a coordinator).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use strata_coordinator::CoordinatorConfig;
use strata_engine::{CpuIsa, Device, FloatDtype, QuantDtype};
use strata_membership::{EmbeddedRegistry, NodeState, Registry};
use strata_proto::{NodeId, TlsArgs, pb, shutdown_signal};
use strata_stage_worker::{RegistrationOptions, Worker, WorkerConfig};
use tokio_util::sync::CancellationToken;

use crate::connect::ApiKeyArgs;
use crate::{connect, drain};

/// Arguments of `strata local`.
#[derive(clap::Args)]
pub struct LocalArgs {
    /// Hugging Face directory or `.gguf` file.
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    /// Stage workers to start (the model's layers are split among them).
    #[arg(long, default_value_t = 3)]
    stages: usize,
    /// Address of the coordinator's gRPC API.
    #[arg(long, default_value = "127.0.0.1:50051", env = "STRATA_GRPC")]
    grpc: SocketAddr,
    /// Address of the coordinator's OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`,
    /// `/v1/models`, `/health`).
    #[arg(long, default_value = "127.0.0.1:8080", env = "STRATA_HTTP")]
    http: SocketAddr,
    /// CPU threads per stage worker (0: one per core). The stages share this machine's cores and take turns
    /// (one micro-batch in flight per set of cores), so each computes fastest on all of them.
    #[arg(long, env = "STRATA_THREADS", default_value_t = 0)]
    threads: usize,
    /// KV blocks per stage worker.
    #[arg(long, default_value_t = 256)]
    kv_blocks: usize,
    #[command(flatten)]
    device: StageDevice,
}

/// What every stage worker of a local cluster computes on (all of them share the one device).
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub(crate) struct StageDevice {
    /// Compute device of every stage worker: cpu or cuda:N (cuda needs a build with --features cuda).
    #[arg(long = "device", default_value = "cpu")]
    device: Device,
    /// Storage type of float weights: f32, f16 or bf16 (on a GPU also the activation type, bf16 by default).
    #[arg(long = "dtype")]
    dtype: Option<FloatDtype>,
    /// GPU memory each stage worker may use, in bytes; layers beyond it stay in host memory and are streamed to
    /// the GPU per batch (cuda only).
    #[arg(long)]
    gpu_memory_limit: Option<u64>,
    /// Quantize each worker's float weight matrices to q8_0, q4_0 or q4_1 as its layers load.
    #[arg(long, env = "STRATA_QUANTIZE")]
    quantize: Option<QuantDtype>,
    /// Instruction set of every worker's CPU kernels: auto (the best this CPU has), scalar, avx2, avx-vnni or
    /// avx512-vnni (the CPU must have it).
    #[arg(long, env = "STRATA_CPU_ISA", default_value = "auto")]
    cpu_isa: CpuIsa,
}

/// A whole cluster in this process: stage workers registered in an embedded registry and a coordinator, all
/// talking real gRPC on loopback.
pub(crate) struct LocalCluster {
    /// Where the coordinator serves its gRPC API (its port, when 0 was asked for, is the one bound).
    pub(crate) grpc: SocketAddr,
    /// Where it serves its HTTP API.
    pub(crate) http: SocketAddr,
    workers: Vec<Worker>,
    coordinator: tokio::task::JoinHandle<strata_coordinator::Result<()>>,
    shutdown: CancellationToken,
}

impl LocalCluster {
    /// Starts `stages` CPU workers of `coordinator.model` (each with `threads` threads of kernels at `cpu_isa` and
    /// `kv_blocks` KV blocks) and the coordinator, which serves the APIs `coordinator` names. Both API addresses
    /// are bound first, so a taken one fails at once, before any worker loads.
    pub(crate) async fn start(
        coordinator: CoordinatorConfig,
        stages: usize,
        threads: usize,
        kv_blocks: usize,
        cpu_isa: CpuIsa,
    ) -> Result<Self> {
        let device = StageDevice { cpu_isa, ..StageDevice::default() };
        Self::start_on(coordinator, stages, threads, kv_blocks, device).await
    }

    /// [`LocalCluster::start`] with every worker on `device`.
    async fn start_on(
        coordinator: CoordinatorConfig,
        stages: usize,
        threads: usize,
        kv_blocks: usize,
        device: StageDevice,
    ) -> Result<Self> {
        let model = coordinator.model.clone();
        if stages == 0 {
            bail!("--stages must be at least 1");
        }
        let grpc = strata_coordinator::bind_api("gRPC", coordinator.grpc_addr).await?;
        let http = strata_coordinator::bind_api("HTTP", coordinator.http_addr).await?;
        let registry = EmbeddedRegistry::new("local");
        let mut workers = Vec::with_capacity(stages);
        for i in 0..stages {
            let mut cfg = WorkerConfig::new(format!("local-{i}"), &model, None);
            cfg.threads = threads;
            cfg.cpu_isa = device.cpu_isa;
            cfg.kv_blocks = Some(kv_blocks);
            cfg.quantize = device.quantize;
            cfg.device = device.device;
            cfg.dtype = device.dtype;
            cfg.gpu_memory_limit = device.gpu_memory_limit;
            let w = Worker::start_registered(cfg, registry.clone(), RegistrationOptions::default(), "127.0.0.1:0")
                .await
                .with_context(|| format!("starting stage worker {i}"))?;
            eprintln!("stage worker local-{i} listening on {}", w.local_addr());
            workers.push(w);
            // One at a time: every worker times a layer when it registers, and probes running side by side on
            // shared cores slow each other down unevenly (identical workers measured up to 2x apart), which
            // skews the layer split.
            wait_ready(&registry, &format!("local-{i}")).await?;
        }
        // CPU stages here share this machine's cores: no more micro-batches in flight than can compute at once.
        let max_batches_in_flight = match (coordinator.max_batches_in_flight, device.device) {
            (0, Device::Cpu) => {
                let cores = strata_engine::backend::cpu::threads_or_cores(0);
                let threads = strata_engine::backend::cpu::threads_or_cores(threads);
                let n = batches_in_flight_on_shared_cores(stages, threads, cores, coordinator.micro_batches_per_stage);
                eprintln!(
                    "{stages} stage(s) share {cores} core(s), {threads} thread(s) each: {n} micro-batch(es) in flight"
                );
                n
            }
            (n, _) => n,
        };
        let config = CoordinatorConfig {
            cluster: "local".into(),
            min_stages: stages,
            candidate: Some("local-coordinator".into()),
            min_kv_tokens: Some(256),
            max_batches_in_flight,
            ..coordinator
        };
        let shutdown = CancellationToken::new();
        let (grpc_addr, http_addr) = (grpc.local_addr()?, http.local_addr()?);
        let coordinator =
            tokio::spawn(strata_coordinator::serve_with_registry(config, registry, grpc, http, shutdown.clone()));
        Ok(Self { grpc: grpc_addr, http: http_addr, workers, coordinator, shutdown })
    }

    /// Runs until `stop` fires or the coordinator fails, then shuts everything down.
    pub(crate) async fn run_until(self, stop: impl std::future::Future<Output = ()>) -> Result<()> {
        self.run_while(async {
            stop.await;
            Ok(())
        })
        .await
    }

    /// Runs `work` against the cluster, then shuts everything down; returns what `work` returned, or, should the
    /// coordinator end first (it does only on an error), the coordinator's error at once.
    pub(crate) async fn run_while<T>(mut self, work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let finished = tokio::select! {
            r = work => Ok(r),
            r = &mut self.coordinator => Err(r),
        };
        self.shutdown.cancel();
        let (output, joined) = match finished {
            Ok(output) => (Some(output), self.coordinator.await),
            Err(joined) => (None, joined),
        };
        let coordinator = joined.context("coordinator task").and_then(|r| r.context("coordinator"));
        for w in self.workers {
            let _ = w.shutdown().await;
        }
        match output {
            Some(output) => coordinator.and(output),
            None => Err(coordinator.err().unwrap_or_else(|| anyhow::anyhow!("the coordinator stopped"))),
        }
    }
}

/// The micro-batches worth keeping in flight through `stages` CPU stages of `threads` threads each on one machine
/// of `cores` cores, with `per_stage` micro-batches per stage: as many stages as the cores can run at once (at
/// least one), each with its micro-batches. More would time-slice the cores and shrink every batch: three
/// one-thread stages on two cores served 0.77-0.78x of one stage at 16 streams; one batch at a time through
/// stages of two threads, 0.95-0.96x (docs/performance.md, 2026-12-05).
fn batches_in_flight_on_shared_cores(stages: usize, threads: usize, cores: usize, per_stage: usize) -> usize {
    let at_once = (cores / threads.max(1)).clamp(1, stages.max(1));
    at_once * per_stage.max(1)
}

/// Waits until `node` is READY in `registry` (it has measured its speed), or fails after a minute.
async fn wait_ready(registry: &EmbeddedRegistry, node: &str) -> Result<()> {
    let id = NodeId::new(node);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let record = registry.get_node(&id).await.context("reading the local registry")?;
        if record.is_some_and(|r| r.state == NodeState::Ready) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("stage worker {node} did not become ready within 60 s");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Runs `strata local` until SIGINT or SIGTERM: an embedded registry, `stages` workers on loopback ports and a coordinator
/// (gRPC and HTTP APIs), all talking real gRPC.
pub fn local(a: LocalArgs) -> Result<()> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let coordinator = CoordinatorConfig::new(&a.model, a.grpc, a.http);
        let cluster = LocalCluster::start_on(coordinator, a.stages, a.threads, a.kv_blocks, a.device).await?;
        eprintln!("coordinator gRPC API on {}, OpenAI-compatible HTTP API on http://{}/v1", cluster.grpc, cluster.http);
        eprintln!("{} stages; requests are served once every stage is ready (GET /health); Ctrl-C to stop", a.stages);
        cluster.run_until(shutdown_signal()).await
    })
}

/// `strata nodes` subcommands.
#[derive(clap::Subcommand)]
pub enum NodesCommand {
    /// List nodes, the plan epoch and the stages.
    List(NodesTarget),
    /// Move a node's layers elsewhere and wait until it is CORDONED, out of the plan and holding no KV.
    Drain(DrainArgs),
    /// Keep a node out of future plans.
    Cordon(NodeAction),
    /// Let a cordoned node back into plans.
    Uncordon(NodeAction),
}

/// Which coordinator to ask.
#[derive(clap::Args)]
pub struct NodesTarget {
    /// Coordinator gRPC URL (`https://` for TLS).
    #[arg(long, default_value = "http://127.0.0.1:50051", env = "STRATA_COORDINATOR")]
    coordinator: String,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    api_key: ApiKeyArgs,
}

/// A node and the coordinator to ask.
#[derive(clap::Args)]
pub struct NodeAction {
    /// The node id.
    id: String,
    #[command(flatten)]
    target: NodesTarget,
}

/// Arguments of `strata nodes drain`.
#[derive(clap::Args)]
pub struct DrainArgs {
    #[command(flatten)]
    node: NodeAction,
    /// Return as soon as the node is DRAINING instead of waiting for the drain to finish.
    #[arg(long, env = "STRATA_DRAIN_NO_WAIT")]
    no_wait: bool,
    /// Seconds to wait for the drain to finish before failing with what is still pending.
    #[arg(long, default_value_t = 300, env = "STRATA_DRAIN_TIMEOUT")]
    timeout: u64,
}

/// A node state's name as `strata nodes list` prints it.
pub(crate) fn state_name(s: i32) -> &'static str {
    match pb::NodeState::try_from(s) {
        Ok(pb::NodeState::Joining) => "JOINING",
        Ok(pb::NodeState::Ready) => "READY",
        Ok(pb::NodeState::Draining) => "DRAINING",
        Ok(pb::NodeState::Cordoned) => "CORDONED",
        Ok(pb::NodeState::Failed) => "FAILED",
        _ => "UNKNOWN",
    }
}

/// Runs `strata nodes ...`.
pub fn nodes(cmd: NodesCommand) -> Result<()> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let target = match &cmd {
            NodesCommand::List(t) => t,
            NodesCommand::Drain(d) => &d.node.target,
            NodesCommand::Cordon(a) | NodesCommand::Uncordon(a) => &a.target,
        };
        let url = &target.coordinator;
        let endpoint = connect::endpoint(url, &target.tls)?;
        let credentials = target.api_key.credentials()?;
        let mut client =
            connect::connect_as(&endpoint, &credentials).await.with_context(|| format!("connecting to {url}"))?;
        match cmd {
            NodesCommand::List(_) => {
                let s = client.cluster_status(pb::ClusterStatusRequest {}).await?.into_inner();
                println!("model {} ({} layers), plan epoch {}", s.model, s.num_layers, s.plan_epoch);
                println!(
                    "{:<20} {:<9} {:<24} {:>16} {:>12} {:>10} {:>13} {:>10}",
                    "NODE", "STATE", "ADDRESS", "LAYERS", "MS/LAYER", "MEMORY", "KV FREE/TOTAL", "KV TOKENS"
                );
                for n in &s.nodes {
                    let layers = match (n.layer_end > n.layer_start, n.offloaded_layers) {
                        (false, _) => "-".into(),
                        (true, 0) => format!("{}..{}", n.layer_start, n.layer_end),
                        (true, off) => format!("{}..{} ({off} off)", n.layer_start, n.layer_end),
                    };
                    println!(
                        "{:<20} {:<9} {:<24} {:>16} {:>12.3} {:>10} {:>13} {:>10}",
                        n.node_id,
                        state_name(n.state),
                        n.address,
                        layers,
                        n.layer_seconds * 1e3,
                        format!("{:.0}Mi", n.memory_bytes as f64 / f64::from(1 << 20)),
                        format!("{}/{}", n.kv_free_blocks, n.kv_total_blocks),
                        n.kv_capacity_tokens
                    );
                }
            }
            NodesCommand::Drain(DrainArgs { node: a, .. }) | NodesCommand::Cordon(a) | NodesCommand::Uncordon(a)
                if a.id.is_empty() =>
            {
                bail!("a node id is required")
            }
            NodesCommand::Drain(d) => {
                let id = &d.node.id;
                report(client.drain_node(pb::NodeRequest { node_id: id.clone() }).await, id)?;
                if !d.no_wait {
                    let timeout = std::time::Duration::from_secs(d.timeout);
                    eprintln!("waiting up to {} s for {id} to be drained (--no-wait returns at once)", d.timeout);
                    let took = drain::wait_drained(&mut client, id, timeout, |line| eprintln!("{line}")).await?;
                    println!("{id}: drained in {:.1} s (CORDONED, no layers, no KV in use)", took.as_secs_f64());
                }
            }
            NodesCommand::Cordon(a) => {
                report(client.cordon_node(pb::NodeRequest { node_id: a.id.clone() }).await, &a.id)?
            }
            NodesCommand::Uncordon(a) => {
                report(client.uncordon_node(pb::NodeRequest { node_id: a.id.clone() }).await, &a.id)?
            }
        }
        Ok(())
    })
}

fn report(r: std::result::Result<tonic::Response<pb::NodeResponse>, tonic::Status>, id: &str) -> Result<()> {
    let r = r.with_context(|| format!("node {id}"))?.into_inner();
    println!("{id}: {} (plan epoch {})", state_name(r.state), r.plan_epoch);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::batches_in_flight_on_shared_cores as in_flight;

    #[test]
    fn stages_sharing_cores_keep_as_many_batches_in_flight_as_can_compute_at_once() {
        // Two cores: one stage of two threads at a time, two of one thread.
        assert_eq!(in_flight(3, 2, 2, 1), 1);
        assert_eq!(in_flight(3, 1, 2, 1), 2);
        assert_eq!(in_flight(3, 1, 2, 2), 4, "with two micro-batches per stage");
        // Never more than the stages, never fewer than one.
        assert_eq!(in_flight(3, 1, 16, 1), 3);
        assert_eq!(in_flight(2, 8, 4, 1), 1);
        assert_eq!(in_flight(1, 1, 1, 1), 1);
    }
}
