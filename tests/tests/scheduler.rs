//! The coordinator's scheduler through a real 3-stage loopback cluster: many concurrent streams, chunked
//! prefill, preemption when the KV cache is full, and admission control under a burst. Greedy tokens must
//! always equal what each prompt produces alone in a single process, and every KV block must come back.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use strata_coordinator::SchedulerLimits;
use strata_engine::sampling::SamplingParams;
use strata_proto::pb;
use strata_tests::{
    StageSizing, TestCluster, eventually, generate, ids_request, reference, reference_sampled, tiny_model,
};

const BOUNDS: [usize; 4] = [0, 1, 3, 4];

/// A deterministic prompt of `len` tokens in the tiny model's vocabulary (300).
fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len).map(|j| u32::try_from((i * 37 + j * 11 + 1) % 300).unwrap_or(1)).collect()
}

/// Waits until every stage's KV cache is entirely free again.
async fn kv_returns_to_full(cluster: &TestCluster) -> Result<()> {
    eventually(Duration::from_secs(10), || cluster.kv_all_free()).await.context("KV blocks were not all returned")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams_get_what_they_get_alone() -> Result<()> {
    let model = tiny_model()?;
    let prompts: Vec<Vec<u32>> = (0..32).map(|i| prompt(i, 1 + i % 9)).collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| reference(model.path(), 1, p, 12)).collect::<Result<_>>()?;
    let sizing = StageSizing { kv_blocks: 256, ..StageSizing::default() };
    let cluster = TestCluster::start(model.path(), &BOUNDS, sizing).await?;
    for (i, (got, expected)) in cluster.generate_all(&prompts, 12).await?.into_iter().zip(&alone).enumerate() {
        assert_eq!(&got?.token_ids, expected, "stream {i}");
    }
    ensure!(cluster.pipeline.preemptions() == 0, "nothing should be preempted with room to spare");
    kv_returns_to_full(&cluster).await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_survives_preemption() -> Result<()> {
    let model = tiny_model()?;
    // As below: 8 sequences of 6 + 14 tokens on 16 blocks of 4 must preempt. Each request, run alone first,
    // fits; a recomputed sequence must keep drawing the seeded stream where it left off.
    let sizing = StageSizing { kv_blocks: 16, block_size: 4, ..StageSizing::default() };
    let cluster = TestCluster::start(model.path(), &BOUNDS, sizing).await?;
    let seeded = |i: usize| pb::GenerateRequest {
        sampling: Some(pb::SamplingParams { temperature: 1.5, seed: Some(100 + i as u64), ..Default::default() }),
        ..ids_request(&prompt(i, 6), 14)
    };
    let mut client = cluster.client().await?;
    let mut alone = Vec::new();
    for i in 0..8 {
        alone.push(generate(&mut client, seeded(i)).await?.token_ids);
    }
    ensure!(cluster.pipeline.preemptions() == 0, "one request at a time fits");
    for (i, (got, expected)) in
        cluster.generate_requests((0..8).map(seeded).collect()).await?.into_iter().zip(&alone).enumerate()
    {
        assert_eq!(&got?.token_ids, expected, "stream {i}");
    }
    ensure!(cluster.pipeline.preemptions() > 0, "the KV cache was oversubscribed but nothing was preempted");
    kv_returns_to_full(&cluster).await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_kv_cache_preempts_and_recomputes_without_changing_tokens() -> Result<()> {
    let model = tiny_model()?;
    // 8 sequences of 6 + 14 tokens need 5 blocks of 4 each (40); the stages hold 16.
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(i, 6)).collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| reference(model.path(), 1, p, 14)).collect::<Result<_>>()?;
    let sizing = StageSizing { kv_blocks: 16, block_size: 4, ..StageSizing::default() };
    let cluster = TestCluster::start(model.path(), &BOUNDS, sizing).await?;
    for (i, (got, expected)) in cluster.generate_all(&prompts, 14).await?.into_iter().zip(&alone).enumerate() {
        assert_eq!(&got?.token_ids, expected, "stream {i}");
    }
    ensure!(cluster.pipeline.preemptions() > 0, "the KV cache was oversubscribed but nothing was preempted");
    kv_returns_to_full(&cluster).await?;
    // A request that could never fit, even alone, is refused up front.
    let mut client = cluster.client().await?;
    let err = generate(&mut client, ids_request(&prompt(0, 10), 60)).await.err().context("64+ tokens fit in 64")?;
    ensure!(err.code() == tonic::Code::InvalidArgument && err.message().contains("KV blocks"), "{err:?}");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_and_frequency_penalties_survive_preemption() -> Result<()> {
    let model = tiny_model()?;
    // As above, 8 sequences of 6 + 14 tokens on 16 blocks of 4 must preempt; a recomputed sequence is prefilled
    // from prompt and output at once, and its penalties must still count only the output.
    let (presence, frequency) = (0.7, 0.5);
    let engine_params = SamplingParams::default().with_penalties(presence, frequency);
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(i, 6)).collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(reference_sampled(model.path(), 1, p, 14, engine_params.clone())?);
    }
    let greedy: Vec<Vec<u32>> = prompts.iter().map(|p| reference(model.path(), 1, p, 14)).collect::<Result<_>>()?;
    ensure!(alone != greedy, "the penalties changed no token: the test would not see them ignored");
    let sizing = StageSizing { kv_blocks: 16, block_size: 4, ..StageSizing::default() };
    let cluster = TestCluster::start(model.path(), &BOUNDS, sizing).await?;
    let sampling =
        pb::SamplingParams { presence_penalty: presence, frequency_penalty: frequency, ..Default::default() };
    let requests = prompts.iter().map(|p| pb::GenerateRequest { sampling: Some(sampling), ..ids_request(p, 14) });
    for (i, (got, expected)) in cluster.generate_requests(requests.collect()).await?.into_iter().zip(&alone).enumerate()
    {
        assert_eq!(&got?.token_ids, expected, "stream {i}");
    }
    ensure!(cluster.pipeline.preemptions() > 0, "the KV cache was oversubscribed but nothing was preempted");
    kv_returns_to_full(&cluster).await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_prefilled_in_chunks() -> Result<()> {
    let model = tiny_model()?;
    let limits = SchedulerLimits { max_batch_tokens: 4, ..SchedulerLimits::default() };
    let cluster = TestCluster::start(model.path(), &BOUNDS, StageSizing { limits, ..StageSizing::default() }).await?;
    let long = prompt(3, 11);
    let expected = reference(model.path(), 1, &long, 10)?;
    let mut client = cluster.client().await?;
    let got = generate(&mut client, ids_request(&long, 10)).await?;
    assert_eq!(got.token_ids, expected);
    let usage = got.usage.context("no usage")?;
    // 11 prompt tokens in chunks of 4 (3 steps, the last one sampled), then 9 decode steps.
    assert_eq!(usage.steps, 3 + 9, "{usage:?}");
    // Chunks of concurrent prompts interleave with each other and with decode steps.
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 5 + 3 * i)).collect();
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| reference(model.path(), 1, p, 6)).collect::<Result<_>>()?;
    for (i, (got, expected)) in cluster.generate_all(&prompts, 6).await?.into_iter().zip(&alone).enumerate() {
        assert_eq!(&got?.token_ids, expected, "stream {i}");
    }
    kv_returns_to_full(&cluster).await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_capacity_is_resource_exhausted_while_admitted_requests_finish() -> Result<()> {
    let model = tiny_model()?;
    let limits = SchedulerLimits { max_concurrent_requests: 4, ..SchedulerLimits::default() };
    let cluster = TestCluster::start(model.path(), &BOUNDS, StageSizing { limits, ..StageSizing::default() }).await?;
    let prompts: Vec<Vec<u32>> = (0..24).map(|i| prompt(i, 4)).collect();
    let (mut ok, mut refused) = (0, 0);
    for (i, got) in cluster.generate_all(&prompts, 40).await?.into_iter().enumerate() {
        match got {
            Ok(c) => {
                assert_eq!(c.token_ids, reference(model.path(), 1, &prompts[i], 40)?, "stream {i}");
                assert_eq!(c.finish_reason, pb::FinishReason::Length as i32);
                ok += 1;
            }
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "stream {i}: {status:?}");
                assert!(status.message().contains("overloaded"), "{status:?}");
                refused += 1;
            }
        }
    }
    ensure!(ok >= 4 && refused >= 1, "{ok} finished, {refused} refused");
    kv_returns_to_full(&cluster).await?;
    // Once the burst is over, requests are admitted again.
    let mut client = cluster.client().await?;
    ensure!(generate(&mut client, ids_request(&prompt(1, 3), 2)).await?.token_ids.len() == 2);
    cluster.stop().await
}
