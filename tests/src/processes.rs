//! A cluster of real processes for fault tests: an etcd server, `stage-worker` processes and one or more
//! `coordinator` processes (the first to campaign leads, the others stand by), on 127.0.0.1 or with every worker
//! in its own network namespace (its own address, reached over a bridge: separate hosts on one machine); signals
//! to freeze or kill them; and a load of concurrent streamed `Generate` calls that records every token and when it
//! came.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use strata_proto::pb;
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_testkit::{EtcdServer, Process, free_port, workspace_bin};
use tokio::sync::Notify;
use tonic::transport::Channel;

use crate::netns::Network;

/// Concurrent streams of a [`load`].
pub const STREAMS: usize = 16;

/// Coordinator flags of every test cluster: a hung stage is found by keep-alive within ~3 s or by the batch
/// deadline, and a suspect stays out of placement for the whole test.
const COORDINATOR_FLAGS: [&str; 10] = [
    "--batch-timeout-ms",
    "8000",
    "--probe-timeout-ms",
    "1000",
    "--suspect-ms",
    "120000",
    "--lease-ttl-secs",
    "2",
    "--min-kv-tokens",
    "4096",
];

/// A coordinator process and its addresses.
pub struct CoordinatorProcess {
    /// `http://127.0.0.1:PORT` of its gRPC API.
    pub url: String,
    /// `127.0.0.1:PORT` of its HTTP API.
    pub http: String,
    /// The process.
    pub process: Process,
}

/// etcd, workers and coordinators, each a real process.
pub struct ProcessCluster {
    /// The etcd server.
    pub etcd: EtcdServer,
    /// (node id, process) of every worker started.
    pub workers: Vec<(String, Process)>,
    /// Every coordinator started, in start order.
    pub coordinators: Vec<CoordinatorProcess>,
    /// The namespaces the workers run in (worker `i` in host `i`), if any. Dropped last: after the processes.
    pub network: Option<Network>,
    /// Environment variables given to every worker and coordinator started from now on.
    pub env: Vec<(String, String)>,
    model: PathBuf,
}

impl ProcessCluster {
    /// Starts etcd, workers `w0..w{workers-1}` and `coordinators` coordinators, and waits until a plan with
    /// `workers` stages is served.
    pub async fn start(model: &Path, workers: usize, coordinators: usize) -> Result<Self> {
        Self::start_with(model, workers, coordinators, None).await
    }

    /// Like [`ProcessCluster::start`], worker `i` running in `network`'s namespace `i` (etcd listens on the
    /// bridge).
    pub async fn start_in(model: &Path, workers: usize, coordinators: usize, network: Network) -> Result<Self> {
        Self::start_with(model, workers, coordinators, Some(network)).await
    }

    /// Like [`ProcessCluster::start`], on `etcd` (secured, say), every process started with `env` (the etcd TLS
    /// and user settings it needs, say).
    pub async fn start_on_etcd(
        model: &Path,
        workers: usize,
        coordinators: usize,
        etcd: EtcdServer,
        env: Vec<(String, String)>,
    ) -> Result<Self> {
        let cluster = ProcessCluster {
            etcd,
            workers: Vec::new(),
            coordinators: Vec::new(),
            network: None,
            env,
            model: model.into(),
        };
        cluster.launch(workers, coordinators).await
    }

    async fn start_with(model: &Path, workers: usize, coordinators: usize, network: Option<Network>) -> Result<Self> {
        // With a network, etcd gets an address of its own on the bridge, so one namespace can lose etcd alone.
        let etcd = match &network {
            Some(net) => EtcdServer::start_on(&net.add_root_address(2)?)?,
            None => EtcdServer::start()?,
        };
        let cluster = ProcessCluster {
            etcd,
            workers: Vec::new(),
            coordinators: Vec::new(),
            network,
            env: Vec::new(),
            model: model.into(),
        };
        cluster.launch(workers, coordinators).await
    }

    /// Starts the workers and coordinators and waits for the plan of `workers` stages.
    async fn launch(mut self, workers: usize, coordinators: usize) -> Result<Self> {
        for i in 0..workers {
            self.add_worker(&format!("w{i}"))?;
        }
        for _ in 0..coordinators {
            self.add_coordinator(&[&format!("--min-stages={workers}")])?;
        }
        if coordinators > 0 {
            self.wait_for_stages(workers).await.with_context(|| self.logs())?;
        }
        Ok(self)
    }

    /// Starts a worker `id` (1 thread, 256 KV blocks), in the next free namespace when there is a network.
    pub fn add_worker(&mut self, id: &str) -> Result<()> {
        self.add_worker_with(id, &["--kv-blocks", "256"])
    }

    /// Starts a worker `id` with 1 thread and `extra` flags, in the next free namespace when there is a network.
    pub fn add_worker_with(&mut self, id: &str, extra: &[&str]) -> Result<()> {
        let bin = workspace_bin("stage-worker")?;
        let (mut cmd, host) = match &self.network {
            Some(net) => {
                let i = self.workers.len();
                (net.command(i, &bin)?, net.hosts.get(i).context("no free namespace")?.addr.clone())
            }
            None => (Command::new(bin), "127.0.0.1".to_owned()),
        };
        cmd.args(["--etcd", &self.etcd.endpoint(), "--cluster", "faults", "--node-id", id])
            .args(["--listen", &format!("{host}:{}", free_port()?), "--threads", "1"])
            .args(extra)
            .arg("--model")
            .arg(&self.model)
            .env("STRATA_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        self.workers.push((id.to_owned(), Process::spawn(id, cmd)?));
        Ok(())
    }

    /// Starts a coordinator with `extra` flags; returns its index.
    pub fn add_coordinator(&mut self, extra: &[&str]) -> Result<usize> {
        self.add_coordinator_in(None, extra)
    }

    /// Starts a coordinator with `extra` flags in the network's namespace `host` (or the root namespace); returns
    /// its index.
    pub fn add_coordinator_in(&mut self, host: Option<usize>, extra: &[&str]) -> Result<usize> {
        let bin = workspace_bin("coordinator")?;
        let (mut cmd, addr) = match (host, &self.network) {
            (Some(i), Some(net)) => {
                (net.command(i, &bin)?, net.hosts.get(i).context("no such namespace")?.addr.clone())
            }
            (Some(_), None) => bail!("a coordinator in a namespace needs a network"),
            (None, _) => (Command::new(bin), "127.0.0.1".to_owned()),
        };
        let grpc = format!("{addr}:{}", free_port()?);
        let http = format!("{addr}:{}", free_port()?);
        let index = self.coordinators.len();
        cmd.args(["--etcd", &self.etcd.endpoint(), "--cluster", "faults", "--grpc", &grpc, "--http", &http])
            .args(COORDINATOR_FLAGS)
            .args(extra)
            .arg(format!("--candidate=coordinator-{index}"))
            .arg("--model")
            .arg(&self.model)
            .env("STRATA_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        let process = Process::spawn(&format!("coordinator-{index}"), cmd)?;
        self.coordinators.push(CoordinatorProcess { url: format!("http://{grpc}"), http, process });
        Ok(index)
    }

    /// The leader's index: the coordinator whose `ClusterStatus` shows a plan with stages.
    pub async fn leader(&self) -> Result<usize> {
        for (i, c) in self.coordinators.iter().enumerate() {
            if let Ok(s) = status(&c.url).await
                && !s.stages.is_empty()
            {
                return Ok(i);
            }
        }
        bail!("no coordinator leads")
    }

    /// Waits until some coordinator serves a plan of `n` stages, all READY with the plan loaded; returns it.
    pub async fn wait_for_stages(&self, n: usize) -> Result<pb::ClusterStatusResponse> {
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            for c in &self.coordinators {
                if let Ok(s) = status(&c.url).await
                    && s.stages.len() == n
                    && s.stages.iter().all(|st| stage_loaded(&s, st))
                {
                    return Ok(s);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("no plan of {n} served stages within 90 s")
    }

    /// The worker process holding stage `index` of the served plan of `stages` stages.
    pub async fn stage_process(&mut self, stages: usize, index: usize) -> Result<&mut Process> {
        let s = self.wait_for_stages(stages).await?;
        let id = s.stages.get(index).context("no such stage")?.node_id.clone();
        self.workers.iter_mut().find(|(name, _)| *name == id).map(|(_, p)| p).context("stage is not a worker")
    }

    /// The position of worker `id` among the workers (= its namespace, with a network).
    pub fn worker_index(&self, id: &str) -> Option<usize> {
        self.workers.iter().position(|(name, _)| name == id)
    }

    /// Every process's output, for failure messages.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        for c in &self.coordinators {
            all.push_str(&format!("\n{}:\n{}", c.url, c.process.output()));
        }
        for (id, w) in &self.workers {
            all.push_str(&format!("\nworker {id}:\n{}", w.output()));
        }
        all
    }
}

fn stage_loaded(s: &pb::ClusterStatusResponse, st: &pb::StageInfo) -> bool {
    s.nodes.iter().any(|node| {
        node.node_id == st.node_id
            && node.state == pb::NodeState::Ready as i32
            && node.plan_epoch_loaded >= s.plan_epoch
    })
}

/// `ClusterStatus` of the coordinator at `url`.
pub async fn status(url: &str) -> Result<pb::ClusterStatusResponse> {
    let mut client = CoordinatorClient::connect(url.to_owned()).await?;
    Ok(client.cluster_status(pb::ClusterStatusRequest {}).await?.into_inner())
}

/// Sends `signal` (`-KILL`, `-STOP`, `-CONT`, `-TERM`) to `process`.
pub fn signal(process: &Process, signal: &str) -> Result<()> {
    signal_pid(process.id(), signal)
}

/// Sends `signal` to process `pid`.
pub fn signal_pid(pid: u32, signal: &str) -> Result<()> {
    let status = Command::new("kill").args([signal, &pid.to_string()]).status()?;
    ensure!(status.success(), "kill {signal} {pid} failed");
    Ok(())
}

/// Request `i`: a distinct prompt, greedy for even `i`, seeded sampling for odd `i`, `max_tokens` tokens exactly.
pub fn request(i: usize, max_tokens: u32) -> pb::GenerateRequest {
    let sampling = (i % 2 == 1).then(|| pb::SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(1000 + i as u64),
        ..Default::default()
    });
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(format!("Story {i}: once upon a time, a"))),
        max_tokens,
        sampling,
        ignore_eos: true,
        ..Default::default()
    }
}

/// One stream's tokens and when each arrived.
#[derive(Debug, Default)]
pub struct Stream {
    /// Token ids, in order.
    pub tokens: Vec<u32>,
    /// When each arrived.
    pub arrivals: Vec<Instant>,
}

/// Runs [`STREAMS`] requests through `url`; `producing` is notified once every stream has at least 2 tokens.
pub async fn load(url: String, max_tokens: u32, producing: Arc<Notify>) -> Result<Vec<Result<Stream, tonic::Status>>> {
    let channel = Channel::from_shared(url)?.connect().await?;
    let started = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..STREAMS {
        let mut client = CoordinatorClient::new(channel.clone());
        let (started, producing) = (started.clone(), producing.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Stream::default();
            let mut stream = client.generate(request(i, max_tokens)).await?.into_inner();
            while let Some(msg) = stream.message().await? {
                for &t in &msg.token_ids {
                    out.tokens.push(t);
                    out.arrivals.push(Instant::now());
                    if out.tokens.len() == 2 && started.fetch_add(1, Ordering::SeqCst) + 1 == STREAMS {
                        producing.notify_one();
                    }
                }
            }
            Ok::<_, tonic::Status>(out)
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(tokio::time::timeout(Duration::from_secs(120), t).await.context("a stream hung")??);
    }
    Ok(results)
}
