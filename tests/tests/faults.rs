//! Faults and membership changes under load with real processes: etcd, three `stage-worker` processes and a
//! `coordinator` process, 16 concurrent streamed `Generate` calls (half greedy, half seeded sampling). Once every
//! stream is producing tokens a stage is killed with SIGKILL (first, middle or last), frozen with SIGSTOP, drained,
//! or a fourth worker joins: every request still completes, with exactly the tokens of an undisturbed run and no
//! error. A failure is seen at once (a failed batch, a broken stream, keep-alive or the batch deadline, not the
//! lease), the stage is planned around and the sequences are recomputed.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use strata_proto::pb;
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_testkit::{EtcdServer, Process, free_port, smollm2, workspace_bin};
use tokio::sync::Notify;
use tonic::transport::Channel;

const STREAMS: usize = 16;

struct Cluster {
    _etcd: EtcdServer,
    /// (node id, process)
    workers: Vec<(String, Process)>,
    coordinator: Process,
    url: String,
}

impl Cluster {
    async fn start(model: &Path) -> Result<Self> {
        let etcd = EtcdServer::start()?;
        let mut workers = Vec::new();
        for id in ["w0", "w1", "w2"] {
            workers.push((id.to_owned(), worker(&etcd.endpoint(), model, id)?));
        }
        let grpc = format!("127.0.0.1:{}", free_port()?);
        let mut cmd = Command::new(workspace_bin("coordinator")?);
        cmd.args(["--etcd", &etcd.endpoint(), "--cluster", "faults", "--grpc", &grpc])
            .args(["--http", &format!("127.0.0.1:{}", free_port()?), "--min-stages", "3"])
            // A hung stage is found by keep-alive within ~3 s, or by the batch deadline.
            .args(["--batch-timeout-ms", "8000", "--probe-timeout-ms", "1000", "--suspect-ms", "120000"])
            .arg("--model")
            .arg(model)
            .env("STRATA_LOG", "info");
        let coordinator = Process::spawn("coordinator", cmd)?;
        let cluster = Cluster { _etcd: etcd, workers, coordinator, url: format!("http://{grpc}") };
        cluster.wait_for_stages(3).await.with_context(|| cluster.logs())?;
        Ok(cluster)
    }

    /// Waits until the plan has `n` stages, all READY with the plan loaded.
    async fn wait_for_stages(&self, n: usize) -> Result<pb::ClusterStatusResponse> {
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if let Ok(mut client) = CoordinatorClient::connect(self.url.clone()).await
                && let Ok(s) = client.cluster_status(pb::ClusterStatusRequest {}).await
            {
                let s = s.into_inner();
                let loaded = |st: &pb::StageInfo| {
                    s.nodes.iter().any(|node| {
                        node.node_id == st.node_id
                            && node.state == pb::NodeState::Ready as i32
                            && node.plan_epoch_loaded >= s.plan_epoch
                    })
                };
                if s.stages.len() == n && s.stages.iter().all(loaded) {
                    return Ok(s);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("no plan of {n} served stages within 90 s")
    }

    /// The worker process holding stage `index` of the current plan.
    async fn stage_process(&mut self, index: usize) -> Result<&mut Process> {
        let s = self.wait_for_stages(3).await?;
        let id = s.stages.get(index).context("no such stage")?.node_id.clone();
        self.workers.iter_mut().find(|(name, _)| *name == id).map(|(_, p)| p).context("stage is not one of the workers")
    }

    fn logs(&self) -> String {
        let mut all = format!("coordinator:\n{}", self.coordinator.output());
        for (id, w) in &self.workers {
            all.push_str(&format!("\nworker {id}:\n{}", w.output()));
        }
        all
    }
}

fn worker(etcd: &str, model: &Path, id: &str) -> Result<Process> {
    let mut cmd = Command::new(workspace_bin("stage-worker")?);
    cmd.args(["--etcd", etcd, "--cluster", "faults", "--node-id", id])
        .args(["--listen", &format!("127.0.0.1:{}", free_port()?), "--threads", "1", "--kv-blocks", "256"])
        .arg("--model")
        .arg(model)
        .env("STRATA_LOG", "info");
    Process::spawn(id, cmd)
}

/// Request `i`: a distinct prompt, greedy for even `i`, seeded sampling for odd `i`.
fn request(i: usize, max_tokens: u32) -> pb::GenerateRequest {
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
struct Stream {
    tokens: Vec<u32>,
    arrivals: Vec<Instant>,
}

/// Runs the 16 requests; `producing` is notified once every stream has at least 2 tokens.
async fn load(url: String, max_tokens: u32, producing: Arc<Notify>) -> Result<Vec<Result<Stream, tonic::Status>>> {
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

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill(usize),
    Stop(usize),
    Drain(usize),
    Join,
}

/// Sends `signal` (`-KILL`, `-STOP`, `-CONT`) to `process`.
fn signal(process: &Process, signal: &str) -> Result<()> {
    let status = Command::new("kill").args([signal, &process.id().to_string()]).status()?;
    ensure!(status.success(), "kill {signal} {} failed", process.id());
    Ok(())
}

/// Starts a cluster, records an undisturbed run, then runs again with `fault` injected mid-generation and checks
/// that nothing was lost; returns the longest time from the fault to a stream's next token.
async fn survives(model: &Path, fault: Fault, max_tokens: u32) -> Result<(Cluster, Duration)> {
    let mut cluster = Cluster::start(model).await?;
    let baseline = load(cluster.url.clone(), max_tokens, Arc::new(Notify::new())).await?;
    let baseline: Vec<Vec<u32>> =
        baseline.into_iter().map(|r| r.map(|s| s.tokens)).collect::<Result<_, _>>().with_context(|| cluster.logs())?;
    ensure!(baseline.iter().all(|t| t.len() == max_tokens as usize), "{baseline:?}");

    let producing = Arc::new(Notify::new());
    let run = tokio::spawn(load(cluster.url.clone(), max_tokens, producing.clone()));
    tokio::time::timeout(Duration::from_secs(60), producing.notified()).await.context("streams never started")?;
    let at = Instant::now();
    match fault {
        Fault::Kill(i) | Fault::Stop(i) => {
            let sig = if matches!(fault, Fault::Kill(_)) { "-KILL" } else { "-STOP" };
            let victim = cluster.stage_process(i).await?;
            signal(victim, sig)?;
        }
        Fault::Drain(i) => {
            let s = cluster.wait_for_stages(3).await?;
            let node_id = s.stages.get(i).context("no such stage")?.node_id.clone();
            let mut client = CoordinatorClient::connect(cluster.url.clone()).await?;
            client.drain_node(pb::NodeRequest { node_id }).await?;
        }
        Fault::Join => {
            let etcd = cluster._etcd.endpoint();
            cluster.workers.push(("w3".to_owned(), worker(&etcd, model, "w3")?));
        }
    }
    eprintln!("{fault:?}: injected");
    if let Fault::Drain(_) | Fault::Join = fault {
        // The point is a plan change while the streams run: it must land before they end.
        let stages = if let Fault::Join = fault { 4 } else { 2 };
        cluster.wait_for_stages(stages).await.with_context(|| cluster.logs())?;
        ensure!(!run.is_finished(), "{fault:?}: the load ended before the new plan was served; make it longer");
    }
    let results = run.await?;
    if let Fault::Stop(_) = fault {
        // Resume it so that it exits cleanly (it has been planned out by now).
        for (_, w) in &cluster.workers {
            let _ = signal(w, "-CONT");
        }
    }
    let results = results.with_context(|| cluster.logs())?;
    let mut recovery = Duration::ZERO;
    for (i, (got, want)) in results.into_iter().zip(&baseline).enumerate() {
        let got = got.map_err(|e| anyhow::anyhow!("stream {i} failed under {fault:?}: {e}\n{}", cluster.logs()))?;
        ensure!(&got.tokens == want, "stream {i}: tokens differ under {fault:?}: {:?} vs {want:?}", got.tokens);
        if let Some(next) = got.arrivals.iter().find(|t| **t > at) {
            recovery = recovery.max(*next - at);
        }
    }
    eprintln!("{fault:?}: all {STREAMS} streams identical; longest wait for the next token {recovery:?}");
    Ok((cluster, recovery))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_first_middle_or_last_stage_loses_no_request_and_changes_no_token() -> Result<()> {
    let model = smollm2();
    for index in [0, 1, 2] {
        let (_, recovery) = survives(&model, Fault::Kill(index), 24).await?;
        // Found at once from the failed batch or broken stream; the rest is replanning and reloading.
        ensure!(recovery < Duration::from_secs(30), "stage {index}: {recovery:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_stage_is_detected_and_planned_around_without_losing_a_request() -> Result<()> {
    let (_, recovery) = survives(&smollm2(), Fault::Stop(1), 24).await?;
    ensure!(recovery < Duration::from_secs(30), "{recovery:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_a_stage_under_load_fails_nothing_and_leaves_it_empty() -> Result<()> {
    let (cluster, _) = survives(&smollm2(), Fault::Drain(1), 32).await?;
    // The drained node ends CORDONED, out of the plan, holding no KV.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut client = CoordinatorClient::connect(cluster.url.clone()).await?;
        let s = client.cluster_status(pb::ClusterStatusRequest {}).await?.into_inner();
        let drained: Vec<&pb::NodeInfo> =
            s.nodes.iter().filter(|n| n.state == pb::NodeState::Cordoned as i32).collect();
        if s.stages.len() == 2
            && drained.len() == 1
            && drained.iter().all(|n| n.kv_free_blocks == n.kv_total_blocks)
            && !s.stages.iter().any(|st| st.node_id == drained[0].node_id)
        {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "drain did not complete: {s:?}\n{}", cluster.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_joining_under_load_fails_nothing() -> Result<()> {
    let (cluster, _) = survives(&smollm2(), Fault::Join, 64).await?;
    let s = cluster.wait_for_stages(4).await.with_context(|| cluster.logs())?;
    ensure!(s.stages.iter().any(|st| st.node_id == "w3"), "{s:?}");
    Ok(())
}
