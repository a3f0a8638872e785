//! Prefix caching through a real 3-stage loopback cluster on the real SmolLM2 file: prompts that share a system
//! prompt start on its cached blocks on every stage, and every stream's greedy tokens equal what its prompt
//! produces alone in a single process with nothing cached, also when the KV cache is too small for all of them
//! and sequences are preempted and recomputed, and across plan changes, which empty the cache. A chat's next turn
//! (the prompt, the answer, a new question) starts after the blocks the answer filled as well. Idle, every block
//! counts as free again while the cache keeps the shared prompt, the same on each stage as the coordinator counts.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use strata_coordinator::{PrefixCaching, SchedulerLimits};
use strata_tests::{StageSizing, TestCluster, eventually, reference, smollm2, static_plan};

/// SmolLM2's 30 layers over three stages.
const BOUNDS: [usize; 4] = [0, 10, 20, 30];
const MAX_TOKENS: u32 = 6;

/// A 41-token "system prompt" (10 full blocks of 4 and one token more) and a question of its own for stream `i`.
fn prompt(i: usize) -> Vec<u32> {
    let system = (0..41u32).map(|j| 200 + j * 613 % 20_000);
    let question = (0..3 + i % 4).map(|j| 30_000 + u32::try_from(i * 97 + j * 13).unwrap_or(0));
    system.chain(question).collect()
}

/// Token ids of several sequences.
type Sequences = Vec<Vec<u32>>;

/// The first `n` prompts, and the tokens each one produces alone in a single process with nothing cached.
fn prompts_and_alone(model: &std::path::Path, n: usize) -> Result<(Sequences, Sequences)> {
    let prompts: Sequences = (0..n).map(prompt).collect();
    let alone = prompts.iter().map(|p| reference(model, 1, p, MAX_TOKENS as usize)).collect::<Result<_>>()?;
    Ok((prompts, alone))
}

/// Runs every prompt concurrently and checks each stream against its single-process tokens.
async fn run_and_check(cluster: &TestCluster, prompts: &[Vec<u32>], alone: &[Vec<u32>]) -> Result<()> {
    for (i, (got, expected)) in cluster.generate_all(prompts, MAX_TOKENS).await?.into_iter().zip(alone).enumerate() {
        let got = got.with_context(|| format!("stream {i}"))?;
        ensure!(&got.token_ids == expected, "stream {i}: {:?} != alone {expected:?}", got.token_ids);
    }
    Ok(())
}

fn sizing(kv_blocks: usize) -> StageSizing {
    let limits = SchedulerLimits { prefix_caching: PrefixCaching::On, ..SchedulerLimits::default() };
    StageSizing { kv_blocks, limits, ..StageSizing::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_sharing_a_system_prompt_reuse_its_blocks_and_generate_the_same_tokens() -> Result<()> {
    let model = smollm2();
    let (prompts, alone) = prompts_and_alone(&model, 6)?;
    let cluster = TestCluster::start(&model, &BOUNDS, sizing(256)).await?;
    // One first, so that the others find its blocks; then all of them, twice.
    run_and_check(&cluster, &prompts[..1], &alone[..1]).await?;
    for _ in 0..2 {
        run_and_check(&cluster, &prompts, &alone).await?;
    }
    let metrics = cluster.pipeline.metrics();
    let (queried, hits) = (metrics.prefix_cache_queries.get(), metrics.prefix_cache_hits.get());
    // 13 streams; every one after the first finds at least the 40 tokens of the 10 shared blocks.
    ensure!(hits >= 12 * 40 && hits < queried, "{hits} of {queried} prompt tokens found cached");
    ensure!(cluster.pipeline.preemptions() == 0);

    // The next turn of stream 0's chat: its 44-token prompt and 6-token answer fill 12 blocks (the answer's last
    // token was never fed back, so 49 positions), all cached.
    let turn: Vec<u32> = prompts[0].iter().chain(&alone[0]).copied().chain([30_500, 30_501]).collect();
    let expected = reference(&model, 1, &turn, MAX_TOKENS as usize)?;
    run_and_check(&cluster, std::slice::from_ref(&turn), &[expected]).await?;
    let found = metrics.prefix_cache_hits.get() - hits;
    ensure!(found == 12 * 4, "the next turn found {found} tokens cached, not the 48 of its prompt and answer");

    // Idle: every block is free or cached unused, and every stage caches the same blocks.
    eventually(Duration::from_secs(10), || cluster.kv_all_free()).await.context("KV blocks were not all returned")?;
    let cached = cached_per_stage(&cluster).await?;
    ensure!(cached[0] >= 10 && cached.iter().all(|&c| c == cached[0]), "cached blocks per stage: {cached:?}");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_too_little_kv_cached_blocks_are_evicted_and_preempted_streams_still_match() -> Result<()> {
    let model = smollm2();
    let (prompts, alone) = prompts_and_alone(&model, 8)?;
    // 24 blocks of 4 tokens: the 10 shared blocks, and 14 for 8 streams that need up to 3 each of their own.
    let cluster = TestCluster::start(&model, &BOUNDS, sizing(24)).await?;
    run_and_check(&cluster, &prompts, &alone).await?;
    ensure!(cluster.pipeline.preemptions() > 0, "the cache is meant to be too small for every stream at once");
    ensure!(cluster.pipeline.metrics().prefix_cache_hits.get() > 0, "later streams reuse the system prompt");
    // A different prompt needs the room the cached blocks hold: they are evicted, and it still matches.
    let other: Vec<u32> = (0..80u32).map(|j| 5_000 + j * 7).collect();
    let expected = reference(&model, 1, &other, MAX_TOKENS as usize)?;
    run_and_check(&cluster, &[other], &[expected]).await?;
    eventually(Duration::from_secs(10), || cluster.kv_all_free()).await.context("KV blocks were not all returned")?;
    cluster.stop().await
}

/// The blocks each stage of `cluster` caches.
async fn cached_per_stage(cluster: &TestCluster) -> Result<Vec<u64>> {
    let mut cached = Vec::new();
    for i in 0..cluster.workers.len() {
        cached.push(cluster.stage_status(i).await?.kv_cached_blocks);
    }
    Ok(cached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_change_empties_the_cache_and_the_stages_hold_what_the_coordinator_counts() -> Result<()> {
    let model = smollm2();
    let (prompts, alone) = prompts_and_alone(&model, 3)?;
    let a = TestCluster::start(&model, &BOUNDS, sizing(256)).await?;
    let b = TestCluster::start(&model, &[0, 15, 30], sizing(256)).await?;
    let plan_on = |cluster: &TestCluster, bounds: &[usize]| {
        let stages: Vec<_> = cluster
            .workers
            .iter()
            .zip(bounds.windows(2))
            .map(|(w, r)| (w.local_addr().to_string(), r[0]..r[1]))
            .collect();
        static_plan(&a.pipeline.model().name, 30, &stages)
    };
    let metrics = a.pipeline.metrics().clone();
    let hits = || metrics.prefix_cache_hits.get();
    for p in prompts.iter().zip(&alone) {
        run_and_check(&a, std::slice::from_ref(p.0), std::slice::from_ref(p.1)).await?;
    }
    ensure!(hits() >= 2 * 40, "the second and third prompts reuse the first one's blocks: {}", hits());
    // To other workers and back: each switch starts an empty cache, so nothing is found right after it.
    for (cluster, bounds) in [(&b, &[0, 15, 30][..]), (&a, &BOUNDS[..])] {
        a.pipeline.set_plan(plan_on(cluster, bounds)).await?;
        let before = hits();
        run_and_check(&a, &prompts[..1], &alone[..1]).await?;
        ensure!(hits() == before, "a new plan starts with an empty prefix cache");
    }
    // Back on the first workers, their stale blocks were cleared: each stage holds what this plan published,
    // which is what the coordinator counts.
    eventually(Duration::from_secs(10), || a.kv_all_free()).await?;
    let cached = cached_per_stage(&a).await?;
    let counted = u64::try_from(metrics.kv_blocks_cached.get()).unwrap_or(0);
    // The first prompt's 44 tokens and the 5 of its answer fed back fill 12 blocks.
    ensure!(counted == 12 && cached.iter().all(|&c| c == counted), "stages {cached:?}, coordinator {counted}");
    b.stop().await?;
    a.stop().await
}
