//! `strata local` (real processes: one running the cluster, one client) gives exactly the greedy tokens of
//! `strata generate` in a single process, before and after draining a worker.

use std::process::Command;

use anyhow::{Context, Result};
use strata_testkit::{Process, free_port, smollm2};

fn text(args: &[&str]) -> Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_strata")).args(args).output()?;
    assert!(out.status.success(), "strata {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?)
}

fn json(args: &[&str]) -> Result<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_strata")).args(args).output()?;
    assert!(out.status.success(), "strata {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).context("stdout is one JSON object")
}

#[test]
fn local_cluster_matches_single_process_on_smollm2() -> Result<()> {
    let model = smollm2();
    let m = model.to_str().unwrap_or_default();
    for stages in ["1", "3"] {
        let port = free_port()?;
        let grpc = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
        // A free HTTP port too: the default 8080 would collide between concurrent runs.
        let http = format!("127.0.0.1:{}", free_port()?);
        cmd.args(["local", "--model", m, "--stages", stages, "--grpc", &grpc, "--http", &http, "--threads", "1"]);
        let _cluster = Process::spawn("strata-local", cmd)?;
        let url = format!("http://{grpc}");
        let prompt = ["--prompt", "The capital of France is", "--max-tokens", "8", "--format", "json"];
        let mut client = vec!["client", "generate", "--coordinator", url.as_str(), "--wait", "60"];
        client.extend_from_slice(&prompt);
        let remote = json(&client)?;
        let mut single = vec!["generate", "--model", m, "--threads", "1"];
        single.extend_from_slice(&prompt);
        let local = json(&single)?;
        for key in ["prompt_ids", "token_ids", "text", "finish_reason"] {
            assert_eq!(remote[key], local[key], "{stages} stages: {key} differs");
        }
        assert!(remote["text"].as_str().unwrap_or_default().starts_with(" Paris"), "{remote}");
        if stages == "3" {
            // Drain the middle worker: a new plan epoch moves its layers, it ends CORDONED, requests still work.
            let listing = text(&["nodes", "list", "--coordinator", &url])?;
            assert!(listing.contains("plan epoch 1") && listing.contains("local-1"), "{listing}");
            text(&["nodes", "drain", "local-1", "--coordinator", &url])?;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                let listing = text(&["nodes", "list", "--coordinator", &url])?;
                let drained = listing.lines().any(|l| l.starts_with("local-1") && l.contains("CORDONED"));
                if drained && listing.contains("plan epoch 2") {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "drain did not finish: {listing}");
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            let after = json(&client)?;
            assert_eq!(after["token_ids"], local["token_ids"], "tokens changed after the drain");
        }
    }
    Ok(())
}

#[test]
fn a_taken_api_address_fails_at_once_before_any_worker_loads() -> Result<()> {
    let model = smollm2();
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let http = taken.local_addr()?.to_string();
    let grpc = format!("127.0.0.1:{}", free_port()?);
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["local", "--stages", "2", "--grpc", &grpc, "--http", &http, "--model"])
        .arg(&model)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&format!("cannot bind the HTTP API on {http}")), "{stderr}");
    assert!(!stderr.contains("stage worker local-0 listening"), "a worker started first: {stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "took {:?}", started.elapsed());
    Ok(())
}

#[test]
fn cluster_bench_reports_every_level_and_writes_a_plot() -> Result<()> {
    let model = smollm2();
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("cluster.json");
    let m = model.to_str().unwrap_or_default();
    let o = out.to_str().unwrap_or_default();
    let args = ["bench", "--model", m, "--local", "2", "--concurrency", "1,3", "--requests-per-client", "1"];
    // 36-token prompts sharing their first 32: after the unmeasured first request, each finds 2 blocks of 16 cached.
    let sizes = ["--prompt-tokens", "36", "--shared-prefix-tokens", "32", "--decode-tokens", "5", "--threads", "2"];
    let sizes = [&sizes[..], &["--out", o]].concat();
    // One cluster per setting of micro-batches per stage.
    let table = text(&[&args[..], &sizes[..], &["--micro-batches-per-stage", "1,2"]].concat())?;
    // Every stage gets --threads threads (2), the stages sharing this machine's cores.
    assert!(table.contains("| 2 | on | 1 | 2 | 3 |") && table.contains("| 2 | on | 2 | 2 | 3 |"), "{table}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    let runs = report["runs"].as_array().context("runs")?;
    assert_eq!(runs.len(), 4, "{report}");
    for (run, (micro_batches, streams)) in runs.iter().zip([(1, 1), (1, 3), (2, 1), (2, 3)]) {
        assert_eq!(run["stages"], 2);
        assert_eq!(run["micro_batches_per_stage"], micro_batches, "{run}");
        assert_eq!(run["concurrency"], streams);
        // EOS is ignored, so every request yields exactly --decode-tokens tokens.
        assert_eq!(run["completion_tokens"], 5 * streams, "{run}");
        assert!(run["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{run}");
        assert!(run["overhead_us_per_hop"].as_f64().is_some_and(|t| t > 0.0), "{run}");
        assert_eq!(run["cached_prompt_tokens_per_request"], 32.0, "{run}");
    }
    let svg = std::fs::read_to_string(out.with_extension("svg"))?;
    assert!(svg.contains(">2 stages, 1 mb/stage<") && svg.contains(">2 stages, 2 mb/stage<"), "{svg}");
    Ok(())
}

#[test]
fn cluster_bench_passes_interleave_the_clusters_and_hold_each_against_one_stage() -> Result<()> {
    let model = smollm2();
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("cluster.json");
    let m = model.to_str().unwrap_or_default();
    let o = out.to_str().unwrap_or_default();
    let args = ["bench", "--model", m, "--local", "1,2", "--concurrency", "2", "--requests-per-client", "1"];
    let sizes = ["--prompt-tokens", "8", "--decode-tokens", "3", "--threads", "2", "--repeat", "2", "--out", o];
    let table = text(&[&args[..], &sizes[..]].concat())?;
    assert!(table.contains("Against one stage at the same streams (median over 2 pass(es)"), "{table}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out)?)?;
    let runs = report["runs"].as_array().context("runs")?;
    // Each pass runs every cluster in turn.
    let order: Vec<(u64, u64)> = runs
        .iter()
        .map(|r| (r["pass"].as_u64().unwrap_or_default(), r["stages"].as_u64().unwrap_or_default()))
        .collect();
    assert_eq!(order, [(1, 1), (1, 2), (2, 1), (2, 2)], "{report}");
    let against = report["against_one_stage"].as_array().context("against_one_stage")?;
    assert_eq!(against.len(), 1, "{report}");
    assert_eq!((against[0]["stages"].as_u64(), against[0]["passes"].as_u64()), (Some(2), Some(2)));
    assert!(against[0]["tokens_per_s_ratio"].as_f64().is_some_and(|r| r > 0.0), "{report}");
    assert!(against[0]["vs_engine_ratio"].as_f64().is_some_and(|r| r > 0.0), "{report}");
    // Passes are for local clusters: a running coordinator's are refused before anything connects.
    let refused = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "--coordinator", "http://127.0.0.1:1", "--repeat", "2"])
        .output()?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("more than 1 only with --local"), "{stderr}");
    Ok(())
}
