//! `strata client generate` against a real `strata local` cluster: a dead first coordinator URL is retried on the
//! next one with the same tokens as a direct request, and an error no retry can fix is reported at once.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use strata_testkit::{Process, free_port, smollm2};

fn strata(args: &[&str]) -> Result<std::process::Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_strata")).args(args).output()?)
}

fn json(out: &std::process::Output) -> Result<serde_json::Value> {
    ensure!(out.status.success(), "strata failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).context("stdout is one JSON object")
}

#[test]
fn a_dead_coordinator_url_is_retried_on_the_next_one() -> Result<()> {
    let model = smollm2();
    let m = model.to_str().unwrap_or_default();
    let grpc = format!("127.0.0.1:{}", free_port()?);
    let http = format!("127.0.0.1:{}", free_port()?);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.args(["local", "--model", m, "--stages", "2", "--grpc", &grpc, "--http", &http, "--threads", "1"]);
    let _cluster = Process::spawn("strata-local", cmd)?;
    let live = format!("http://{grpc}");
    let prompt = ["--prompt", "The capital of France is", "--max-tokens", "6", "--format", "json"];
    let mut direct = vec!["client", "generate", "--coordinator", live.as_str(), "--wait", "60"];
    direct.extend_from_slice(&prompt);
    let reference = json(&strata(&direct)?)?;

    // The dead URL comes first: the connection is refused, and the retry goes to the live one.
    let dead = format!("http://127.0.0.1:{}", free_port()?);
    let both = format!("{dead},{live}");
    let mut retried = vec!["client", "generate", "--coordinator", both.as_str(), "--wait", "0", "--retries", "3"];
    retried.extend_from_slice(&prompt);
    let out = strata(&retried)?;
    let v = json(&out)?;
    for key in ["prompt_ids", "token_ids", "text", "finish_reason"] {
        ensure!(v[key] == reference[key], "{key} differs after a retry: {v} vs {reference}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(stderr.contains("retrying on") && stderr.contains(&live), "the retry is logged: {stderr}");

    // Only dead URLs: it gives up after --retries, naming the reason.
    let started = Instant::now();
    let mut hopeless = vec!["client", "generate", "--coordinator", dead.as_str(), "--wait", "0", "--retries", "2"];
    hopeless.extend_from_slice(&prompt);
    let out = strata(&hopeless)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && stderr.contains("gave up after 2 retries"), "{stderr}");
    ensure!(started.elapsed() < Duration::from_secs(10), "2 retries took {:?}", started.elapsed());

    // A request the server refuses (a prompt id outside the vocabulary) is not retried.
    let bad = ["--prompt-ids", "999999999", "--max-tokens", "2", "--format", "json"];
    let mut invalid = vec!["client", "generate", "--coordinator", live.as_str(), "--retries", "5"];
    invalid.extend_from_slice(&bad);
    let out = strata(&invalid)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && !stderr.contains("retrying"), "{stderr}");
    Ok(())
}
