//! A real cluster of processes: etcd, three `stage-worker` processes and a `coordinator` process, driven with
//! the `strata` CLI. Greedy output equals the single-process `strata generate`; a worker that joins raises the
//! plan epoch and gets layers; a drained worker leaves; a killed worker is a clear error, then replanned
//! around; etcd unreachable at start is a clear error after retries.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use strata_proto::pb;
use strata_testkit::{EtcdServer, Process, free_port, smollm2, workspace_bin};
use strata_tests::processes::status;

const PROMPT: [&str; 6] = ["--prompt", "The capital of France is", "--max-tokens", "6", "--format", "json"];

fn strata(args: &[&str]) -> Result<std::process::Output> {
    Ok(Command::new(workspace_bin("strata")?).args(args).output()?)
}

fn json(out: &std::process::Output, what: &str) -> Result<serde_json::Value> {
    ensure!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).with_context(|| format!("{what}: stdout is not one JSON object"))
}

fn worker(etcd: &EtcdServer, model: &Path, id: &str) -> Result<Process> {
    let mut cmd = Command::new(workspace_bin("stage-worker")?);
    cmd.args(["--etcd", &etcd.endpoint(), "--cluster", "procs", "--node-id", id])
        .args(["--listen", &format!("127.0.0.1:{}", free_port()?), "--threads", "1", "--kv-blocks", "64"])
        .arg("--model")
        .arg(model)
        .env("RUST_LOG", "info");
    Process::spawn(id, cmd)
}

/// Waits until the plan satisfies `ok` and every one of its stages is READY with that plan loaded (so the data
/// path serves it).
async fn served_plan(
    url: &str,
    what: &str,
    ok: impl Fn(&pb::ClusterStatusResponse) -> bool,
) -> Result<pb::ClusterStatusResponse> {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut last = None;
    while Instant::now() < deadline {
        if let Ok(s) = status(url).await {
            let loaded = |st: &pb::StageInfo| {
                s.nodes.iter().any(|n| {
                    n.node_id == st.node_id
                        && n.state == pb::NodeState::Ready as i32
                        && n.plan_epoch_loaded >= s.plan_epoch
                })
            };
            if !s.stages.is_empty() && s.stages.iter().all(loaded) && ok(&s) {
                return Ok(s);
            }
            last = Some(s);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("{what}: not reached within 90 s; last status {last:?}")
}

fn stage_ids(s: &pb::ClusterStatusResponse) -> Vec<String> {
    s.stages.iter().map(|st| st.node_id.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cluster_of_processes_serves_joins_drains_and_survives_a_dead_worker() -> Result<()> {
    let model = smollm2();
    let m = model.to_str().context("model path is not UTF-8")?;
    let mut single = vec!["generate", "--model", m, "--threads", "1"];
    single.extend_from_slice(&PROMPT);
    let reference = json(&strata(&single)?, "strata generate")?;
    ensure!(reference["text"].as_str().is_some_and(|t| t.starts_with(" Paris")), "{reference}");

    let etcd = EtcdServer::start()?;
    let mut workers: Vec<Process> =
        ["w0", "w1", "w2"].iter().map(|id| worker(&etcd, &model, id)).collect::<Result<_>>()?;
    let grpc = format!("127.0.0.1:{}", free_port()?);
    let mut cmd = Command::new(workspace_bin("coordinator")?);
    cmd.args(["--etcd", &etcd.endpoint(), "--cluster", "procs", "--model", m, "--grpc", &grpc])
        .args(["--http", &format!("127.0.0.1:{}", free_port()?), "--min-stages", "3", "--model-name", "smol"])
        .args(["--min-kv-tokens", "1024"])
        .env("RUST_LOG", "info");
    let coordinator = Process::spawn("coordinator", cmd)?;
    let url = format!("http://{grpc}");
    let generate = || -> Result<serde_json::Value> {
        let mut args = vec!["client", "generate", "--coordinator", url.as_str(), "--wait", "60"];
        args.extend_from_slice(&PROMPT);
        json(&strata(&args)?, "strata client generate")
    };
    let same = |remote: &serde_json::Value, when: &str| -> Result<()> {
        for key in ["prompt_ids", "token_ids", "text", "finish_reason"] {
            ensure!(remote[key] == reference[key], "{when}: {key} differs: {remote} vs {reference}");
        }
        Ok(())
    };
    let logs = |workers: &[Process]| {
        let mut all = format!("coordinator:\n{}", coordinator.output());
        for w in workers {
            all.push_str(&format!("\nworker {}:\n{}", w.id(), w.output()));
        }
        all
    };

    // Three workers, one plan: three stages covering every layer, same tokens as one process.
    let s = served_plan(&url, "first plan", |s| s.stages.len() == 3).await.with_context(|| logs(&workers))?;
    ensure!(s.model == "smol", "--model-name is the served name: {}", s.model);
    // The stages' own facts reach ClusterStatus: every worker has the 64 KV blocks it was started with.
    ensure!(s.nodes.iter().all(|n| n.kv_total_blocks == 64 && n.kv_free_blocks <= 64), "{:?}", s.nodes);
    let first_epoch = s.plan_epoch;
    same(&generate()?, "3 stages")?;

    // A fourth worker joins: a new epoch gives it layers.
    workers.push(worker(&etcd, &model, "w3")?);
    let s = served_plan(&url, "join", |s| s.plan_epoch > first_epoch && stage_ids(s).contains(&"w3".to_owned()))
        .await
        .with_context(|| logs(&workers))?;
    ensure!(s.stages.len() == 4, "{s:?}");
    same(&generate()?, "after w3 joined")?;

    // Drain w1: its layers move, it ends CORDONED, requests still succeed.
    let out = strata(&["nodes", "drain", "w1", "--coordinator", &url])?;
    ensure!(out.status.success(), "drain: {}", String::from_utf8_lossy(&out.stderr));
    let join_epoch = s.plan_epoch;
    let s = served_plan(&url, "drain", |s| {
        s.plan_epoch > join_epoch
            && !stage_ids(s).contains(&"w1".to_owned())
            && s.nodes.iter().any(|n| n.node_id == "w1" && n.state == pb::NodeState::Cordoned as i32)
    })
    .await
    .with_context(|| logs(&workers))?;
    same(&generate()?, "after draining w1")?;

    // Kill the middle stage's process: requests fail fast with a clear error (no hang) until its lease
    // expires and the coordinator replans around it; then the tokens are the same again.
    let victim = s.stages[1].node_id.clone();
    let index = ["w0", "w1", "w2", "w3"].iter().position(|w| *w == victim).context("victim is a worker")?;
    workers[index].kill();
    let started = Instant::now();
    let mut args = vec!["client", "generate", "--coordinator", url.as_str(), "--wait", "0"];
    args.extend_from_slice(&PROMPT);
    let out = strata(&args)?;
    ensure!(started.elapsed() < Duration::from_secs(20), "a dead stage took {:?} to report", started.elapsed());
    eprintln!(
        "generate with {victim} dead: {} after {:?}: {}",
        out.status,
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(err.contains("navailable") || err.contains("stage"), "unclear error for a dead stage: {err}");
    }
    let drain_epoch = s.plan_epoch;
    let s = served_plan(&url, "replan after a dead worker", |s| {
        s.plan_epoch > drain_epoch && !stage_ids(s).contains(&victim)
    })
    .await
    .with_context(|| logs(&workers))?;
    ensure!(s.stages.len() == 2, "{s:?}");
    same(&generate()?, "after a worker died")?;
    Ok(())
}

#[test]
fn etcd_unreachable_at_start_is_a_clear_error_after_retries() -> Result<()> {
    let model = smollm2();
    let dead = format!("http://127.0.0.1:{}", free_port()?);
    let mut cmd = Command::new(workspace_bin("coordinator")?);
    cmd.args(["--etcd", &dead, "--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--connect-timeout-ms", "1500"])
        .arg("--model")
        .arg(&model);
    let mut coordinator = Process::spawn("coordinator", cmd)?;
    let mut cmd = Command::new(workspace_bin("stage-worker")?);
    cmd.args(["--etcd", &dead, "--node-id", "w", "--listen", "127.0.0.1:0", "--connect-timeout-ms", "1500"])
        .arg("--model")
        .arg(&model);
    let mut worker = Process::spawn("stage-worker", cmd)?;
    for p in [&mut coordinator, &mut worker] {
        let status = p.wait_exit(Duration::from_secs(30))?;
        let out = p.output();
        ensure!(!status.success(), "started without etcd: {out}");
        ensure!(out.contains("etcd unreachable") && out.contains(&dead), "no clear error: {out}");
        ensure!(out.contains("not reachable yet"), "no retries logged: {out}");
    }
    Ok(())
}
