//! Prefix caching through the scheduler, on plain data: what the batches tell the stages, and how the budget
//! counts cached blocks.

use std::time::Instant;

use strata_proto::{ServiceError, pb};

use super::tests::{EPOCH, answer, limits, only_batch, request, sent, tokens};
use super::*;
use crate::pipeline::PrefixCaching;

/// One stage of `blocks` blocks of 4 tokens, prefix caching on.
fn caching(blocks: usize) -> Scheduler {
    let mut s = Scheduler::new(SchedulerLimits { prefix_caching: PrefixCaching::On, ..limits(512, 1) }, EPOCH, 0, 1);
    s.set_budget(KvBudget::new(4, blocks));
    s
}

/// Runs `req` alone to its end (`max_tokens` 1: prefill only), lets its release return, and returns its first
/// batch.
fn run_alone(s: &mut Scheduler, prompt: &[u32]) -> Result<pb::ForwardRequest, ServiceError> {
    Ok(run_alone_timed(s, prompt)?.0)
}

/// [`run_alone`], with the timing its token came with.
fn run_alone_timed(s: &mut Scheduler, prompt: &[u32]) -> Result<(pb::ForwardRequest, StepTiming), ServiceError> {
    let now = Instant::now();
    let id = s.admit(&request(prompt, 1))?;
    let batch = only_batch(&s.schedule(now));
    let effects = s.apply_response(answer(&batch), now);
    assert_eq!(tokens(&effects).len(), 1);
    let timing = effects.iter().find_map(|e| match e {
        Effect::Token { timing, .. } => Some(*timing),
        _ => None,
    });
    s.finish(id);
    release_all(s);
    Ok((batch, timing.unwrap_or_default()))
}

#[test]
fn a_prompt_starts_after_the_blocks_an_earlier_prompt_published() -> Result<(), ServiceError> {
    let mut s = caching(10);
    let first: Vec<u32> = (1..=10).collect();
    let a = run_alone(&mut s, &first)?;
    assert!(a.clear_prefix_cache, "the first batch of a budget clears the stages' caches");
    let published: Vec<(u32, u64)> = a.chunks[0].publish.iter().map(|p| (p.index, p.key)).collect();
    assert_eq!(published.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1], "two full blocks of 10 tokens");
    assert!(a.chunks[0].cached_blocks.is_empty());
    let g = s.gauges();
    assert_eq!((g.kv_cached, g.kv_free), (2, 10), "unused cached blocks count as free");

    // Same 8 first tokens: starts at 8 on both blocks and computes only its own 3 tokens.
    let mut second = first[..8].to_vec();
    second.extend([50, 51, 52]);
    let b = run_alone(&mut s, &second)?;
    let chunk = &b.chunks[0];
    assert!(!b.clear_prefix_cache);
    assert_eq!((chunk.start_pos, chunk.len), (8, 3));
    assert_eq!(chunk.cached_blocks, published.iter().map(|p| p.1).collect::<Vec<_>>());
    assert_eq!(chunk.cached_token_ids, first[..8]);
    assert_eq!(b.token_ids, [50, 51, 52]);
    assert!(chunk.publish.is_empty(), "its only full blocks were cached already");

    // A prompt of exactly the cached 8 tokens recomputes its last block: its last token's logits are sampled.
    let c = run_alone(&mut s, &first[..8])?;
    assert_eq!((c.chunks[0].start_pos, c.chunks[0].len, c.chunks[0].cached_blocks.len()), (4, 4, 1));
    assert_eq!(s.gauges().prefix, PrefixStats { queried_tokens: 29, hit_tokens: 12 });
    Ok(())
}

/// Lets every release the scheduler has to send return from the stages.
fn release_all(s: &mut Scheduler) {
    for effect in s.reap() {
        if let Effect::Release { blocks, cached, generation, .. } = effect {
            s.released(generation, blocks, &cached);
        }
    }
}

#[test]
fn blocks_its_output_fills_are_published_and_a_next_turn_starts_after_them() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = caching(10);
    let prompt: Vec<u32> = (1..=6).collect();
    let id = s.admit(&request(&prompt, 5))?;
    let (mut published, mut output) = (Vec::new(), Vec::new());
    while output.len() < 5 {
        let batch = only_batch(&s.schedule(now));
        let c = &batch.chunks[0];
        published.extend(c.publish.iter().map(|p| (c.start_pos + c.len, p.index, p.key)));
        output.extend(tokens(&s.apply_response(answer(&batch), now)).into_iter().map(|t| t.1));
    }
    s.finish(id);
    release_all(&mut s);
    // Block 0 with the prefill; block 1 (prompt tokens 5 and 6, outputs 1 and 2) with the decode step that fills
    // it, at position 7. Outputs 3 and 4 were fed at positions 8 and 9: block 2 is not full.
    assert_eq!(published.iter().map(|p| (p.0, p.1)).collect::<Vec<_>>(), [(6, 0), (8, 1)]);
    assert_eq!(s.gauges().kv_cached, 2);

    // The next turn repeats the prompt and the answer: it starts after both blocks.
    let mut turn: Vec<u32> = prompt.iter().chain(&output[..2]).copied().collect();
    turn.extend([70, 71, 72]);
    let (b, timing) = run_alone_timed(&mut s, &turn)?;
    let chunk = &b.chunks[0];
    assert_eq!((chunk.start_pos, chunk.len), (8, 3));
    assert_eq!(timing.cached_tokens, 8, "its usage says how many prompt tokens were cached");
    assert_eq!(chunk.cached_blocks, published.iter().map(|p| p.2).collect::<Vec<_>>());
    assert_eq!(chunk.cached_token_ids, turn[..8]);
    // An answer that differs in its second token shares only the prompt's block.
    let mut other: Vec<u32> = prompt.iter().chain([&output[0], &99]).copied().collect();
    other.extend([70, 71, 72]);
    let c = run_alone(&mut s, &other)?;
    assert_eq!((c.chunks[0].start_pos, c.chunks[0].cached_blocks.len()), (4, 1));
    Ok(())
}

#[test]
fn cached_blocks_no_sequence_uses_are_evicted_for_room_and_the_next_batch_says_so() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = caching(4);
    run_alone(&mut s, &(1..=9).collect::<Vec<_>>())?; // publishes 2 blocks
    assert_eq!(s.gauges().kv_cached, 2);
    // 13 tokens need 4 blocks: both cached ones go, the end of the chain first, and the batch evicts them.
    let id = s.admit(&request(&(100..113).collect::<Vec<_>>(), 1))?;
    let batch = only_batch(&s.schedule(now));
    assert_eq!(batch.evict_blocks.len(), 2);
    assert_eq!(batch.chunks[0].start_pos, 0);
    let g = s.gauges();
    assert_eq!((g.kv_cached, g.kv_free), (3, 0), "it published three blocks of its own, which it still uses");
    s.apply_response(answer(&batch), now);
    s.finish(id);
    let release = s.reap();
    assert!(
        release.iter().any(|e| matches!(e, Effect::Release { cached, .. } if cached.len() == 3)),
        "the release carries the cached blocks it used: {release:?}"
    );
    assert_eq!(s.gauges().kv_free, 0, "until the release returns, its blocks are held");
    Ok(())
}

#[test]
fn a_preempted_sequence_gives_its_cached_blocks_back_and_a_new_budget_forgets_the_cache() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = caching(10);
    let prompt: Vec<u32> = (1..=9).collect();
    run_alone(&mut s, &prompt)?;
    s.admit(&request(&prompt, 4))?;
    let batch = only_batch(&s.schedule(now));
    assert_eq!(batch.chunks[0].cached_blocks.len(), 2);
    // The stages fail: it is requeued, and its release carries the cached blocks it used.
    let fx = s.apply_response(
        pb::ForwardResponse {
            batch_id: batch.batch_id,
            error: Some(ServiceError::unavailable("stage down").into()),
            ..Default::default()
        },
        now,
    );
    assert!(fx.iter().any(|e| matches!(e, Effect::Release { cached, .. } if cached.len() == 2)), "{fx:?}");
    // Reconnected: a new budget and an empty cache; the stages are told to clear theirs, and the sequence is
    // recomputed from position 0.
    s.set_budget(KvBudget::new(4, 10));
    let batch = only_batch(&s.schedule(now));
    assert!(batch.clear_prefix_cache);
    assert_eq!((batch.chunks[0].start_pos, batch.chunks[0].cached_blocks.len()), (0, 0));
    assert_eq!(batch.chunks[0].publish.len(), 2);
    assert_eq!(sent(&s.apply_response(answer(&batch), now)).len(), 0);
    Ok(())
}

#[test]
fn off_or_auto_with_a_stage_whose_results_depend_on_batching_it_sends_no_cache_orders() -> Result<(), ServiceError> {
    let status =
        |batch_invariant| pb::StageStatus { kv_total_blocks: 10, block_size: 4, batch_invariant, ..Default::default() };
    for (setting, statuses, cached) in [
        (PrefixCaching::Off, vec![status(true)], false),
        (PrefixCaching::Auto, vec![status(true), status(false)], false),
        (PrefixCaching::Auto, vec![status(true), status(true)], true),
        (PrefixCaching::On, vec![status(false)], true),
    ] {
        let mut s = Scheduler::new(SchedulerLimits { prefix_caching: setting, ..limits(512, 1) }, EPOCH, 0, 1);
        s.set_budget(KvBudget::from_statuses(&statuses)?);
        run_alone(&mut s, &(1..=9).collect::<Vec<_>>())?;
        let b = run_alone(&mut s, &(1..=9).collect::<Vec<_>>())?;
        assert_eq!(!b.chunks[0].cached_blocks.is_empty(), cached, "{setting:?} {statuses:?}");
        assert_eq!(s.gauges().prefix != PrefixStats::default(), cached);
    }
    Ok(())
}

#[test]
fn blocks_a_refused_batch_published_leave_the_cache_and_the_stages_are_told() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = caching(10);
    let prompt: Vec<u32> = (1..=9).collect();
    let id = s.admit(&request(&prompt, 1))?;
    let batch = only_batch(&s.schedule(now));
    let keys: Vec<u64> = batch.chunks[0].publish.iter().map(|p| p.key).collect();
    assert_eq!(keys.len(), 2);
    // A stage after the first ones (which published both blocks) has no room for them.
    let refused = pb::ForwardResponse {
        batch_id: batch.batch_id,
        error: Some(ServiceError::resource_exhausted("no free KV blocks").into()),
        ..Default::default()
    };
    let fx = s.apply_response(refused, now);
    let released: Vec<_> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Release { blocks, cached, generation, .. } => Some((*blocks, cached.clone(), *generation)),
            _ => None,
        })
        .collect();
    assert_eq!(released.iter().map(|r| (r.0, r.1.len())).collect::<Vec<_>>(), [(3, 0)], "all 3 blocks its own again");
    assert_eq!(s.gauges().kv_cached, 0, "the cache forgot them");
    for (blocks, cached, generation) in released {
        s.released(generation, blocks, &cached);
    }
    // The recompute starts from scratch, the same batch evicts the keys on every stage, and publishes them anew.
    let again = only_batch(&s.schedule(now));
    assert_eq!(again.evict_blocks, keys);
    assert_eq!((again.chunks[0].start_pos, again.chunks[0].cached_blocks.len()), (0, 0));
    assert_eq!(again.chunks[0].publish.iter().map(|p| p.key).collect::<Vec<_>>(), keys);
    s.apply_response(answer(&again), now);
    s.finish(id);
    release_all(&mut s);
    let g = s.gauges();
    assert_eq!((g.kv_cached, g.kv_free), (2, 10), "idle and whole again");
    Ok(())
}
