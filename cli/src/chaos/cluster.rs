//! A real cluster of processes for one chaos scenario: etcd, `stage-worker`s and one or two `coordinator`s on
//! free loopback ports, each process's output in a log file. It knows which process is which node or
//! coordinator, so a scenario can kill, pause or add one; everything is killed when it is dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use strata_membership::{EtcdOptions, EtcdRegistry, NodeState, Registry};
use strata_proto::{NodeId, pb};
use tonic::transport::Endpoint;

use super::load::Targets;
use super::procs::{Etcd, Proc, free_port};

/// The etcd prefix of chaos clusters (`/strata/chaos/`).
const CLUSTER: &str = "chaos";

/// How to start the processes.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The model file or directory.
    pub model: PathBuf,
    /// Where `coordinator` and `stage-worker` are.
    pub bin_dir: PathBuf,
    /// Stage workers at the start.
    pub workers: usize,
    /// Compute threads per worker.
    pub threads: usize,
    /// KV blocks per worker.
    pub kv_blocks: usize,
    /// Start a second coordinator as a standby.
    pub standby: bool,
    /// Extra `stage-worker` flags.
    pub worker_args: Vec<String>,
    /// Extra `coordinator` flags.
    pub coordinator_args: Vec<String>,
}

/// A coordinator process and its API addresses.
pub struct CoordinatorProc {
    /// The process (killed on drop).
    pub proc: Proc,
    /// `http://127.0.0.1:<port>` of the gRPC API.
    pub grpc_url: String,
    /// The HTTP API's address.
    pub http: SocketAddr,
}

/// The processes of one scenario.
/// Fields drop in declaration order: coordinators and workers first, then etcd, then its data directory.
pub struct ProcessCluster {
    /// Coordinators in start order; the first one starts alone, so it is the first leader.
    pub coordinators: Vec<CoordinatorProc>,
    /// Stage workers by node id, in start order.
    pub workers: Vec<(String, Proc)>,
    registry: EtcdRegistry,
    /// The cluster's etcd.
    pub etcd: Etcd,
    spec: ClusterSpec,
    log_dir: PathBuf,
    _data: tempfile::TempDir,
}

impl ProcessCluster {
    /// Starts etcd, the workers one at a time (each times a layer when it registers; timed side by side on
    /// shared cores they skew the split), a coordinator waiting for all of them, and the standby if asked;
    /// returns once the first coordinator serves every worker's stage.
    pub async fn start(spec: ClusterSpec, log_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
        let data = tempfile::tempdir().context("creating a data directory for etcd")?;
        let etcd = Etcd::start(data.path(), log_dir).await?;
        let registry =
            EtcdRegistry::connect(&EtcdOptions::new(vec![etcd.endpoint.clone()]), CLUSTER, Duration::from_secs(10))
                .await
                .context("connecting to the chaos etcd")?;
        let mut cluster = Self {
            coordinators: Vec::new(),
            workers: Vec::new(),
            registry,
            etcd,
            spec,
            log_dir: log_dir.to_path_buf(),
            _data: data,
        };
        for _ in 0..cluster.spec.workers {
            let id = cluster.add_worker()?;
            cluster.wait_ready(&id, Duration::from_secs(120)).await?;
        }
        cluster.start_first_coordinator().await?;
        let url = cluster.coordinators[0].grpc_url.clone();
        let workers = cluster.spec.workers;
        let ok = wait_serving(&url, Duration::from_secs(120), Duration::ZERO, |s| s.stages.len() == workers).await;
        if let Err(e) = ok {
            bail!("{e:#}\ncoordinator log:\n{}", cluster.coordinators[0].proc.tail(80));
        }
        if cluster.spec.standby {
            cluster.add_coordinator()?;
            let addr = cluster.coordinators[1].http;
            wait_live(addr, Duration::from_secs(60)).await.context("the standby coordinator")?;
        }
        Ok(cluster)
    }

    /// Starts one more stage worker (`w<N>`), without waiting for it; returns its node id.
    pub fn add_worker(&mut self) -> Result<String> {
        let id = format!("w{}", self.workers.len());
        let mut cmd = Command::new(self.spec.bin_dir.join("stage-worker"));
        cmd.args(["--etcd", &self.etcd.endpoint, "--cluster", CLUSTER, "--node-id", &id])
            .args(["--listen", &format!("127.0.0.1:{}", free_port()?)])
            .args(["--threads", &self.spec.threads.to_string(), "--kv-blocks", &self.spec.kv_blocks.to_string()])
            .arg("--model")
            .arg(&self.spec.model)
            .args(&self.spec.worker_args);
        let proc = Proc::spawn(&id, cmd, &self.log_dir)?;
        self.workers.push((id.clone(), proc));
        Ok(id)
    }

    /// Starts the first coordinator and waits until it answers `/live`. Its ports come from `free_port`, which
    /// cannot reserve them: if another process on the machine took one first, the coordinator exits at once, and
    /// it is started again on fresh ports (once).
    async fn start_first_coordinator(&mut self) -> Result<()> {
        for attempt in 0..2 {
            self.add_coordinator()?;
            let Some(c) = self.coordinators.last_mut() else { bail!("no coordinator was started") };
            let live = wait_live(c.http, Duration::from_secs(60)).await;
            if live.is_ok() {
                return Ok(());
            }
            if attempt == 0 && !c.proc.running() {
                eprintln!("the coordinator exited at start; once more on fresh ports. Its log:\n{}", c.proc.tail(80));
                self.coordinators.pop();
                continue;
            }
            return live.with_context(|| format!("the coordinator did not start; its log:\n{}", c.proc.tail(80)));
        }
        bail!("the coordinator exited at start twice")
    }

    fn add_coordinator(&mut self) -> Result<()> {
        let name = format!("coordinator-{}", self.coordinators.len());
        let (grpc, http) = (free_port()?, free_port()?);
        let mut cmd = Command::new(self.spec.bin_dir.join("coordinator"));
        cmd.args(["--etcd", &self.etcd.endpoint, "--cluster", CLUSTER])
            .args(["--grpc", &format!("127.0.0.1:{grpc}"), "--http", &format!("127.0.0.1:{http}")])
            .args(["--min-stages", &self.spec.workers.to_string()])
            // Whatever the workers' fixed KV cache holds is what every stage must hold.
            .args(["--min-kv-tokens", &(self.spec.kv_blocks * 16).to_string()])
            .arg("--model")
            .arg(&self.spec.model)
            .args(&self.spec.coordinator_args);
        let proc = Proc::spawn(&name, cmd, &self.log_dir)?;
        self.coordinators.push(CoordinatorProc {
            proc,
            grpc_url: format!("http://127.0.0.1:{grpc}"),
            http: SocketAddr::from(([127, 0, 0, 1], http)),
        });
        Ok(())
    }

    /// Waits until node `id` is registered READY.
    pub async fn wait_ready(&mut self, id: &str, limit: Duration) -> Result<()> {
        let node = NodeId::new(id);
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(r)) = self.registry.get_node(&node).await
                && r.state == NodeState::Ready
            {
                return Ok(());
            }
            let proc = self.worker_mut(id).context("no such worker")?;
            if !proc.running() || Instant::now() >= deadline {
                bail!("stage worker {id} did not register READY within {limit:?}; its log:\n{}", proc.tail(20));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The worker process of node `id`.
    pub fn worker_mut(&mut self, id: &str) -> Option<&mut Proc> {
        self.workers.iter_mut().find(|(w, _)| w == id).map(|(_, p)| p)
    }

    /// Which coordinator leads, from the election key in etcd (`coordinator-<pid>`).
    pub async fn leader(&self) -> Result<usize> {
        let name = self.registry.leader().await.context("reading the leader key")?.context("no leader elected")?;
        self.coordinators
            .iter()
            .position(|c| name == format!("coordinator-{}", c.proc.pid()))
            .with_context(|| format!("the leader {name:?} is none of this cluster's coordinators"))
    }

    /// The load's targets: coordinator `first`, then the others.
    pub fn targets(&self, first: usize) -> Result<Targets> {
        let n = self.coordinators.len();
        let order: Vec<&CoordinatorProc> = (0..n).map(|k| &self.coordinators[(first + k) % n]).collect();
        Ok(Targets {
            grpc: order
                .iter()
                .map(|c| Ok((c.grpc_url.clone(), Endpoint::from_shared(c.grpc_url.clone())?)))
                .collect::<Result<_>>()?,
            http: order.iter().map(|c| c.http).collect(),
        })
    }

    /// The last lines of every process's log, for a failure message.
    pub fn tails(&self, lines: usize) -> String {
        let mut out = String::new();
        let procs = self.coordinators.iter().map(|c| &c.proc).chain(self.workers.iter().map(|(_, p)| p));
        for p in procs.chain(std::iter::once(&self.etcd.proc)) {
            out.push_str(&format!("--- {} ---\n{}\n", p.name(), p.tail(lines)));
        }
        out
    }
}

/// `ClusterStatus` from the coordinator at `url`.
pub async fn status(url: &str) -> Result<pb::ClusterStatusResponse> {
    let mut client = crate::connect::connect(&Endpoint::from_shared(url.to_owned())?).await?;
    Ok(client.cluster_status(pb::ClusterStatusRequest {}).await?.into_inner())
}

/// Waits until the coordinator at `url` serves a plan that satisfies `ok`, with every stage READY at that epoch,
/// and a one-token generation succeeds. With a non-zero `settle`, the cluster must also be quiet: no node JOINING
/// or DRAINING and the same plan epoch for that long (a worker resumed after a hang registers again, and a wave
/// started before that replan would measure the replan instead of the recovery).
pub async fn wait_serving(
    url: &str,
    limit: Duration,
    settle: Duration,
    ok: impl Fn(&pb::ClusterStatusResponse) -> bool,
) -> Result<pb::ClusterStatusResponse> {
    let deadline = Instant::now() + limit;
    let mut last = String::from("no answer yet");
    let mut epoch_since: Option<(u64, Instant)> = None;
    while Instant::now() < deadline {
        match status(url).await {
            Ok(s) => {
                let loaded = |st: &pb::StageInfo| {
                    s.nodes.iter().any(|n| {
                        n.node_id == st.node_id
                            && n.state == pb::NodeState::Ready as i32
                            && n.plan_epoch_loaded >= s.plan_epoch
                    })
                };
                let busy = |n: &&pb::NodeInfo| {
                    n.state == pb::NodeState::Joining as i32 || n.state == pb::NodeState::Draining as i32
                };
                if epoch_since.is_none_or(|(e, _)| e != s.plan_epoch) {
                    epoch_since = Some((s.plan_epoch, Instant::now()));
                }
                let stable = epoch_since.is_some_and(|(_, t)| t.elapsed() >= settle);
                if s.stages.is_empty() || !s.stages.iter().all(loaded) || !ok(&s) {
                    last = format!("plan epoch {} with {} stage(s) not served yet", s.plan_epoch, s.stages.len());
                } else if !settle.is_zero() && (!stable || s.nodes.iter().any(|n| busy(&n))) {
                    last = format!("plan epoch {} served, the cluster not settled yet", s.plan_epoch);
                } else {
                    match one_token(url).await {
                        Ok(()) => return Ok(s),
                        Err(e) => last = format!("plan epoch {} ready, but a generation failed: {e:#}", s.plan_epoch),
                    }
                }
            }
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the coordinator at {url} did not serve within {limit:?}: {last}")
}

async fn one_token(url: &str) -> Result<()> {
    let mut client = crate::connect::connect(&Endpoint::from_shared(url.to_owned())?).await?;
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("Hello".into())),
        max_tokens: 1,
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    while stream.message().await?.is_some() {}
    Ok(())
}

/// Waits until the HTTP API at `addr` answers `/live`.
async fn wait_live(addr: SocketAddr, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        match crate::http::get(addr, "/live").await {
            Ok(r) if r.starts_with("200") => return Ok(()),
            r if Instant::now() >= deadline => bail!("{addr}/live did not answer 200 within {limit:?}: {r:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
