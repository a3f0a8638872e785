//! Every fault of `tests/faults.rs` and `tests/failover.rs` through both public APIs: `strata chaos` runs 16
//! streams, half through gRPC `Generate` and half through the OpenAI HTTP API with server-sent events (half greedy,
//! half seeded), against real processes; it kills the first, middle or last stage, freezes one, drains one, adds
//! one, freezes etcd for 30 s and kills the leader coordinator (clients retry on the standby), and must report every
//! scenario passed: no failed request and every stream identical to the undisturbed run, during the fault and
//! after it.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use strata_testkit::{smollm2, workspace_bin};

/// Runs `strata chaos` on `scenarios` and checks that every one passed.
fn chaos(scenarios: &str) -> Result<()> {
    let strata = workspace_bin("strata")?;
    let bin_dir = strata.parent().context("no target directory")?.to_path_buf();
    let dir = tempfile::tempdir()?;
    let json_path = dir.path().join("chaos.json");
    let out = Command::new(&strata)
        .args(["chaos", "--scenario", scenarios, "--json"])
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

#[test]
fn crashes_and_a_hang_lose_nothing_through_grpc_and_http() -> Result<()> {
    chaos("crash-first,crash-middle,crash-last,hang")
}

#[test]
fn drain_join_etcd_pause_and_failover_lose_nothing_through_grpc_and_http() -> Result<()> {
    chaos("drain,join,etcd-pause,coordinator-failover")
}
