//! `strata chaos` on a real cluster of processes (etcd, a `stage-worker`, a `coordinator`): the control scenario
//! passes with every stream identical to the baseline, and killing the only worker — which nothing can survive —
//! is reported as failed requests and a non-zero exit, so the tool can fail.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use strata_testkit::{smollm2, workspace_bin};

#[test]
fn the_control_passes_and_an_unsurvivable_crash_fails_the_run() -> Result<()> {
    let model = smollm2();
    let bin_dir = workspace_bin("coordinator")?.parent().context("no target directory")?.to_path_buf();
    workspace_bin("stage-worker")?;
    let dir = tempfile::tempdir()?;
    let json_path = dir.path().join("chaos.json");
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["chaos", "--scenario", "none,crash-first", "--workers", "1", "--streams", "4", "--max-tokens", "6"])
        .args(["--deadline-secs", "30", "--recovery-secs", "10"])
        .arg("--model")
        .arg(&model)
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--json")
        .arg(&json_path)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "a run with a failed scenario must exit non-zero:\n{stdout}\n{stderr}");
    ensure!(stdout.contains("| scenario |") && stdout.contains("CPU "), "no table or CPU line:\n{stdout}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_path)?)?;
    ensure!(report["passed"] == false, "{report}");
    let control = &report["scenarios"][0];
    ensure!(control["scenario"] == "none" && control["passed"] == true, "control: {control}\n{stderr}");
    for wave in ["baseline", "run", "after"] {
        ensure!(control[wave]["sent"] == 4 && control[wave]["identical"] == 4, "{wave}: {}", control[wave]);
    }
    for s in control["streams"]["run"].as_array().context("run streams")? {
        let arrivals = s["arrivals_s"].as_array().map_or(0, Vec::len);
        ensure!(s["finish"] == "length" && arrivals >= 1, "every stream finished with timestamps: {s}");
        if s["api"] == "grpc" {
            ensure!(s["token_ids"].as_array().map_or(0, Vec::len) == 6, "6 token ids: {s}");
        }
    }
    let crash = &report["scenarios"][1];
    ensure!(crash["scenario"] == "crash-first" && crash["passed"] == false, "crash: {crash}");
    ensure!(crash["run"]["failed"].as_u64().unwrap_or(0) > 0, "the only worker died, yet nothing failed: {crash}");
    ensure!(crash["fault"].as_str().is_some_and(|f| f.starts_with("kill -9 w0")), "{}", crash["fault"]);
    Ok(())
}
