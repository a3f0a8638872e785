//! Child processes of a chaos run: spawned with their output in a log file, signalled with real signals
//! (`kill -s STOP|CONT`, SIGKILL), and killed when dropped — on success, on error and on Ctrl-C alike (the run's
//! future is dropped, and with it every `Proc`).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A port nothing listens on right now (the OS picks it; another process could take it first, rarely).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0").context("finding a free port")?.local_addr()?.port())
}

/// Where `coordinator` and `stage-worker` are: `--bin-dir`, else beside the running `strata`.
pub fn bin_dir(explicit: Option<&Path>) -> Result<PathBuf> {
    let dir = match explicit {
        Some(d) => d.to_path_buf(),
        None => std::env::current_exe()
            .context("locating the strata executable")?
            .parent()
            .context("the strata executable has no directory")?
            .to_path_buf(),
    };
    for bin in ["coordinator", "stage-worker"] {
        if !dir.join(bin).is_file() {
            bail!(
                "{} not found: build it (`cargo build --release -p strata-coordinator -p strata-stage-worker`) or \
                 pass --bin-dir",
                dir.join(bin).display()
            );
        }
    }
    Ok(dir)
}

/// A child process, killed (SIGKILL) and reaped on drop.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    exited: bool,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr appended to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawning {name} ({cmd:?})"))?;
        Ok(Self { name: name.to_owned(), child, log, exited: false })
    }

    /// The name it was started under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running (a stopped process counts as running).
    pub fn running(&mut self) -> bool {
        !self.exited && matches!(self.child.try_wait(), Ok(None))
    }

    /// The last `lines` lines of its output.
    pub fn tail(&self, lines: usize) -> String {
        let all = std::fs::read_to_string(&self.log).unwrap_or_default();
        let v: Vec<&str> = all.lines().collect();
        v[v.len().saturating_sub(lines)..].join("\n")
    }

    /// `kill -9`: the process ends at once, without running any shutdown code.
    pub fn kill9(&mut self) {
        if !self.exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.exited = true;
        }
    }

    /// SIGSTOP: the process freezes (sockets stay open, nothing is answered) until [`Proc::resume`].
    pub fn pause(&self) -> Result<()> {
        signal(self.pid(), "STOP").with_context(|| format!("pausing {}", self.name))
    }

    /// SIGCONT after [`Proc::pause`].
    pub fn resume(&self) -> Result<()> {
        signal(self.pid(), "CONT").with_context(|| format!("resuming {}", self.name))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too, so a paused etcd or worker never outlives the run.
        self.kill9();
    }
}

/// Sends `SIG<name>` to `pid` with the `kill` command (the workspace has no signal crate).
pub fn signal(pid: u32, name: &str) -> Result<()> {
    let out = Command::new("kill").args(["-s", name, &pid.to_string()]).output().context("running kill")?;
    if !out.status.success() {
        bail!("kill -s {name} {pid}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A single-member etcd on free ports with its data in `dir`, killed on drop.
pub struct Etcd {
    /// The process.
    pub proc: Proc,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
}

impl Etcd {
    /// Starts etcd and waits (up to 15 s) until `/health` answers healthy.
    pub async fn start(dir: &Path, log_dir: &Path) -> Result<Self> {
        let (port, peer) = (free_port()?, free_port()?);
        let endpoint = format!("http://127.0.0.1:{port}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "chaos", "--data-dir"])
            .arg(dir.join("etcd-data"))
            .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("chaos={peer_url}")])
            // A 10 ms heartbeat and 100 ms election make a single member ready in ~0.2 s.
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"]);
        let mut proc = Proc::spawn("etcd", cmd, log_dir).context("is etcd installed (`scripts/setup test`)?")?;
        let deadline = Instant::now() + Duration::from_secs(15);
        let addr = format!("127.0.0.1:{port}").parse()?;
        loop {
            if let Ok(r) = crate::http::get(addr, "/health").await
                && r.contains(r#""health":"true""#)
            {
                return Ok(Self { proc, endpoint });
            }
            if !proc.running() || Instant::now() >= deadline {
                bail!("etcd on port {port} did not become healthy; its log:\n{}", proc.tail(20));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
