//! HTTP/2 keepalive against a hung peer: the next stage is a real `stage-worker` process, stopped with SIGSTOP
//! (its sockets stay open, nothing answers). The upstream stage's in-flight batch must fail with UNAVAILABLE
//! within the keepalive's bound instead of waiting forever.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{Stream, chunk, client_at, stage_config, stop_all};
use strata_proto::{ErrorCode, ServiceError, pb};
use strata_stage_worker::Worker;
use strata_testkit::{Process, free_port};

fn prefill(batch_id: u64, seq_id: u64, ids: &[u32]) -> pb::ForwardRequest {
    pb::ForwardRequest {
        batch_id,
        chunks: vec![chunk(seq_id, 0, ids.len() as u32, false)],
        token_ids: ids.to_vec(),
        ..Default::default()
    }
}

fn signal(process: &Process, sig: &str) -> Result<()> {
    let ok = Command::new("kill").arg(format!("-{sig}")).arg(process.id().to_string()).status()?.success();
    ensure!(ok, "kill -{sig} {} failed", process.id());
    Ok(())
}

/// Starts the last stage (layers 2..4) as a child process with the default keepalive and waits until it answers.
async fn start_last_stage(model: &std::path::Path) -> Result<(Process, String)> {
    let addr = format!("127.0.0.1:{}", free_port()?);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stage-worker"));
    cmd.args(["--listen", &addr, "--node-id", "last", "--layers", "2..4", "--stage-index", "1"])
        .args(["--threads", "1", "--kv-blocks", "64", "--block-size", "4"])
        .arg("--model")
        .arg(model);
    let mut process = Process::spawn("stage-worker", cmd)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut c) = client_at(addr.parse()?).await
            && c.status(pb::StageStatusRequest {}).await.is_ok()
        {
            return Ok((process, addr));
        }
        if !process.running() || Instant::now() >= deadline {
            bail!("the stage-worker process did not start; output:\n{}", process.output());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_next_stage_fails_the_batch_within_the_keepalive_bound() -> Result<()> {
    let model = common::tiny_model()?;
    let (last, addr) = start_last_stage(model.path()).await?;
    let first = Worker::start(stage_config(model.path(), 0, 0..2, Some(addr)), "127.0.0.1:0").await?;
    let mut stream = Stream::open(&first).await?;
    stream.send(prefill(1, 1, &[1, 2, 3])).await?;
    let ok = stream.recv().await?;
    ensure!(ok.error.is_none() && ok.tokens.len() == 1, "the pipeline works before the stop: {ok:?}");

    signal(&last, "STOP")?;
    let started = Instant::now();
    stream.send(prefill(2, 2, &[4, 5, 6])).await?;
    let resp = stream.recv_within(Duration::from_secs(10)).await.context("the batch hung on the stopped stage")?;
    let waited = started.elapsed();
    let err = resp.error.map(ServiceError::from).context("a stopped stage cannot answer")?;
    ensure!(err.code == ErrorCode::Unavailable, "{err:?}");
    ensure!(waited < Duration::from_secs(6), "detected after {waited:?}");
    signal(&last, "CONT")?;
    drop(stream);
    stop_all(vec![first]).await
}
