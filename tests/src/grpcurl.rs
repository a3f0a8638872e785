//! grpcurl, the gRPC command-line client users have (1.8.6: reflection v1alpha only), for the tests that run it:
//! where to find it and how to run it in plaintext.
//!
//! grpcurl comes from `STRATA_GRPCURL`, else the project's venv (`scripts/python-env.sh` installs it; scripts/test
//! exports the variable), else `PATH`. Without it [`find`] fails in CI (`CI` set) or when `STRATA_GRPCURL` names a
//! missing file, and otherwise says how to install it and returns `None`, so the test skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

/// The grpcurl to run, or `None` (skip) outside CI when there is none.
pub fn find() -> Result<Option<PathBuf>> {
    if let Some(path) = std::env::var_os("STRATA_GRPCURL").map(PathBuf::from) {
        ensure!(path.exists(), "STRATA_GRPCURL={} does not exist", path.display());
        return Ok(Some(path));
    }
    let cache = std::env::var_os("STRATA_CACHE").map_or_else(|| PathBuf::from("/var/cache/strata"), PathBuf::from);
    let venv = cache.join("venv/bin/grpcurl");
    if venv.exists() {
        return Ok(Some(venv));
    }
    if Command::new("grpcurl").arg("-version").output().is_ok_and(|o| o.status.success()) {
        return Ok(Some(PathBuf::from("grpcurl")));
    }
    if std::env::var_os("CI").is_some() {
        bail!("grpcurl is missing in CI: scripts/python-env.sh installs it (scripts/test runs it)");
    }
    eprintln!(
        "SKIPPED: grpcurl is not installed; run scripts/python-env.sh (or scripts/test) to install grpcurl 1.8.6"
    );
    Ok(None)
}

/// What one grpcurl run printed, and whether it succeeded.
#[derive(Debug, Clone)]
pub struct Output {
    /// Exit status 0.
    pub ok: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error (grpcurl reports a failed call's status there).
    pub stderr: String,
}

/// Runs `grpcurl -plaintext [-H header]... [-d data] addr args...`.
pub fn run(grpcurl: &Path, addr: &str, headers: &[&str], data: Option<&str>, args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new(grpcurl);
    cmd.arg("-plaintext");
    for header in headers {
        cmd.args(["-H", header]);
    }
    if let Some(data) = data {
        cmd.args(["-d", data]);
    }
    let out = cmd.arg(addr).args(args).output().with_context(|| format!("running {}", grpcurl.display()))?;
    Ok(Output {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}
