//! grpcurl 1.8.6 (the version users have; it speaks only `grpc.reflection.v1alpha`) against a real coordinator and
//! real stage workers: it lists their services through reflection, checks their health, and runs `Generate` from
//! JSON, getting the same tokens as the Rust client. Where grpcurl comes from, and when the test skips: `strata_tests::grpcurl`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use strata_proto::{COORDINATOR_SERVICE, STAGE_SERVICE};
use strata_tests::{StageSizing, TestCluster, generate, ids_request, tiny_model};

const PROMPT: [u32; 4] = [17, 42, 3, 250];

/// Runs grpcurl in plaintext against `addr`; fails with its output unless it succeeds.
fn run(grpcurl: &Path, addr: &str, data: Option<&str>, args: &[&str]) -> Result<String> {
    let out = strata_tests::grpcurl::run(grpcurl, addr, &[], data, args)?;
    ensure!(out.ok, "grpcurl {args:?}: {}{}", out.stdout, out.stderr);
    Ok(out.stdout)
}

/// The JSON objects grpcurl printed one after another (a server stream).
fn messages(text: &str) -> Result<Vec<Value>> {
    serde_json::Deserializer::from_str(text).into_iter::<Value>().map(|m| Ok(m?)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_checks_health_and_generates_through_reflection() -> Result<()> {
    let Some(grpcurl) = strata_tests::grpcurl::find()? else { return Ok(()) };
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
