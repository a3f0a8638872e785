//! Real gRPC pipelines on 127.0.0.1: 1, 2 and 3 chained workers generate exactly what the single-process
//! engine generates (greedy, bit for bit), with several sequences interleaved and two micro-batches in flight.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{Stream, interleaved, start_chain, stop_all};
use strata_proto::pb;

async fn chain_matches_engine(bounds: &[usize]) -> Result<()> {
    let model = common::tiny_model()?;
    let expected = interleaved(8).run_engine(model.path())?;
    let workers = start_chain(model.path(), bounds).await?;
    let mut stream = Stream::open(&workers[0]).await?;
    let (got, rounds) = interleaved(8).run_stream(&mut stream).await?;
    ensure!(got == expected, "stages {bounds:?}: pipeline {got:?} != engine {expected:?}");
    ensure!(got.values().all(|t| t.len() == 8));
    // The comparison has teeth: the sequences differ and do not repeat a single token.
    let distinct: std::collections::HashSet<&Vec<u32>> = got.values().collect();
    ensure!(distinct.len() == got.len(), "identical continuations: {got:?}");
    ensure!(got.values().all(|t| t.iter().any(|&x| x != t[0])), "constant continuations: {got:?}");
    let decode = &rounds[2..];
    let mean = decode.iter().sum::<Duration>() / decode.len().max(1) as u32;
    eprintln!("stages {bounds:?}: mean decode round (2 micro-batches in flight) {mean:?}");
    drop(stream);
    stop_all(workers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stage_matches_the_engine() -> Result<()> {
    chain_matches_engine(&[0, 4]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stages_match_the_engine() -> Result<()> {
    chain_matches_engine(&[0, 2, 4]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_stages_match_the_engine() -> Result<()> {
    chain_matches_engine(&[0, 1, 3, 4]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_carry_every_stage_timing_and_logprobs() -> Result<()> {
    let model = common::tiny_model()?;
    let workers = start_chain(model.path(), &[0, 1, 3, 4]).await?;
    let mut stream = Stream::open(&workers[0]).await?;
    let mut c = common::chunk(9, 0, 3, false);
    c.want_logprobs = true;
    stream
        .send(pb::ForwardRequest { batch_id: 42, chunks: vec![c], token_ids: vec![1, 2, 3], ..Default::default() })
        .await?;
    let resp = stream.recv().await?;
    ensure!(resp.error.is_none(), "{:?}", resp.error);
    ensure!(resp.batch_id == 42);
    let stages: Vec<u32> = resp.timings.iter().map(|t| t.stage_index).collect();
    ensure!(stages == vec![0, 1, 2], "timings first stage first: {stages:?}");
    ensure!(resp.stage_compute_micros == resp.timings.iter().map(|t| t.compute_micros).sum::<u64>());
    let lp = resp.tokens.first().and_then(|t| t.logprob);
    ensure!(lp.is_some_and(|lp| lp <= 0.0 && lp.is_finite()), "logprob {lp:?}");
    drop(stream);
    stop_all(workers).await
}

/// The last stage answers on the coordinator's `Answers` stream when the batch's term has one open: only an
/// acknowledgement comes up the `Forward` streams, and stage 0 keeps it from the coordinator; without a stream
/// (none yet, or closed) answers come relayed. A newer term's stream replaces the older one, which ends; an older
/// term's is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_stage_answers_straight_to_the_coordinator_when_it_listens() -> Result<()> {
    let model = common::tiny_model()?;
    let workers = start_chain(model.path(), &[0, 2, 4]).await?;
    let mut stream = Stream::open(&workers[0]).await?;
    let batch = |batch_id: u64, term: u64| pb::ForwardRequest {
        batch_id,
        term,
        chunks: vec![common::chunk(batch_id, 0, 3, false)],
        token_ids: vec![1, 2, 3],
        ..Default::default()
    };
    let within = |s| Duration::from_secs(s);
    stream.send(batch(1, 5)).await?;
    let relayed = stream.recv().await?;
    ensure!(!relayed.answered_directly && relayed.tokens.len() == 1, "no Answers stream yet: {relayed:?}");

    let mut last = common::client(&workers[1]).await?;
    let mut answers = last.answers(pb::AnswersRequest { term: 5 }).await?.into_inner();
    stream.send(batch(2, 5)).await?;
    let direct = tokio::time::timeout(within(10), answers.message()).await??.context("the Answers stream ended")?;
    ensure!(direct.batch_id == 2 && !direct.answered_directly, "{direct:?}");
    // The same prompt at the same positions samples the same token, whichever way it comes.
    ensure!(direct.tokens.first().map(|t| t.token_id) == relayed.tokens.first().map(|t| t.token_id), "{direct:?}");
    let stages: Vec<u32> = direct.timings.iter().map(|t| t.stage_index).collect();
    ensure!(stages == vec![0, 1], "every stage's timing, first stage first: {stages:?}");
    ensure!(direct.stage_compute_micros == direct.timings.iter().map(|t| t.compute_micros).sum::<u64>());
    let nothing = stream.recv_within(Duration::from_millis(300)).await;
    ensure!(nothing.is_err(), "stage 0 passes no acknowledgement on to the coordinator: {nothing:?}");
    for worker in &workers {
        ensure!(common::status(worker).await?.inflight_batches == 0, "the acknowledgement freed stage 0's wait");
    }

    // Another term's batch has no route here: relayed.
    let mut newer = last.answers(pb::AnswersRequest { term: 7 }).await?.into_inner();
    ensure!(tokio::time::timeout(within(10), answers.message()).await??.is_none(), "the replaced stream ends");
    stream.send(batch(3, 6)).await.ok();
    // Term 6 is older than 7 now: refused on its way in, as a deposed leader's batch is.
    let refused = stream.recv().await?;
    ensure!(refused.error.is_some(), "{refused:?}");
    stream.send(batch(4, 7)).await?;
    ensure!(tokio::time::timeout(within(10), newer.message()).await??.is_some_and(|r| r.batch_id == 4));
    let stale = last.answers(pb::AnswersRequest { term: 5 }).await;
    ensure!(
        stale.as_ref().is_err_and(|s| s.code() == tonic::Code::FailedPrecondition),
        "older term: {:?}",
        stale.err()
    );

    // The coordinator hangs up: answers come relayed again.
    drop(newer);
    tokio::time::sleep(Duration::from_millis(200)).await;
    stream.send(batch(5, 7)).await?;
    let back = stream.recv().await?;
    ensure!(!back.answered_directly && back.tokens.len() == 1, "relayed once the stream is gone: {back:?}");
    drop(stream);
    stop_all(workers).await
}

/// SmolLM2 split over two workers generates what the engine generates with all 30 layers in one process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_two_stages_match_the_engine() -> Result<()> {
    let model = common::smollm2();
    let files = strata_engine::loader::ModelFiles::open(&model)?;
    let n = files.config().num_layers;
    drop(files);
    // "The capital of France is" in SmolLM2's vocabulary, and a second prompt in the other micro-batch.
    let schedule = || common::Schedule::new(&[(1, vec![504, 3575, 282, 4649, 314], 0, 0), (2, vec![1, 2, 3], 0, 1)], 6);
    let expected = schedule().run_engine(&model)?;
    let workers = start_chain(&model, &[0, n / 2, n]).await?;
    let mut stream = Stream::open(&workers[0]).await?;
    let (got, rounds) = schedule().run_stream(&mut stream).await?;
    ensure!(got == expected, "pipeline {got:?} != engine {expected:?}");
    let decode = &rounds[1..];
    let mean = decode.iter().sum::<Duration>() / decode.len().max(1) as u32;
    eprintln!("SmolLM2 2 stages: mean decode round (2 micro-batches in flight) {mean:?}");
    drop(stream);
    stop_all(workers).await
}
