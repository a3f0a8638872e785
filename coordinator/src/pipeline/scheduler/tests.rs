//! The scheduler on plain data: exact batches for each input, no stages, no clock.

use std::time::{Duration, Instant};

use strata_proto::{ErrorCode, ServiceError, pb};

use super::*;
use crate::pipeline::PrefixCaching;

pub(super) const EPOCH: u64 = 7;

pub(super) fn request(prompt: &[u32], max_tokens: usize) -> SeqRequest {
    SeqRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens,
        sampling: pb::SamplingParams::default(),
        stop: Vec::new(),
        logprobs: false,
        ignore_eos: false,
    }
}

/// Limits with room for 64 requests, prefix caching off.
pub(super) fn limits(max_batch_tokens: usize, micro_batches_per_stage: usize) -> SchedulerLimits {
    SchedulerLimits {
        max_concurrent_requests: 64,
        max_batch_tokens,
        prefix_caching: PrefixCaching::Off,
        micro_batches_per_stage,
        max_batches_in_flight: 0,
    }
}

/// A scheduler over `stages` stages whose tightest one holds `blocks` KV blocks of `block_size` tokens, with 2
/// micro-batches in flight per stage: most tests here are about several batches in flight, even through one stage.
pub(super) fn scheduler(stages: usize, blocks: usize, block_size: usize, max_batch_tokens: usize) -> Scheduler {
    scheduler_with(limits(max_batch_tokens, 2), stages, blocks, block_size)
}

/// A scheduler with `limits` over `stages` stages whose tightest one holds `blocks` KV blocks of `block_size`
/// tokens.
fn scheduler_with(limits: SchedulerLimits, stages: usize, blocks: usize, block_size: usize) -> Scheduler {
    let mut s = Scheduler::new(limits, EPOCH, 0, stages);
    s.set_budget(KvBudget::new(block_size, blocks));
    s
}

/// The batches to send among `effects`.
pub(super) fn sent(effects: &[Effect]) -> Vec<pb::ForwardRequest> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send(b) => Some(b.clone()),
            _ => None,
        })
        .collect()
}

/// Each batch's chunks as (seq_id, start_pos, len, skip_sampling).
pub(super) fn batches(effects: &[Effect]) -> Vec<Vec<(u64, u32, u32, bool)>> {
    sent(effects)
        .iter()
        .map(|b| b.chunks.iter().map(|c| (c.seq_id, c.start_pos, c.len, c.skip_sampling)).collect())
        .collect()
}

/// Each batch's sequence ids.
fn seq_ids(effects: &[Effect]) -> Vec<Vec<u64>> {
    sent(effects).iter().map(|b| b.chunks.iter().map(|c| c.seq_id).collect()).collect()
}

/// The tokens handed to outputs, as (seq_id, token_id).
pub(super) fn tokens(effects: &[Effect]) -> Vec<(u64, u32)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Token { token, .. } => Some((token.seq_id, token.token_id)),
            _ => None,
        })
        .collect()
}

/// The last stage's answer to `batch` through two stages: token 1000 + seq_id for every sampled chunk.
pub(super) fn answer(batch: &pb::ForwardRequest) -> pb::ForwardResponse {
    let tokens = batch
        .chunks
        .iter()
        .filter(|c| !c.skip_sampling)
        .map(|c| pb::SampledToken { seq_id: c.seq_id, token_id: 1000 + c.seq_id as u32, logprob: None })
        .collect();
    let timings = vec![
        pb::StageTiming { stage_index: 1, compute_micros: 30, queue_micros: 4, handoff_micros: 2 },
        pb::StageTiming { stage_index: 0, compute_micros: 20, queue_micros: 3, handoff_micros: 1 },
    ];
    pb::ForwardResponse { batch_id: batch.batch_id, tokens, stage_compute_micros: 50, timings, ..Default::default() }
}

/// A stage's error answer to `batch`.
fn refuse(batch: &pb::ForwardRequest, error: ServiceError) -> pb::ForwardResponse {
    pb::ForwardResponse { batch_id: batch.batch_id, error: Some(error.into()), ..Default::default() }
}

/// The one batch among `effects`.
pub(super) fn only_batch(effects: &[Effect]) -> pb::ForwardRequest {
    let mut sent = sent(effects);
    assert_eq!(sent.len(), 1, "{effects:?}");
    sent.remove(0)
}

/// Two stages (4 batches in flight), 5 blocks of 1 token: four 1-token prompts take 4 blocks and go out in a batch
/// each, one block is free.
fn four_running_on_five_blocks(
    now: Instant,
) -> Result<(Scheduler, Vec<RequestId>, Vec<pb::ForwardRequest>), ServiceError> {
    let mut s = scheduler(2, 5, 1, 512);
    let ids: Vec<RequestId> = (0..4).map(|i| s.admit(&request(&[i + 1], 4))).collect::<Result<_, _>>()?;
    let fx = s.schedule(now);
    assert_eq!(seq_ids(&fx), vec![vec![1], vec![2], vec![3], vec![4]]);
    assert_eq!(s.gauges().kv_free, 1);
    Ok((s, ids, sent(&fx)))
}

#[test]
fn every_batch_takes_an_equal_share_of_the_running_set_oldest_first() -> Result<(), ServiceError> {
    let now = Instant::now();
    let two = limits(512, 2);
    assert_eq!((in_flight(&two, 1), in_flight(&two, 2), in_flight(&two, 3)), (2, 4, 6));
    // Two stages keep 4 batches in flight: 10 running sequences go 3, 3, 3 and 1.
    let mut s = scheduler(2, 100, 16, 512);
    for i in 0..10 {
        s.admit(&request(&[i + 1, 2], 4))?;
    }
    let fx = s.schedule(now);
    assert_eq!(seq_ids(&fx), vec![vec![1, 2, 3], vec![4, 5, 6], vec![7, 8, 9], vec![10]]);
    let first = sent(&fx);
    assert_eq!(first[0].token_ids, vec![1, 2, 2, 2, 3, 2]);
    assert_eq!(batches(&fx)[3], vec![(10, 0, 2, false)]);
    assert!(first.iter().all(|b| b.plan_epoch == EPOCH));
    assert_eq!(s.batches_in_flight(), 4);
    assert!(s.schedule(now).is_empty(), "no free slot");
    // The first batch returns: its three decode steps fill the free slot together.
    let returned = answer(&first[0]);
    let stages = returned.timings.clone();
    let fx = s.apply_response(returned, now + Duration::from_millis(3));
    assert_eq!(fx[0], Effect::BatchReturned { elapsed: Duration::from_millis(3), stages });
    assert_eq!(tokens(&fx), vec![(1, 1001), (2, 1002), (3, 1003)]);
    let fx = s.schedule(now);
    assert_eq!(batches(&fx), vec![vec![(1, 2, 1, false), (2, 2, 1, false), (3, 2, 1, false)]]);
    assert_eq!(sent(&fx)[0].token_ids, vec![1001, 1002, 1003]);

    // One stage keeps 2 in flight too (one computing, one on the wire).
    let mut s = scheduler(1, 100, 16, 512);
    for i in 0..3 {
        s.admit(&request(&[i + 1], 4))?;
    }
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![1, 2], vec![3]]);
    Ok(())
}

#[test]
fn one_micro_batch_per_stage_by_default_sends_the_whole_running_set_through_one_stage_at_once()
-> Result<(), ServiceError> {
    let now = Instant::now();
    assert_eq!(SchedulerLimits::default().micro_batches_per_stage, 1);
    let one = limits(512, 1);
    assert_eq!((in_flight(&one, 1), in_flight(&one, 2), in_flight(&one, 3)), (1, 2, 3));
    assert_eq!((in_flight(&one, 0), in_flight(&limits(512, 0), 3)), (1, 1), "never less than one");
    // One stage: 4 running sequences go out as one batch of 4, and the next step waits for it.
    let mut s = scheduler_with(limits(512, 1), 1, 100, 16);
    for i in 0..4 {
        s.admit(&request(&[i + 1], 4))?;
    }
    let fx = s.schedule(now);
    assert_eq!(seq_ids(&fx), vec![vec![1, 2, 3, 4]]);
    assert_eq!(s.batches_in_flight(), 1);
    assert!(s.schedule(now).is_empty(), "no free slot");
    s.apply_response(answer(&sent(&fx)[0]), now);
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![1, 2, 3, 4]], "all four decode steps together");

    // Three stages: 3 batches of an equal share each.
    let mut s = scheduler_with(limits(512, 1), 3, 100, 16);
    for i in 0..7 {
        s.admit(&request(&[i + 1], 4))?;
    }
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![1, 2, 3], vec![4, 5, 6], vec![7]]);
    assert_eq!(s.batches_in_flight(), 3);
    Ok(())
}

#[test]
fn two_micro_batches_per_stage_keep_twice_the_stage_count_in_flight() -> Result<(), ServiceError> {
    let now = Instant::now();
    for stages in 1..=3 {
        let mut s = scheduler_with(limits(512, 2), stages, 100, 16);
        for i in 0..12 {
            s.admit(&request(&[i + 1], 4))?;
        }
        let fx = s.schedule(now);
        let sizes: Vec<usize> = seq_ids(&fx).iter().map(Vec::len).collect();
        assert_eq!(sizes, vec![12 / (2 * stages); 2 * stages], "{stages} stage(s)");
        assert_eq!(s.batches_in_flight(), 2 * stages);
    }
    Ok(())
}

#[test]
fn a_cap_on_batches_in_flight_makes_fewer_bigger_batches() -> Result<(), ServiceError> {
    let now = Instant::now();
    for (cap, want) in [(1, vec![12]), (2, vec![6, 6]), (5, vec![3; 4]), (0, vec![3; 4])] {
        let mut s = scheduler_with(SchedulerLimits { max_batches_in_flight: cap, ..limits(512, 2) }, 2, 100, 16);
        for i in 0..12 {
            s.admit(&request(&[i + 1], 4))?;
        }
        let fx = s.schedule(now);
        let sizes: Vec<usize> = seq_ids(&fx).iter().map(Vec::len).collect();
        assert_eq!(sizes, want, "cap {cap}");
        assert_eq!(s.batches_in_flight(), want.len());
    }
    Ok(())
}

#[test]
fn long_prompts_go_in_chunks_of_max_batch_tokens_and_only_the_last_is_sampled() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = scheduler(1, 100, 16, 4);
    let prompt: Vec<u32> = (1..=11).collect();
    let a = s.admit(&request(&prompt, 4))?;
    let mut steps = Vec::new();
    for _ in 0..4 {
        let fx = s.schedule(now);
        steps.extend(batches(&fx));
        let batch = only_batch(&fx);
        let fx = s.apply_response(answer(&batch), now);
        assert_eq!(tokens(&fx).len(), usize::from(!batch.chunks[0].skip_sampling));
    }
    assert_eq!(
        steps,
        vec![vec![(1, 0, 4, true)], vec![(1, 4, 4, true)], vec![(1, 8, 3, false)], vec![(1, 11, 1, false)]],
        "one step of a sequence is in flight at a time"
    );
    let timing = s.seqs.get(&a).map(|seq| seq.timing);
    let expected = StepTiming {
        steps: 4,
        compute_micros: 200,
        pipeline_micros: 0,
        queue_micros: 28,
        handoff_micros: 12,
        cached_tokens: 0,
    };
    assert_eq!(timing, Some(expected), "every stage's queue and hand-off times are summed per step");

    // Sequences share a batch's token budget: 4 running, 2 per batch, 4 tokens each.
    let mut s = scheduler(1, 100, 16, 4);
    for i in 0..4 {
        s.admit(&request(&[i * 10 + 1, i * 10 + 2, i * 10 + 3], 4))?;
    }
    let fx = s.schedule(now);
    assert_eq!(batches(&fx), vec![vec![(1, 0, 3, false), (2, 0, 1, true)], vec![(3, 0, 3, false), (4, 0, 1, true)]]);
    assert_eq!(sent(&fx)[0].token_ids, vec![1, 2, 3, 11]);
    let fx = s.apply_response(answer(&sent(&fx)[0]), now);
    assert_eq!(tokens(&fx), vec![(1, 1001)]);
    assert_eq!(batches(&s.schedule(now)), vec![vec![(1, 3, 1, false), (2, 1, 2, false)]]);
    Ok(())
}

#[test]
fn a_waiting_sequence_joins_only_if_one_percent_of_the_blocks_stays_free() -> Result<(), ServiceError> {
    let now = Instant::now();
    // 10 blocks of 4 tokens: the watermark is 1 block.
    let mut s = scheduler(1, 10, 4, 512);
    s.admit(&request(&[1; 16], 1))?; // 4 blocks; 6 free
    s.admit(&request(&[2; 20], 1))?; // 5 blocks: 6 free = 5 + the watermark; 1 free
    s.admit(&request(&[3; 1], 1))?; // 1 block: 1 free < 1 + the watermark
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![1], vec![2]]);
    assert_eq!(
        s.gauges(),
        Gauges { running: 2, waiting: 1, kv_total: 10, kv_free: 1, kv_cached: 0, prefix: PrefixStats::default() }
    );

    // Alone, a sequence may take every block.
    let mut s = scheduler(1, 4, 4, 512);
    s.admit(&request(&[1; 15], 1))?;
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![1]]);
    assert_eq!(s.gauges().kv_free, 0);
    Ok(())
}

#[test]
fn a_full_cache_preempts_the_youngest_sequence_not_in_flight_and_recomputes_it() -> Result<(), ServiceError> {
    let now = Instant::now();
    let (mut s, ids, first) = four_running_on_five_blocks(now)?;
    let (a, c, d) = (ids[0], ids[2], ids[3]);
    for batch in &first[..3] {
        s.apply_response(answer(batch), now);
    }
    // a, b and c each need a second block; d is still in flight. a takes the free block; b preempts c, the
    // youngest not in flight (d is younger but in flight), and still does not fit; nobody preempts a, the oldest.
    let fx = s.schedule(now);
    let send_a = only_batch(&fx);
    assert_eq!(batches(&fx), vec![vec![(1, 1, 1, false)]]);
    assert_eq!(
        fx[1..],
        [
            Effect::Requeued { req: c, why: Requeue::KvFull },
            Effect::Release { seq_ids: vec![3], blocks: 1, cached: vec![], generation: 1 },
        ]
    );
    assert_eq!(
        s.gauges(),
        Gauges { running: 3, waiting: 1, kv_total: 5, kv_free: 0, kv_cached: 0, prefix: PrefixStats::default() }
    );
    // c waits first, to be recomputed from its prompt and output under a new sequence id.
    assert_eq!(s.waiting.front(), Some(&c));
    // Its blocks come back when its release returns; b takes one.
    s.released(1, 1, &[]);
    s.apply_response(answer(&first[3]), now);
    let fx = s.schedule(now);
    assert_eq!(batches(&fx), vec![vec![(2, 1, 1, false)]], "d, the youngest running, finds no victim");
    // a and d end: c rejoins once its 2 blocks and the watermark are free.
    s.apply_response(answer(&send_a), now);
    s.finish(a);
    s.finish(d);
    let fx = s.reap();
    assert_eq!(
        fx,
        [
            Effect::Ended { req: a },
            Effect::Ended { req: d },
            Effect::Release { seq_ids: vec![1, 4], blocks: 3, cached: vec![], generation: 1 },
        ]
    );
    s.released(1, 3, &[]);
    let fx = s.schedule(now);
    assert_eq!(batches(&fx), vec![vec![(5, 0, 2, false)]]);
    assert_eq!(sent(&fx)[0].token_ids, vec![3, 1003], "prompt + output");
    assert_eq!(
        s.gauges(),
        Gauges { running: 2, waiting: 0, kv_total: 5, kv_free: 1, kv_cached: 0, prefix: PrefixStats::default() }
    );
    Ok(())
}

#[test]
fn a_stage_out_of_kv_requeues_the_batch_until_the_limit_then_fails_it() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = scheduler(1, 10, 4, 512);
    let a = s.admit(&request(&[7, 8], 4))?;
    let out_of_kv = ServiceError::resource_exhausted("stage 2 is out of KV blocks");
    for n in 1..=u64::from(MAX_STAGE_REFUSALS) {
        let batch = only_batch(&s.schedule(now));
        assert_eq!(batch.chunks[0].seq_id, n, "a new sequence id for every recompute");
        assert_eq!(batch.token_ids, vec![7, 8]);
        let fx = s.apply_response(refuse(&batch, out_of_kv.clone()), now);
        assert_eq!(
            fx,
            [
                Effect::BatchReturned { elapsed: Duration::ZERO, stages: Vec::new() },
                Effect::Requeued { req: a, why: Requeue::StageOutOfKv },
                Effect::Release { seq_ids: vec![n], blocks: 1, cached: vec![], generation: 1 },
            ]
        );
        s.released(1, 1, &[]);
    }
    let batch = only_batch(&s.schedule(now));
    let fx = s.apply_response(refuse(&batch, out_of_kv), now);
    let error =
        ServiceError::resource_exhausted("a stage refused this sequence's batches 17 times for want of KV cache");
    assert_eq!(
        fx[1..],
        [
            Effect::Requeued { req: a, why: Requeue::StageOutOfKv },
            Effect::Release { seq_ids: vec![17], blocks: 1, cached: vec![], generation: 1 },
            Effect::Fail { req: a, error },
            Effect::Ended { req: a },
        ]
    );
    assert!(s.schedule(now).is_empty());
    assert_eq!(
        s.gauges(),
        Gauges { running: 0, waiting: 0, kv_total: 10, kv_free: 9, kv_cached: 0, prefix: PrefixStats::default() }
    );

    // Any other error fails the batch's sequences, which are then released.
    let b = s.admit(&request(&[1], 4))?;
    let batch = only_batch(&s.schedule(now));
    let fx = s.apply_response(refuse(&batch, ServiceError::internal("stage 1 crashed")), now);
    assert_eq!(fx[1..], [Effect::Fail { req: b, error: ServiceError::internal("stage 1 crashed") }]);
    assert_eq!(
        s.reap(),
        [Effect::Ended { req: b }, Effect::Release { seq_ids: vec![18], blocks: 1, cached: vec![], generation: 1 }]
    );
    Ok(())
}

#[test]
fn a_broken_stream_fails_every_request_and_releases_what_they_hold() -> Result<(), ServiceError> {
    let now = Instant::now();
    // 3 blocks: a and b run, c waits for the watermark.
    let mut s = scheduler(1, 3, 4, 512);
    let ids: Vec<RequestId> = (0..3).map(|i| s.admit(&request(&[i; 4], 4))).collect::<Result<_, _>>()?;
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![1], vec![2]]);
    let error = ServiceError::unavailable("stage 0 closed the Forward stream");
    let fx = s.fail_all(&error);
    let failed: Vec<Effect> = ids.iter().map(|&req| Effect::Fail { req, error: error.clone() }).collect();
    assert_eq!(fx, failed);
    assert_eq!(s.batches_in_flight(), 0);
    let mut ended: Vec<Effect> = ids.iter().map(|&req| Effect::Ended { req }).collect();
    ended.push(Effect::Release { seq_ids: vec![1, 2], blocks: 2, cached: vec![], generation: 1 });
    assert_eq!(s.reap(), ended, "only running sequences hold blocks");
    assert!(!s.has_waiting());
    Ok(())
}

#[test]
fn a_new_plan_requeues_every_sequence_to_recompute_through_the_new_stages() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = scheduler(2, 100, 4, 512);
    let a = s.admit(&request(&[1, 2], 4))?;
    let b = s.admit(&request(&[3], 4))?;
    let fx = s.schedule(now);
    let old = sent(&fx);
    assert_eq!(seq_ids(&fx), vec![vec![1], vec![2]]);
    s.apply_response(answer(&old[0]), now);
    let c = s.admit(&request(&[5], 4))?;
    // Youngest first, each to the front of the queue: the queue keeps admission order. b was in flight.
    let fx = s.set_plan(EPOCH + 1, 0, 1);
    assert_eq!(
        fx,
        [
            Effect::Requeued { req: c, why: Requeue::PlanChanged },
            Effect::Release { seq_ids: vec![3], blocks: 0, cached: vec![], generation: 1 },
            Effect::Requeued { req: b, why: Requeue::PlanChanged },
            Effect::Release { seq_ids: vec![2], blocks: 1, cached: vec![], generation: 1 },
            Effect::Requeued { req: a, why: Requeue::PlanChanged },
            Effect::Release { seq_ids: vec![1], blocks: 1, cached: vec![], generation: 1 },
        ]
    );
    assert!(!s.has_budget() && s.has_waiting());
    assert_eq!(s.batches_in_flight(), 0);
    assert!(s.apply_response(answer(&old[1]), now).is_empty(), "an answer from the old plan is ignored");
    s.set_budget(KvBudget::new(4, 100));
    s.released(1, 2, &[]);
    assert_eq!(s.gauges().kv_free, 100, "a release against the old plan's budget is ignored");
    // One stage now: 2 batches in flight, 2 sequences each.
    let fx = s.schedule(now);
    assert_eq!(batches(&fx), vec![vec![(6, 0, 3, false), (5, 0, 1, false)], vec![(4, 0, 1, false)]]);
    assert_eq!(sent(&fx)[0].token_ids, vec![1, 2, 1001, 3]);
    assert!(sent(&fx).iter().all(|batch| batch.plan_epoch == EPOCH + 1));
    Ok(())
}

#[test]
fn blocks_of_an_ended_sequence_stay_held_until_its_release_returns() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = scheduler(1, 4, 4, 512);
    let a = s.admit(&request(&[1; 8], 4))?;
    let batch = only_batch(&s.schedule(now));
    let fx = s.apply_response(answer(&batch), now);
    let timing = StepTiming {
        steps: 1,
        compute_micros: 50,
        pipeline_micros: 0,
        queue_micros: 7,
        handoff_micros: 3,
        cached_tokens: 0,
    };
    let token = pb::SampledToken { seq_id: 1, token_id: 1001, logprob: None };
    assert_eq!(fx[1..], [Effect::Token { req: a, token, timing }]);
    // The output ended it: no more steps.
    s.finish(a);
    assert!(s.schedule(now).is_empty());
    assert_eq!(
        s.reap(),
        [Effect::Ended { req: a }, Effect::Release { seq_ids: vec![1], blocks: 2, cached: vec![], generation: 1 }]
    );
    assert_eq!(s.gauges().kv_free, 2, "still held by the stages");
    s.released(0, 2, &[]);
    assert_eq!(s.gauges().kv_free, 2, "a release of an older budget is ignored");
    s.released(1, 2, &[]);
    assert_eq!(s.gauges().kv_free, 4);

    // A cancelled sequence is released only once its batch is back, and its token goes nowhere.
    let b = s.admit(&request(&[2; 4], 4))?;
    let batch = only_batch(&s.schedule(now));
    s.cancel(b);
    assert!(s.reap().is_empty(), "its batch is in flight");
    assert_eq!(tokens(&s.apply_response(answer(&batch), now)), []);
    assert_eq!(
        s.reap(),
        [Effect::Ended { req: b }, Effect::Release { seq_ids: vec![2], blocks: 1, cached: vec![], generation: 1 }]
    );
    Ok(())
}

#[test]
fn admission_refuses_what_can_never_fit_and_more_than_the_queue_holds() -> Result<(), ServiceError> {
    let mut s = Scheduler::new(SchedulerLimits { max_concurrent_requests: 2, ..limits(512, 1) }, EPOCH, 0, 1);
    let code = |r: Result<RequestId, ServiceError>| r.map(|_| ()).map_err(|e| e.code);
    assert_eq!(code(s.admit(&request(&[1], 1))), Err(ErrorCode::Unavailable), "no budget yet");
    s.set_budget(KvBudget::new(4, 4));
    // 10 + 7 tokens need 5 blocks of 4; the stages hold 4.
    assert_eq!(code(s.admit(&request(&[1; 10], 7))), Err(ErrorCode::InvalidArgument));
    let a = s.admit(&request(&[1; 10], 6))?;
    s.admit(&request(&[2], 1))?;
    assert_eq!(code(s.admit(&request(&[3], 1))), Err(ErrorCode::ResourceExhausted));
    // A cancelled request no longer counts.
    s.cancel(a);
    assert_eq!(code(s.admit(&request(&[3], 1))), Ok(()));
    Ok(())
}

#[test]
fn victims_are_taken_youngest_first_until_the_step_fits_or_none_is_left() -> Result<(), ServiceError> {
    let now = Instant::now();
    let (mut s, ids, first) = four_running_on_five_blocks(now)?;
    for batch in &first {
        s.apply_response(answer(batch), now);
    }
    // a takes the free block; b preempts d, then c (their blocks are not free until released), and waits.
    let fx = s.schedule(now);
    assert_eq!(batches(&fx), vec![vec![(1, 1, 1, false)]]);
    assert_eq!(
        fx[1..],
        [
            Effect::Requeued { req: ids[3], why: Requeue::KvFull },
            Effect::Release { seq_ids: vec![4], blocks: 1, cached: vec![], generation: 1 },
            Effect::Requeued { req: ids[2], why: Requeue::KvFull },
            Effect::Release { seq_ids: vec![3], blocks: 1, cached: vec![], generation: 1 },
        ]
    );
    // Both wait in admission order, ahead of anything newer.
    assert_eq!(s.waiting.iter().copied().collect::<Vec<_>>(), [ids[2], ids[3]]);
    Ok(())
}

#[test]
fn a_stage_failure_requeues_every_sequence_to_recompute_and_stalls_until_a_new_budget() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = scheduler(1, 100, 4, 512);
    let a = s.admit(&request(&[1, 2], 4))?;
    let b = s.admit(&request(&[3], 4))?;
    let fx = s.schedule(now);
    let first = sent(&fx);
    assert_eq!(seq_ids(&fx), vec![vec![1], vec![2]]);
    assert_eq!(s.oldest_batch_sent(), Some(now));
    assert_eq!(tokens(&s.apply_response(answer(&first[0]), now)), vec![(1, 1001)]);
    // b's batch fails because a stage is gone: both are requeued (youngest first, to the front), their KV released,
    // nothing is failed, and the pipeline stalls.
    let error = ServiceError::unavailable("next stage 127.0.0.1:9 is unreachable");
    let fx = s.apply_response(refuse(&first[1], error.clone()), now);
    assert_eq!(
        fx[1..],
        [
            Effect::Requeued { req: b, why: Requeue::StageFailed },
            Effect::Release { seq_ids: vec![2], blocks: 1, cached: vec![], generation: 1 },
            Effect::Requeued { req: a, why: Requeue::StageFailed },
            Effect::Release { seq_ids: vec![1], blocks: 1, cached: vec![], generation: 1 },
            Effect::Stalled { error, cause: StallCause::Unavailable },
        ]
    );
    assert!(!s.has_budget() && s.has_waiting() && s.batches_in_flight() == 0);
    assert!(s.schedule(now).is_empty(), "nothing runs without a budget");
    // A new pipeline: a recomputes its prompt and the token it already produced, under new sequence ids (given in
    // requeue order, youngest first).
    s.set_budget(KvBudget::new(4, 100));
    let fx = s.schedule(now);
    assert_eq!(batches(&fx), vec![vec![(4, 0, 3, false)], vec![(3, 0, 1, false)]]);
    assert_eq!(sent(&fx)[0].token_ids, vec![1, 2, 1001]);
    assert!(sent(&fx).iter().all(|batch| batch.plan_epoch == EPOCH));
    Ok(())
}

#[test]
fn stage_faults_stall_with_their_cause_but_a_bad_batch_fails_its_requests() -> Result<(), ServiceError> {
    let now = Instant::now();
    for (error, stalls) in [
        (ServiceError::failed_precondition("stage serves plan epoch 8, not 7"), Some(StallCause::StalePlan)),
        (ServiceError::deadline_exceeded("batch unanswered"), Some(StallCause::BatchOverdue)),
        (ServiceError::unavailable("next stage unreachable"), Some(StallCause::Unavailable)),
        (ServiceError::invalid_argument("hidden states have the wrong shape"), None),
        (ServiceError::internal("a kernel failed"), None),
    ] {
        let mut s = scheduler(1, 100, 4, 512);
        let a = s.admit(&request(&[1, 2], 4))?;
        let batch = only_batch(&s.schedule(now));
        let fx = s.apply_response(refuse(&batch, error.clone()), now);
        let stalled = fx.iter().find_map(|e| if let Effect::Stalled { cause, .. } = e { Some(*cause) } else { None });
        let failed = fx.contains(&Effect::Fail { req: a, error: error.clone() });
        assert_eq!((stalled, failed), (stalls, stalls.is_none()), "{error}: {fx:?}");
    }
    Ok(())
}

#[test]
fn a_sequence_running_through_too_many_stage_failures_fails_instead_of_looping() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = scheduler(1, 100, 4, 512);
    let a = s.admit(&request(&[1, 2], 4))?;
    let error = ServiceError::unavailable("stage 0 closed the Forward stream");
    for round in 1..=MAX_STAGE_FAILURES {
        let sent = s.schedule(now).iter().filter(|e| matches!(e, Effect::Send(_))).count();
        assert_eq!(sent, 1, "round {round}");
        let fx = s.stall(&error, StallCause::Unavailable);
        assert!(fx.contains(&Effect::Requeued { req: a, why: Requeue::StageFailed }), "round {round}: {fx:?}");
        assert!(!fx.iter().any(|e| matches!(e, Effect::Fail { .. })), "round {round}: {fx:?}");
        s.set_budget(KvBudget::new(4, 100));
    }
    s.schedule(now);
    let fx = s.stall(&error, StallCause::Unavailable);
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Fail { req, error } if *req == a && error.code == ErrorCode::Unavailable)),
        "{fx:?}"
    );
    // A sequence that only waited (never running through a failure) is not charged.
    s.set_budget(KvBudget::new(4, 100));
    let b = s.admit(&request(&[5], 4))?;
    for _ in 0..=MAX_STAGE_FAILURES {
        let fx = s.stall(&error, StallCause::Unavailable);
        assert!(!fx.iter().any(|e| matches!(e, Effect::Fail { req, .. } if *req == b)), "{fx:?}");
    }
    Ok(())
}

#[test]
fn sequence_ids_carry_the_leadership_term_so_coordinators_never_share_one() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = Scheduler::new(limits(512, 1), EPOCH, 9, 1);
    s.set_budget(KvBudget::new(4, 100));
    s.admit(&request(&[1], 4))?;
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![(9 << 32) | 1]]);
    // A later term (this coordinator re-elected): ids continue above it; the recompute gets one of them.
    s.set_plan(EPOCH + 1, 12, 1);
    s.set_budget(KvBudget::new(4, 100));
    assert_eq!(seq_ids(&s.schedule(now)), vec![vec![(12 << 32) | 1]]);
    assert!(sent(&s.schedule(now)).iter().all(|b| b.term == 12));
    Ok(())
}

#[test]
fn a_request_starts_once_however_often_it_is_recomputed() -> Result<(), ServiceError> {
    let now = Instant::now();
    let mut s = scheduler(1, 100, 4, 512);
    let a = s.admit(&request(&[1, 2], 4))?;
    let started = |fx: &[Effect]| fx.iter().filter(|e| matches!(e, Effect::Started { req } if *req == a)).count();
    assert_eq!(started(&s.schedule(now)), 1);
    s.stall(&ServiceError::unavailable("stage 0 closed the Forward stream"), StallCause::Unavailable);
    s.set_budget(KvBudget::new(4, 100));
    let again = s.schedule(now);
    assert!(again.iter().any(|e| matches!(e, Effect::Send(_))), "{again:?}");
    assert_eq!(started(&again), 0, "{again:?}");
    Ok(())
}
