//! One chaos scenario from start to end: the cluster (started, or attached), the baseline wave, the wave with
//! the fault, lifting the fault, the wave after it, and the report.

use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use strata_proto::pb;
use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;

use super::cluster::{self, ClusterSpec, ProcessCluster};
use super::load::{self, Load, LoadOptions, StreamRecord, Targets};
use super::report::{ScenarioReport, Wave, timing};
use super::{ChaosArgs, procs, retry_budget};
use crate::http;
use crate::{connect, drain};

/// How long the plan must stay unchanged (and no node JOINING or DRAINING) before the after wave.
const SETTLE: Duration = Duration::from_secs(3);

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// No fault: the control.
    None,
    /// `kill -9` the worker of the first stage.
    CrashFirst,
    /// `kill -9` the worker of the middle stage.
    CrashMiddle,
    /// `kill -9` the worker of the last stage.
    CrashLast,
    /// SIGSTOP the middle stage's worker (a hang); SIGCONT after the wave.
    Hang,
    /// Drain the middle stage's node through the coordinator's `DrainNode`.
    Drain,
    /// Start one more stage worker.
    Join,
    /// SIGSTOP etcd for --etcd-pause-secs.
    EtcdPause,
    /// `kill -9` the leader coordinator; a standby is running and clients retry on it.
    CoordinatorFailover,
}

impl Scenario {
    /// Every scenario, the control first.
    pub const ALL: [Scenario; 9] = [
        Scenario::None,
        Scenario::CrashFirst,
        Scenario::CrashMiddle,
        Scenario::CrashLast,
        Scenario::Hang,
        Scenario::Drain,
        Scenario::Join,
        Scenario::EtcdPause,
        Scenario::CoordinatorFailover,
    ];

    /// Whether it can run against an attached cluster (no processes of ours to start or signal).
    pub fn attachable(self) -> bool {
        matches!(self, Scenario::None | Scenario::Drain)
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use clap::ValueEnum;
        let name = self.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default();
        f.write_str(&name)
    }
}

/// What was injected, and what to undo after the wave.
enum Lift {
    Nothing,
    /// SIGCONT this worker after the wave.
    ResumeWorker(String),
    /// Wait for this node's drain to finish (and uncordon it when attached).
    Drained(String),
    /// Note whether this node joined the plan.
    Joined(String),
}

/// The cluster a scenario runs against.
enum Target {
    Owned(Box<ProcessCluster>),
    Attached { grpc: String, targets: Targets },
}

impl Target {
    /// The serving coordinator's gRPC URL.
    async fn serving_url(&self) -> Result<String> {
        match self {
            Target::Owned(c) => {
                let leader = if c.coordinators.len() > 1 { c.leader().await? } else { 0 };
                Ok(c.coordinators[leader].grpc_url.clone())
            }
            Target::Attached { grpc, .. } => Ok(grpc.clone()),
        }
    }

    /// Load targets, the leader first.
    async fn targets(&self) -> Result<Targets> {
        match self {
            Target::Owned(c) => {
                let leader = if c.coordinators.len() > 1 { c.leader().await? } else { 0 };
                c.targets(leader)
            }
            Target::Attached { targets, .. } => Ok(targets.clone()),
        }
    }
}

async fn wave(targets: &Targets, a: &ChaosArgs, opts: LoadOptions) -> Vec<StreamRecord> {
    Load::start(targets, &load::specs(a.streams), opts).finish().await
}

/// Runs scenario `s`; processes log under `log_dir`.
pub async fn run(a: &ChaosArgs, s: Scenario, bin_dir: Option<&Path>, log_dir: &Path) -> Result<ScenarioReport> {
    let mut target = match (&a.coordinator, bin_dir, &a.model) {
        (Some(url), _, _) => {
            let http = a.http.as_deref().context("--coordinator needs --http")?;
            let endpoint = Endpoint::from_shared(url.clone())?;
            let targets = Targets { grpc: vec![(url.clone(), endpoint)], http: vec![http::addr_of(http)?] };
            Target::Attached { grpc: url.clone(), targets }
        }
        (None, Some(bin_dir), Some(model)) => {
            let spec = ClusterSpec {
                model: model.clone(),
                bin_dir: bin_dir.to_path_buf(),
                workers: a.workers,
                threads: a.threads,
                kv_blocks: a.kv_blocks,
                standby: a.standby || s == Scenario::CoordinatorFailover,
                worker_args: a.worker_args.clone(),
                coordinator_args: a.coordinator_args.clone(),
            };
            let started = Instant::now();
            let c = ProcessCluster::start(spec, log_dir).await?;
            eprintln!("cluster up in {:.1} s (logs in {})", started.elapsed().as_secs_f64(), log_dir.display());
            Target::Owned(Box::new(c))
        }
        _ => bail!("pass --model (or --coordinator to attach to a running cluster)"),
    };
    let mut report = ScenarioReport { scenario: s.to_string(), ..ScenarioReport::default() };
    let deadline = Duration::from_secs(a.deadline_secs);
    let plain = LoadOptions { max_tokens: a.max_tokens, deadline, retry: None };

    let targets = target.targets().await?;
    let baseline = wave(&targets, a, plain).await;
    report.baseline = Wave::of(&baseline, &baseline);
    eprintln!("baseline: {}/{} completed", report.baseline.completed, report.baseline.sent);
    if report.baseline.failed > 0 {
        report.notes.push("FAILED: the undisturbed baseline did not complete; nothing to compare with".into());
        report.streams.baseline = baseline;
        report.judge();
        return Ok(report);
    }

    let url = target.serving_url().await?;
    let before = cluster::status(&url).await.context("ClusterStatus before the fault")?;
    let mut load = Load::start(&targets, &load::specs(a.streams), LoadOptions { retry: retry_budget(a, s), ..plain });
    if !load.producing(Duration::from_secs(60)).await {
        report.notes.push(format!("not every stream had {} tokens after 60 s; injecting anyway", load::TRIGGER_TOKENS));
    }
    let fault_at = load.start.elapsed().as_secs_f64();
    let started = load.start;
    let (what, lift) = inject(&mut target, s, &before, a).await?;
    report.fault = format!("{what} at +{fault_at:.2} s");
    eprintln!("fault: {}", report.fault);

    // The wave, the plan watcher and (for etcd-pause) the timed SIGCONT run side by side.
    let stop = CancellationToken::new();
    let urls: Vec<String> = targets.grpc.iter().map(|(u, _)| u.clone()).collect();
    let etcd_pid = match (&target, s) {
        (Target::Owned(c), Scenario::EtcdPause) => Some(c.etcd.proc.pid()),
        _ => None,
    };
    let finish = async {
        let records = load.finish().await;
        stop.cancel();
        records
    };
    let resume_etcd = async {
        if let Some(pid) = etcd_pid {
            tokio::time::sleep(Duration::from_secs(a.etcd_pause_secs)).await;
            let r = procs::signal(pid, "CONT");
            (Some(started.elapsed().as_secs_f64()), r.err())
        } else {
            (None, None)
        }
    };
    let (records, epochs, (resumed_at, resume_err)) =
        tokio::join!(finish, watch_epochs(&urls, (before.plan_epoch, fault_at), started, &stop), resume_etcd);
    if let Some(at) = resumed_at {
        report.fault.push_str(&format!("; SIGCONT etcd at +{at:.2} s"));
    }
    if let Some(e) = resume_err {
        report.notes.push(format!("FAILED to resume etcd: {e:#}"));
    }
    report.plan = epochs;
    report.run = Wave::of(&baseline, &records);
    report.timing = timing(&records, fault_at);
    eprintln!("run: {}/{} completed, {} identical", report.run.completed, report.run.sent, report.run.identical);

    lift_fault(&mut target, lift, &mut report, started).await;

    // The same requests once the fault is over: the cluster must serve again, with the same tokens.
    let after_url = target.serving_url().await.unwrap_or(url);
    match cluster::wait_serving(&after_url, Duration::from_secs(a.recovery_secs), SETTLE, |_| true).await {
        Ok(_) => {
            let after = wave(&target.targets().await?, a, plain).await;
            report.after = Some(Wave::of(&baseline, &after));
            report.streams.after = after;
        }
        Err(e) => report.notes.push(format!("FAILED: the cluster did not serve again after the fault: {e:#}")),
    }
    if let (Target::Owned(c), false) = (&target, report.run.clean()) {
        tracing::debug!("process logs at the end of {s}:\n{}", c.tails(15));
    }
    report.streams.baseline = baseline;
    report.streams.run = records;
    report.judge();
    Ok(report)
}

/// The stage a crash, hang or drain hits, with its description.
fn pick(before: &pb::ClusterStatusResponse, s: Scenario) -> Result<(String, String)> {
    let n = before.stages.len();
    if n == 0 {
        bail!("the plan has no stages");
    }
    let i = match s {
        Scenario::CrashFirst => 0,
        Scenario::CrashLast => n - 1,
        _ => n / 2,
    };
    let st = &before.stages[i];
    let what = format!(
        "{} (stage {} of {n}, layers {}..{}, plan epoch {})",
        st.node_id, st.index, st.layer_start, st.layer_end, before.plan_epoch
    );
    Ok((st.node_id.clone(), what))
}

fn owned(t: &mut Target, s: Scenario) -> Result<&mut ProcessCluster> {
    match t {
        Target::Owned(c) => Ok(c.as_mut()),
        Target::Attached { .. } => bail!("{s} needs a cluster of processes started by strata chaos"),
    }
}

async fn inject(
    target: &mut Target,
    s: Scenario,
    before: &pb::ClusterStatusResponse,
    a: &ChaosArgs,
) -> Result<(String, Lift)> {
    Ok(match s {
        Scenario::None => ("nothing (control)".into(), Lift::Nothing),
        Scenario::CrashFirst | Scenario::CrashMiddle | Scenario::CrashLast | Scenario::Hang => {
            let (id, what) = pick(before, s)?;
            let proc = owned(target, s)?.worker_mut(&id).with_context(|| format!("no process for node {id}"))?;
            if s == Scenario::Hang {
                proc.pause()?;
                (format!("SIGSTOP {what}"), Lift::ResumeWorker(id))
            } else {
                proc.kill9();
                (format!("kill -9 {what}"), Lift::Nothing)
            }
        }
        Scenario::Drain => {
            let (id, what) = pick(before, s)?;
            let url = target.serving_url().await?;
            let mut client = connect::connect(&Endpoint::from_shared(url.clone())?).await?;
            let r = client.drain_node(pb::NodeRequest { node_id: id.clone() }).await?.into_inner();
            let state = crate::cluster::state_name(r.state);
            (format!("DrainNode {what} -> {state}, plan epoch {}", r.plan_epoch), Lift::Drained(id))
        }
        Scenario::Join => {
            let id = owned(target, s)?.add_worker()?;
            (format!("started stage worker {id}"), Lift::Joined(id))
        }
        Scenario::EtcdPause => {
            owned(target, s)?.etcd.proc.pause()?;
            (format!("SIGSTOP etcd for {} s", a.etcd_pause_secs), Lift::Nothing)
        }
        Scenario::CoordinatorFailover => {
            let c = owned(target, s)?;
            let leader = c.leader().await?;
            let proc = &mut c.coordinators[leader].proc;
            let what = format!("kill -9 {} (the leader, pid {})", proc.name(), proc.pid());
            proc.kill9();
            (what, Lift::Nothing)
        }
    })
}

async fn lift_fault(target: &mut Target, lift: Lift, report: &mut ScenarioReport, t0: Instant) {
    match lift {
        Lift::Nothing => {}
        Lift::ResumeWorker(id) => {
            if let Target::Owned(c) = target
                && let Some(p) = c.worker_mut(&id)
            {
                match p.resume() {
                    Ok(()) => report.fault.push_str(&format!("; SIGCONT {id} at +{:.2} s", t0.elapsed().as_secs_f64())),
                    Err(e) => report.notes.push(format!("FAILED to resume {id}: {e:#}")),
                }
            }
        }
        Lift::Drained(id) => {
            let url = target.serving_url().await.unwrap_or_default();
            let client = async { anyhow::Ok(connect::connect(&Endpoint::from_shared(url.clone())?).await?) };
            let mut client = match client.await {
                Ok(c) => c,
                Err(e) => {
                    report.notes.push(format!("FAILED to reach the coordinator after the drain: {e:#}"));
                    return;
                }
            };
            report.notes.push(match drain::wait_drained(&mut client, &id, Duration::from_secs(60), |_| {}).await {
                Ok(took) => format!("the drain of {id} finished {:.1} s after the wave", took.as_secs_f64()),
                Err(e) => format!("the drain did not finish: {e:#}"),
            });
            // An attached cluster is someone else's: give the node back whatever the drain did.
            if let Target::Attached { .. } = target
                && let Err(e) = client.uncordon_node(pb::NodeRequest { node_id: id.clone() }).await
            {
                report.notes.push(format!("FAILED to uncordon {id} afterwards: {e}"));
            }
        }
        Lift::Joined(id) => {
            let url = target.serving_url().await.unwrap_or_default();
            let joined = cluster::wait_serving(&url, Duration::from_secs(60), Duration::ZERO, |s| {
                s.stages.iter().any(|st| st.node_id == id)
            });
            report.notes.push(match joined.await {
                Ok(s) => format!("{id} is a stage of plan epoch {} ({} stages)", s.plan_epoch, s.stages.len()),
                Err(e) => format!("{id} did not join the plan: {e:#}"),
            });
        }
    }
}

/// Polls `ClusterStatus` (the first URL that answers) every 250 ms until `stop`; returns the plan epochs seen
/// since `first` (the epoch before the fault, and when), as `3 → 4 (+2.1 s)`.
async fn watch_epochs(urls: &[String], first: (u64, f64), t0: Instant, stop: &CancellationToken) -> String {
    let mut seen: Vec<(u64, f64)> = vec![first];
    let mut clients = Vec::new();
    for u in urls {
        if let Ok(e) = Endpoint::from_shared(u.clone()) {
            clients.push(e);
        }
    }
    loop {
        for e in &clients {
            let ask = async {
                let mut c = connect::connect(e).await?;
                anyhow::Ok(c.cluster_status(pb::ClusterStatusRequest {}).await?.into_inner().plan_epoch)
            };
            if let Ok(Ok(epoch)) = tokio::time::timeout(Duration::from_secs(2), ask).await {
                // Epoch 0: this coordinator knows no plan yet (a standby before it leads); ask the next one.
                if epoch == 0 {
                    continue;
                }
                if seen.last().is_none_or(|(e, _)| *e != epoch) {
                    seen.push((epoch, t0.elapsed().as_secs_f64()));
                }
                break;
            }
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    let mut out = first.0.to_string();
    for (epoch, at) in &seen[1..] {
        out.push_str(&format!(" → {epoch} (+{at:.1} s)"));
    }
    out
}
