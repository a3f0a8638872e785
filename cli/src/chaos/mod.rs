//! `strata chaos`: fault injection under load. For each scenario it starts a real cluster of processes (etcd,
//! stage workers, coordinators; or attaches to a running coordinator for the scenarios that need no process
//! control), runs an undisturbed baseline of N streamed requests, runs the same requests again with one fault
//! injected once every stream is producing tokens, then once more after the fault is over, and compares every
//! stream with the baseline. A table and a JSON report say what failed; the exit status is non-zero if any
//! request failed or any token changed.

mod cluster;
mod load;
mod procs;
mod report;
mod scenario;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;

use self::report::ScenarioReport;
pub use self::scenario::Scenario;
use crate::host::Host;

/// Arguments of `strata chaos`.
#[derive(clap::Args, Debug, Clone)]
pub struct ChaosArgs {
    /// The model (a `.gguf` file or a Hugging Face directory); needed unless --coordinator is given.
    #[arg(long, env = "STRATA_MODEL")]
    pub model: Option<PathBuf>,
    /// Scenarios to run, repeatable or comma-separated (default: all, `none` first).
    #[arg(long = "scenario", value_enum, value_delimiter = ',', env = "STRATA_CHAOS_SCENARIOS")]
    pub scenarios: Vec<Scenario>,
    /// Stage workers per cluster.
    #[arg(long, default_value_t = 3, env = "STRATA_CHAOS_WORKERS")]
    pub workers: usize,
    /// Concurrent streamed requests (half gRPC, half HTTP; half greedy, half seeded).
    #[arg(long, default_value_t = 16, env = "STRATA_CHAOS_STREAMS")]
    pub streams: usize,
    /// Tokens per request (EOS is ignored, so every request makes exactly this many).
    #[arg(long, default_value_t = 24, env = "STRATA_CHAOS_MAX_TOKENS")]
    pub max_tokens: u32,
    /// Compute threads per stage worker.
    #[arg(long, default_value_t = 1, env = "STRATA_CHAOS_THREADS")]
    pub threads: usize,
    /// KV blocks per stage worker.
    #[arg(long, default_value_t = 256, env = "STRATA_CHAOS_KV_BLOCKS")]
    pub kv_blocks: usize,
    /// Run a standby coordinator in every scenario (`coordinator-failover` always has one).
    #[arg(long, env = "STRATA_CHAOS_STANDBY")]
    pub standby: bool,
    /// How long `etcd-pause` keeps etcd stopped, in seconds.
    #[arg(long, default_value_t = 30, env = "STRATA_CHAOS_ETCD_PAUSE_SECS")]
    pub etcd_pause_secs: u64,
    /// A request not finished this many seconds after its wave started is cut and counted as failed.
    #[arg(long, default_value_t = 120, env = "STRATA_CHAOS_DEADLINE_SECS")]
    pub deadline_secs: u64,
    /// After the fault is lifted, how long to wait for the cluster to serve again before the after wave.
    #[arg(long, default_value_t = 90, env = "STRATA_CHAOS_RECOVERY_SECS")]
    pub recovery_secs: u64,
    /// Retries in a row a client makes on UNAVAILABLE or a broken connection (re-sending the request and
    /// skipping the tokens it has). 0: every error is final, so the coordinator's own recovery is measured.
    /// `coordinator-failover` always retries (at least 20 in a row, for up to 30 s), on the standby's address.
    #[arg(long, default_value_t = 0, env = "STRATA_CHAOS_CLIENT_RETRIES")]
    pub client_retries: u32,
    /// Where `coordinator` and `stage-worker` are (default: beside this `strata`).
    #[arg(long, env = "STRATA_CHAOS_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Keep every process's log under this directory, one subdirectory per scenario (default: a temporary
    /// directory, removed at the end).
    #[arg(long, env = "STRATA_CHAOS_LOGS")]
    pub logs: Option<PathBuf>,
    /// Write the report (every stream's tokens and timestamps included) as JSON here.
    #[arg(long, env = "STRATA_CHAOS_JSON")]
    pub json: Option<PathBuf>,
    /// Extra flag for every `stage-worker` (repeatable, e.g. `--worker-arg=--block-size=32`).
    #[arg(long = "worker-arg", allow_hyphen_values = true, env = "STRATA_CHAOS_WORKER_ARGS", value_delimiter = ' ')]
    pub worker_args: Vec<String>,
    /// Extra flag for every `coordinator` (repeatable).
    #[arg(
        long = "coordinator-arg",
        allow_hyphen_values = true,
        env = "STRATA_CHAOS_COORDINATOR_ARGS",
        value_delimiter = ' '
    )]
    pub coordinator_args: Vec<String>,
    /// Attach to this running coordinator (plaintext `http://` gRPC URL) instead of starting processes; only
    /// `none` and `drain` (which needs a spare worker: the others must hold the model) can run this way.
    #[arg(long, env = "STRATA_CHAOS_COORDINATOR")]
    pub coordinator: Option<String>,
    /// The attached coordinator's HTTP API (`http://host:port`), for the HTTP half of the load.
    #[arg(long, env = "STRATA_CHAOS_HTTP")]
    pub http: Option<String>,
}

/// The whole run, as `--json` writes it.
#[derive(Serialize)]
struct RunReport {
    host: Host,
    command: Vec<String>,
    model: Option<String>,
    workers: usize,
    streams: usize,
    max_tokens: u32,
    threads_per_worker: usize,
    passed: bool,
    scenarios: Vec<ScenarioReport>,
}

/// Runs `strata chaos`.
pub fn run(a: ChaosArgs) -> Result<()> {
    if a.streams == 0 || a.max_tokens < 3 {
        bail!("--streams must be positive and --max-tokens at least 3 (the fault comes after 2 tokens)");
    }
    let scenarios = if a.scenarios.is_empty() { Scenario::ALL.to_vec() } else { a.scenarios.clone() };
    if a.coordinator.is_some() {
        if let Some(s) = scenarios.iter().find(|s| !s.attachable()) {
            bail!(
                "--coordinator attaches to a running cluster, where `{s}` cannot run (it needs to start or signal processes); attachable: none, drain"
            );
        }
        if a.http.is_none() {
            bail!("--coordinator needs --http too (the HTTP half of the load)");
        }
        if a.coordinator.as_deref().is_some_and(|u| !u.trim().starts_with("http://")) {
            bail!("--coordinator: the chaos load speaks plaintext only; give an http:// URL");
        }
    } else if a.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let host = Host::detect();
    eprintln!("strata chaos on {}", host.describe());
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let reports = rt.block_on(async {
        tokio::select! {
            r = run_all(&a, &scenarios) => r,
            () = strata_proto::shutdown_signal() => Err(anyhow!("interrupted; every process this run started is killed")),
        }
    })?;
    // Dropping the runtime here, not at exit, lets any process handle left in a task be killed.
    drop(rt);
    let passed = reports.iter().all(|r| r.passed);
    let cluster = match &a.coordinator {
        Some(url) => format!("attached to {url}"),
        None => format!("{} stage worker(s), {} thread(s) each", a.workers, a.threads),
    };
    println!(
        "strata chaos: {cluster}; {} streams x {} tokens; CPU {} [{}]; commit {}; {}",
        a.streams,
        a.max_tokens,
        host.cpu_model,
        host.cpu_flags.join(" "),
        host.commit.as_deref().unwrap_or("unknown"),
        host.date
    );
    print!("{}", report::table(&reports));
    if let Some(path) = &a.json {
        let run = RunReport {
            host,
            command: std::env::args().collect(),
            model: a.model.as_ref().map(|m| m.display().to_string()),
            workers: a.workers,
            streams: a.streams,
            max_tokens: a.max_tokens,
            threads_per_worker: a.threads,
            passed,
            scenarios: reports,
        };
        crate::json_file::write(path, &run)?;
        eprintln!("wrote {}", path.display());
    }
    if !passed {
        bail!("chaos: at least one scenario failed a request or changed a token (see the table above)");
    }
    Ok(())
}

async fn run_all(a: &ChaosArgs, scenarios: &[Scenario]) -> Result<Vec<ScenarioReport>> {
    let temp_logs;
    let logs = match &a.logs {
        Some(d) => d.clone(),
        None => {
            temp_logs = tempfile::tempdir().context("creating a log directory")?;
            temp_logs.path().to_path_buf()
        }
    };
    let bin_dir = match &a.coordinator {
        Some(_) => None,
        None => Some(procs::bin_dir(a.bin_dir.as_deref())?),
    };
    let mut reports = Vec::new();
    for &s in scenarios {
        eprintln!("\n=== {s} ===");
        let r = scenario::run(a, s, bin_dir.as_deref(), &logs.join(s.to_string())).await;
        let r = r.unwrap_or_else(|e| {
            let mut r = ScenarioReport { scenario: s.to_string(), ..ScenarioReport::default() };
            r.notes.push(format!("FAILED to run: {e:#}"));
            r.judge();
            r
        });
        eprint!("{}", report::table(std::slice::from_ref(&r)));
        reports.push(r);
    }
    if a.logs.is_some() {
        eprintln!("process logs are under {}", logs.display());
    }
    Ok(reports)
}

/// The retry budget of a wave's clients: none unless asked, except where clients must move to the standby. There
/// the 30 s timeout, not the count, should end the retries: a takeover waits out the dead leader's lease (5 s) and
/// the capped backoff spends 9 s on its first 8 retries.
fn retry_budget(a: &ChaosArgs, s: Scenario) -> Option<crate::retry::RetryBudget> {
    let retries = if s == Scenario::CoordinatorFailover { a.client_retries.max(20) } else { a.client_retries };
    (retries > 0).then(|| crate::retry::RetryBudget {
        retries,
        retry_timeout: Duration::from_secs(30),
        wait: Duration::ZERO,
    })
}
