//! Stage 0 in front of a scripted next stage: batches go down without waiting for earlier answers, and
//! answers that come back out of order are relayed to the right batch.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::{Stream, chunk, stage_config, status};
use strata_proto::pb;
use strata_proto::pb::stage_server::{Stage, StageServer};
use strata_stage_worker::Worker;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

/// Answers batch 1 after 600 ms and any other batch after 300 ms, with one token per chunk whose id is the
/// row count of the hidden states it got, and the timings the batch brought (as a last stage does).
struct SlowStage;

#[tonic::async_trait]
impl Stage for SlowStage {
    type ForwardStream = ReceiverStream<Result<pb::ForwardResponse, Status>>;

    async fn forward(
        &self,
        request: Request<Streaming<pb::ForwardRequest>>,
    ) -> Result<Response<Self::ForwardStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            while let Ok(Some(req)) = inbound.message().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let delay = if req.batch_id == 1 { 600 } else { 300 };
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    let rows = req.hidden.as_ref().and_then(|h| h.shape.first().copied()).unwrap_or(0);
                    let tokens = req
                        .chunks
                        .iter()
                        .map(|c| pb::SampledToken { seq_id: c.seq_id, token_id: rows, logprob: None })
                        .collect();
                    let timings = req.timings.clone();
                    let resp = pb::ForwardResponse { batch_id: req.batch_id, tokens, timings, ..Default::default() };
                    let _ = tx.send(Ok(resp)).await;
                });
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type AnswersStream = ReceiverStream<Result<pb::ForwardResponse, Status>>;

    async fn answers(&self, _: Request<pb::AnswersRequest>) -> Result<Response<Self::AnswersStream>, Status> {
        Err(Status::unimplemented("answers"))
    }

    async fn release(&self, _: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        Err(Status::unimplemented("release"))
    }

    async fn status(&self, _: Request<pb::StageStatusRequest>) -> Result<Response<pb::StageStatus>, Status> {
        Err(Status::unimplemented("status"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_overlap_downstream_and_answers_match_by_batch_id() -> Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let slow_addr = listener.local_addr()?;
    let slow = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(StageServer::new(SlowStage))
            .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true))),
    );
    let model = common::tiny_model()?;
    let worker = Worker::start(stage_config(model.path(), 0, 0..2, Some(slow_addr.to_string())), "127.0.0.1:0").await?;
    let mut stream = Stream::open(&worker).await?;
    let batch = |batch_id: u64, len: u32| pb::ForwardRequest {
        batch_id,
        chunks: vec![chunk(batch_id, 0, len, false)],
        token_ids: vec![1; len as usize],
        ..Default::default()
    };
    let started = Instant::now();
    stream.send(batch(1, 3)).await?;
    stream.send(batch(2, 5)).await?;
    tokio::time::sleep(Duration::from_millis(150)).await;
    ensure!(status(&worker).await?.inflight_batches == 2, "both batches are downstream at once");
    let first = stream.recv().await?;
    let second = stream.recv().await?;
    let elapsed = started.elapsed();
    ensure!((first.batch_id, second.batch_id) == (2, 1), "answers are relayed as they come: {first:?} {second:?}");
    ensure!(first.tokens.first().map(|t| (t.seq_id, t.token_id)) == Some((2, 5)), "{first:?}");
    ensure!(second.tokens.first().map(|t| (t.seq_id, t.token_id)) == Some((1, 3)), "{second:?}");
    ensure!(first.timings.len() == 1 && first.timings[0].stage_index == 0, "stage 0 sends its timing on: {first:?}");
    // Serially this takes 900 ms; pipelined, 600 ms.
    ensure!(elapsed < Duration::from_millis(850), "batches did not overlap: {elapsed:?}");
    drop(stream);
    tokio::time::timeout(Duration::from_secs(10), worker.shutdown()).await??;
    slow.abort();
    Ok(())
}
