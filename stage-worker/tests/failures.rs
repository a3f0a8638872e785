//! Failure handling over real gRPC: a dead next stage, bad batches, release on every stage, status, health.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::{Stream, chunk, client, stage_config, start_chain, status, stop_all};
use strata_proto::pb;
use strata_proto::tonic_health::pb::HealthCheckRequest;
use strata_proto::tonic_health::pb::health_client::HealthClient;
use strata_proto::{ErrorCode, STAGE_SERVICE, ServiceError, encode_f32};
use strata_stage_worker::Worker;

fn error_code(resp: &pb::ForwardResponse) -> Option<ErrorCode> {
    resp.error.clone().map(|e| ServiceError::from(e).code)
}

fn prefill(batch_id: u64, seq_id: u64, ids: &[u32]) -> pb::ForwardRequest {
    pb::ForwardRequest {
        batch_id,
        chunks: vec![chunk(seq_id, 0, ids.len() as u32, false)],
        token_ids: ids.to_vec(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_next_stage_is_an_error_response_not_a_hang() -> Result<()> {
    let model = common::tiny_model()?;
    // A port that was just free: nothing listens there.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.to_string();
    let worker = Worker::start(stage_config(model.path(), 0, 0..2, Some(dead)), "127.0.0.1:0").await?;
    let mut stream = Stream::open(&worker).await?;
    for batch_id in [1, 2] {
        let started = Instant::now();
        stream.send(prefill(batch_id, batch_id, &[1, 2, 3])).await?;
        let resp = stream.recv_within(Duration::from_secs(5)).await?;
        ensure!(resp.batch_id == batch_id);
        ensure!(error_code(&resp) == Some(ErrorCode::Unavailable), "{resp:?}");
        let msg = resp.error.map(|e| e.message).unwrap_or_default();
        ensure!(msg.contains("next stage"), "unclear message: {msg}");
        ensure!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
    }
    ensure!(status(&worker).await?.inflight_batches == 0);
    drop(stream);
    stop_all(vec![worker]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_kv_on_every_stage() -> Result<()> {
    let model = common::tiny_model()?;
    let workers = start_chain(model.path(), &[0, 1, 3, 4]).await?;
    let mut stream = Stream::open(&workers[0]).await?;
    stream.send(prefill(1, 10, &[1, 2, 3, 4, 5, 6])).await?;
    stream.send(prefill(2, 11, &[7, 8, 9])).await?;
    for _ in 0..2 {
        let resp = stream.recv().await?;
        ensure!(resp.error.is_none(), "{:?}", resp.error);
    }
    for w in &workers {
        let s = status(w).await?;
        ensure!(s.kv_free_blocks == s.kv_total_blocks - 3, "{} holds 2 + 1 blocks of 4 tokens: {s:?}", s.node_id);
    }
    let mut c = client(&workers[0]).await?;
    let released =
        c.release(pb::ReleaseRequest { seq_ids: vec![10, 11, 99], propagate: true, term: 0 }).await?.into_inner();
    ensure!(released.released == 2);
    for w in &workers {
        let s = status(w).await?;
        ensure!(s.kv_free_blocks == s.kv_total_blocks, "{} still holds blocks: {s:?}", s.node_id);
    }
    let again = c.release(pb::ReleaseRequest { seq_ids: vec![10, 11], propagate: true, term: 0 }).await?.into_inner();
    ensure!(again.released == 0, "release is idempotent");
    // A released sequence can start over at position 0.
    stream.send(prefill(3, 10, &[1, 2])).await?;
    ensure!(stream.recv().await?.error.is_none());
    drop(stream);
    stop_all(workers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_batches_get_error_responses_and_the_stream_survives() -> Result<()> {
    let model = common::tiny_model()?;
    // The last stage alone (layers 2..4): it takes hidden states of width 64.
    let last = Worker::start(stage_config(model.path(), 1, 2..4, None), "127.0.0.1:0").await?;
    let mut stream = Stream::open(&last).await?;
    let hidden = |rows: usize, cols: usize| encode_f32(&vec![0.1; rows * cols], rows, cols, pb::Dtype::F32);
    let batch = |batch_id, hidden, chunks: Vec<pb::SeqChunk>, ids: Vec<u32>| pb::ForwardRequest {
        batch_id,
        chunks,
        token_ids: ids,
        hidden: Some(hidden),
        ..Default::default()
    };
    let cases = [
        (batch(1, hidden(2, 63)?, vec![chunk(1, 0, 2, false)], vec![1, 2]), ErrorCode::InvalidArgument),
        (batch(2, hidden(3, 64)?, vec![chunk(1, 0, 2, false)], vec![1, 2]), ErrorCode::InvalidArgument),
        (batch(3, hidden(1, 64)?, vec![chunk(5, 7, 1, false)], vec![1]), ErrorCode::NotFound),
        (batch(4, hidden(0, 64)?, vec![], vec![]), ErrorCode::InvalidArgument),
        (
            pb::ForwardRequest {
                batch_id: 5,
                chunks: vec![chunk(1, 0, 1, false)],
                token_ids: vec![1],
                ..Default::default()
            },
            ErrorCode::InvalidArgument,
        ),
    ];
    for (req, code) in cases {
        let id = req.batch_id;
        stream.send(req).await?;
        let resp = stream.recv().await?;
        ensure!(resp.batch_id == id && error_code(&resp) == Some(code), "batch {id}: {resp:?}");
        ensure!(resp.tokens.is_empty());
    }
    let mut bad_params = chunk(1, 0, 2, false);
    bad_params.sampling = Some(pb::SamplingParams { temperature: -1.0, ..Default::default() });
    stream.send(batch(6, hidden(2, 64)?, vec![bad_params], vec![1, 2])).await?;
    ensure!(error_code(&stream.recv().await?) == Some(ErrorCode::InvalidArgument));
    let s = status(&last).await?;
    ensure!(s.kv_free_blocks == s.kv_total_blocks, "failed batches must not hold KV: {s:?}");

    stream.send(batch(7, hidden(2, 64)?, vec![chunk(1, 0, 2, false)], vec![1, 2])).await?;
    let ok = stream.recv().await?;
    ensure!(ok.error.is_none() && ok.tokens.len() == 1 && ok.tokens[0].seq_id == 1, "{ok:?}");
    drop(stream);
    stop_all(vec![last]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_stage_rejects_bad_token_ids_and_kv_exhaustion() -> Result<()> {
    let model = common::tiny_model()?;
    let mut cfg = stage_config(model.path(), 0, 0..4, None);
    cfg.kv_blocks = Some(2);
    let worker = Worker::start(cfg, "127.0.0.1:0").await?;
    let mut stream = Stream::open(&worker).await?;
    stream.send(prefill(1, 1, &[1, 300])).await?;
    ensure!(error_code(&stream.recv().await?) == Some(ErrorCode::InvalidArgument), "id 300 is outside the vocab");
    stream.send(prefill(2, 1, &[1; 9])).await?;
    ensure!(error_code(&stream.recv().await?) == Some(ErrorCode::ResourceExhausted), "9 tokens need 3 blocks");
    stream.send(prefill(3, 1, &[1; 8])).await?;
    ensure!(stream.recv().await?.error.is_none());
    drop(stream);
    stop_all(vec![worker]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_health_describe_the_stage() -> Result<()> {
    let model = common::tiny_model()?;
    let workers = start_chain(model.path(), &[0, 3, 4]).await?;
    let s = status(&workers[1]).await?;
    ensure!((s.node_id.as_str(), s.layer_start, s.layer_end) == ("stage-1", 3, 4), "{s:?}");
    ensure!((s.kv_total_blocks, s.block_size, s.inflight_batches) == (64, 4, 0), "{s:?}");
    ensure!(s.weight_bytes > 0 && !s.device.is_empty(), "{s:?}");
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", workers[0].local_addr()))?.connect().await?;
    let health =
        HealthClient::new(channel).check(HealthCheckRequest { service: STAGE_SERVICE.to_owned() }).await?.into_inner();
    ensure!(health.status == 1, "SERVING: {health:?}");
    stop_all(workers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configs_fail_before_serving() -> Result<()> {
    let model = common::tiny_model()?;
    let mut cuda = stage_config(model.path(), 0, 0..4, None);
    cuda.device = strata_engine::Device::Cuda(0);
    let started = Worker::start(cuda, "127.0.0.1:0").await;
    if cfg!(feature = "cuda") {
        // A cuda build fails only where there is no GPU, naming what is missing.
        if let Err(err) = started {
            ensure!(err.to_string().contains("CUDA"), "{err}");
        }
    } else {
        let err = started.err().context("cuda must fail")?;
        ensure!(err.to_string().contains("this build has no CUDA support (build with --features cuda)"), "{err}");
    }
    let no_next = stage_config(model.path(), 0, 0..2, None);
    ensure!(Worker::start(no_next, "127.0.0.1:0").await.is_err(), "a non-final stage needs next");
    let outside = stage_config(model.path(), 1, 2..9, None);
    ensure!(Worker::start(outside, "127.0.0.1:0").await.is_err(), "layers beyond the model");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_prompt_with_streams_still_open() -> Result<()> {
    let model = common::tiny_model()?;
    let workers = start_chain(model.path(), &[0, 2, 4]).await?;
    let mut stream = Stream::open(&workers[0]).await?;
    stream.send(prefill(1, 1, &[1, 2, 3])).await?;
    ensure!(stream.recv().await?.error.is_none());
    // The client keeps its stream open; stopping the workers must still finish.
    stop_all(workers).await?;
    ensure!(stream.recv_within(Duration::from_secs(5)).await.is_err(), "the stream ends with the worker");
    Ok(())
}
