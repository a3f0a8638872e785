//! The official `openai` Python client (tests/openai_client/check.py) against a real `strata local --stages 3`
//! process: completions, chat, streaming, and OpenAI's typed errors.
//!
//! The Python comes from `STRATA_PYTHON`; without it, from the venv `scripts/python-env.sh` creates
//! (`$STRATA_CACHE/venv`); with neither, the test fails, never skips. `scripts/test` runs `scripts/python-env.sh`
//! and exports `STRATA_PYTHON`, so the test always runs there.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};
use strata_testkit::{Process, free_port, smollm2};

fn python() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("STRATA_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    let cache = std::env::var_os("STRATA_CACHE").map_or_else(|| PathBuf::from("/var/cache/strata"), PathBuf::from);
    let venv = cache.join("venv/bin/python");
    if venv.exists() {
        return Ok(venv);
    }
    bail!(
        "no Python with the openai client: set STRATA_PYTHON=$(scripts/python-env.sh), or run scripts/test \
         (which does), or create {} with scripts/python-env.sh",
        venv.display()
    )
}

#[test]
fn the_openai_python_client_works_against_strata_local() -> Result<()> {
    let python = python()?;
    let (grpc, http) = (format!("127.0.0.1:{}", free_port()?), format!("127.0.0.1:{}", free_port()?));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.arg("local").arg("--model").arg(smollm2());
    cmd.args(["--stages", "3", "--grpc", &grpc, "--http", &http, "--threads", "1"]);
    let cluster = Process::spawn("strata-local", cmd)?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/openai_client/check.py");
    let out = Command::new(&python)
        .arg(&script)
        .args(["--base-url", &format!("http://{http}/v1"), "--wait", "180"])
        .output()?;
    assert!(
        out.status.success(),
        "{} {} failed ({}):\n--- stdout\n{}\n--- stderr\n{}\n--- strata local\n{}",
        python.display(),
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        cluster.output()
    );
    print!("{}", String::from_utf8_lossy(&out.stdout));
    Ok(())
}
