//! grpcurl 1.8.6 (the version users have; it speaks only `grpc.reflection.v1alpha`) against a real coordinator and
//! real stage workers: it lists their services through reflection, checks their health, and runs `Generate` from
//! JSON, getting the same tokens as the Rust client.
//!
//! grpcurl comes from `STRATA_GRPCURL`, else the project's venv (`scripts/python-env.sh` installs it; scripts/test
//! exports the variable), else `PATH`. Without it the test fails in CI (`CI` set) or when `STRATA_GRPCURL` names a
//! missing file, and otherwise skips, saying how to install it.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use strata_proto::{COORDINATOR_SERVICE, STAGE_SERVICE};
use strata_tests::{StageSizing, TestCluster, generate, ids_request, tiny_model};

const PROMPT: [u32; 4] = [17, 42, 3, 250];

/// The grpcurl to run, or `None` (skip) outside CI when there is none.
fn grpcurl() -> Result<Option<PathBuf>> {
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

/// Runs `grpcurl -plaintext [-d data] addr args...`; fails with its output unless it succeeds.
fn run(grpcurl: &PathBuf, addr: &str, data: Option<&str>, args: &[&str]) -> Result<String> {
    let mut cmd = Command::new(grpcurl);
    cmd.arg("-plaintext");
    if let Some(data) = data {
        cmd.args(["-d", data]);
    }
    let out = cmd.arg(addr).args(args).output().with_context(|| format!("running {}", grpcurl.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(out.status.success(), "grpcurl {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    Ok(text)
}

/// The JSON objects grpcurl printed one after another (a server stream).
fn messages(text: &str) -> Result<Vec<Value>> {
    serde_json::Deserializer::from_str(text).into_iter::<Value>().map(|m| Ok(m?)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_checks_health_and_generates_through_reflection() -> Result<()> {
    let Some(grpcurl) = grpcurl()? else { return Ok(()) };
    let model = tiny_model()?;
    let cluster = TestCluster::start(model.path(), &[0, 2, 4], StageSizing::default()).await?;
    let result = checks(&cluster, grpcurl).await;
    cluster.stop().await?;
    result
}

async fn checks(cluster: &TestCluster, grpcurl: PathBuf) -> Result<()> {
    let coordinator = cluster.addr.to_string();
    let stage = cluster.workers.first().context("no worker")?.local_addr().to_string();
    let mut client = cluster.client().await?;
    let expected = generate(&mut client, ids_request(&PROMPT, 6)).await?;

    tokio::task::spawn_blocking(move || -> Result<()> {
        for (addr, service) in [(&coordinator, COORDINATOR_SERVICE), (&stage, STAGE_SERVICE)] {
            let listed = run(&grpcurl, addr, None, &["list"])?;
            let services: Vec<&str> = listed.lines().collect();
            for want in [service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"] {
                ensure!(services.contains(&want), "{addr}: {want} not listed: {services:?}");
            }
            let described = run(&grpcurl, addr, None, &["describe", service])?;
            ensure!(described.contains("rpc "), "{addr}: describe {service}: {described}");
            let check = format!("{{\"service\": \"{service}\"}}");
            let health = run(&grpcurl, addr, Some(&check), &["grpc.health.v1.Health/Check"])?;
            ensure!(health.contains("\"SERVING\""), "{addr}: {health}");
        }

        let request = format!("{{\"ids\": {{\"ids\": {PROMPT:?}}}, \"maxTokens\": 6}}");
        let out = run(&grpcurl, &coordinator, Some(&request), &[&format!("{COORDINATOR_SERVICE}/Generate")])?;
        let msgs = messages(&out)?;
        let prompt_ids: Vec<u64> = msgs
            .first()
            .and_then(|m| m["promptIds"].as_array())
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .collect();
        ensure!(prompt_ids == PROMPT.map(u64::from), "prompt ids: {out}");
        let tokens: Vec<u32> = msgs
            .iter()
            .filter_map(|m| m["tokenIds"].as_array())
            .flatten()
            .filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect();
        ensure!(tokens == expected.token_ids, "grpcurl got {tokens:?}, the Rust client {:?}", expected.token_ids);
        ensure!(msgs.last().is_some_and(|m| m["finishReason"] == "FINISH_REASON_LENGTH"), "{out}");
        Ok(())
    })
    .await?
}
