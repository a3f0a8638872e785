//! Coordinator terms over real gRPC: a deposed leader's batches and releases are refused, the first batch of a
//! newer term frees the older term's sequences on every stage it reaches, and term 0 changes nothing.

mod common;

use anyhow::{Result, ensure};
use common::{Stream, chunk, client, start_chain, status, stop_all};
use strata_proto::{ErrorCode, ServiceError, pb};
use tonic::Code;

fn batch(batch_id: u64, term: u64, seq_id: u64, start: u32, ids: &[u32]) -> pb::ForwardRequest {
    pb::ForwardRequest {
        batch_id,
        term,
        chunks: vec![chunk(seq_id, start, ids.len() as u32, false)],
        token_ids: ids.to_vec(),
        ..Default::default()
    }
}

fn release(term: u64, seq_ids: Vec<u64>) -> pb::ReleaseRequest {
    pb::ReleaseRequest { seq_ids, propagate: true, term }
}

/// The error of a response (`None` when the batch succeeded).
fn error_of(resp: &pb::ForwardResponse) -> Option<ServiceError> {
    resp.error.clone().map(ServiceError::from)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn older_terms_are_refused_and_the_term_travels_down() -> Result<()> {
    let model = common::tiny_model()?;
    let workers = start_chain(model.path(), &[0, 2, 4]).await?;
    let mut stream = Stream::open(&workers[0]).await?;

    // Term 0 (no election) works as it always did.
    stream.send(batch(1, 0, 1, 0, &[1, 2, 3])).await?;
    ensure!(error_of(&stream.recv().await?).is_none());
    for w in &workers {
        ensure!(status(w).await?.term == 0);
    }

    // A term-5 batch raises every stage it passes through.
    stream.send(batch(2, 5, 2, 0, &[4, 5])).await?;
    ensure!(error_of(&stream.recv().await?).is_none());
    for w in &workers {
        let s = status(w).await?;
        ensure!(s.term == 5, "{} reports term {}", s.node_id, s.term);
    }

    // Older terms (0 included) are refused with FAILED_PRECONDITION, and the stream stays usable.
    for (id, term) in [(3, 4), (4, 0)] {
        stream.send(batch(id, term, 3, 0, &[6])).await?;
        let err = error_of(&stream.recv().await?);
        let (code, message) = err.map(|e| (e.code, e.message)).unwrap_or((ErrorCode::Internal, String::new()));
        ensure!(code == ErrorCode::FailedPrecondition, "term {term}: {code:?} {message}");
        ensure!(message.contains(&format!("stale coordinator term {term} < 5")), "{message}");
    }
    let mut c = client(&workers[0]).await?;
    let refused = c.release(release(4, vec![2])).await;
    ensure!(
        refused.as_ref().is_err_and(|s| s.code() == Code::FailedPrecondition && s.message().contains("term 4 < 5")),
        "{refused:?}"
    );
    // The refused release freed nothing; the current term's does, on every stage (the release keeps its term).
    let s = status(&workers[1]).await?;
    ensure!(s.kv_free_blocks < s.kv_total_blocks, "{s:?}");
    ensure!(c.release(release(5, vec![2])).await?.into_inner().released == 1);
    for w in &workers {
        let s = status(w).await?;
        ensure!(s.kv_free_blocks == s.kv_total_blocks, "{} still holds blocks: {s:?}", s.node_id);
    }
    drop(stream);
    stop_all(workers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_term_frees_the_older_terms_sequences() -> Result<()> {
    let model = common::tiny_model()?;
    let workers = start_chain(model.path(), &[0, 1, 4]).await?;
    let mut stream = Stream::open(&workers[0]).await?;
    // Term 1: two sequences, 2 + 1 blocks of 4 tokens on each stage.
    stream.send(batch(1, 1, 10, 0, &[1, 2, 3, 4, 5, 6])).await?;
    stream.send(batch(2, 1, 11, 0, &[7, 8, 9])).await?;
    for _ in 0..2 {
        ensure!(error_of(&stream.recv().await?).is_none());
    }
    for w in &workers {
        let s = status(w).await?;
        ensure!(s.kv_free_blocks == s.kv_total_blocks - 3, "{s:?}");
    }

    // The new leader's first batch (2 blocks): each stage frees the old sequences before running it.
    stream.send(batch(3, 2, 20, 0, &[1, 2, 3, 4, 5])).await?;
    ensure!(error_of(&stream.recv().await?).is_none());
    for w in &workers {
        let s = status(w).await?;
        ensure!(s.term == 2 && s.kv_free_blocks == s.kv_total_blocks - 2, "only the new batch's blocks: {s:?}");
    }
    // The old sequences are gone: the deposed leader is refused, and the new one finds no cache for them.
    stream.send(batch(4, 1, 10, 6, &[7])).await?;
    ensure!(error_of(&stream.recv().await?).map(|e| e.code) == Some(ErrorCode::FailedPrecondition));
    stream.send(batch(5, 2, 10, 6, &[7])).await?;
    ensure!(error_of(&stream.recv().await?).map(|e| e.code) == Some(ErrorCode::NotFound));
    // The new sequence decodes on.
    stream.send(batch(6, 2, 20, 5, &[9])).await?;
    ensure!(error_of(&stream.recv().await?).is_none());

    // A release of a newer term frees everything too, on every stage.
    ensure!(client(&workers[0]).await?.release(release(3, vec![])).await.is_ok());
    for w in &workers {
        let s = status(w).await?;
        ensure!(s.term == 3 && s.kv_free_blocks == s.kv_total_blocks, "{s:?}");
    }
    drop(stream);
    stop_all(workers).await
}
