//! The membership changes of `tests/faults.rs` through both public APIs: `strata chaos` runs 16 streams, half
//! through gRPC `Generate` and half through the OpenAI HTTP API with server-sent events (half greedy, half seeded),
//! against real processes, kills, freezes, drains and adds a stage, and must report every scenario passed: no failed
//! request and every stream identical to the undisturbed run, during the fault and after it.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use strata_testkit::{smollm2, workspace_bin};

#[test]
fn crash_hang_drain_and_join_lose_nothing_through_grpc_and_http() -> Result<()> {
    let strata = workspace_bin("strata")?;
    let bin_dir = strata.parent().context("no target directory")?.to_path_buf();
    let dir = tempfile::tempdir()?;
    let json_path = dir.path().join("chaos.json");
    let out = Command::new(&strata)
        .args(["chaos", "--scenario", "crash-middle,hang,drain,join", "--json"])
        .arg(&json_path)
        .arg("--model")
        .arg(smollm2())
        .arg("--bin-dir")
        .arg(&bin_dir)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_path)?)
        .with_context(|| format!("no JSON report:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr)))?;
    eprintln!("{stdout}");
    for s in report["scenarios"].as_array().context("scenarios")? {
        ensure!(s["passed"] == true, "{} failed: {}", s["scenario"], s["run"]);
        ensure!(s["run"]["sent"] == 16 && s["run"]["identical"] == 16, "{}: {}", s["scenario"], s["run"]);
    }
    ensure!(out.status.success() && report["passed"] == true, "strata chaos failed:\n{stdout}");
    Ok(())
}
