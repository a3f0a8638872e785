//! `Generate` through a coordinator and 1–3 in-process stage workers, against the single-process engine.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use strata_coordinator::{PipelineOptions, Timeouts};
use strata_proto::pb;
use strata_proto::tonic_health::pb::HealthCheckRequest;
use strata_proto::tonic_health::pb::health_check_response::ServingStatus;
use strata_proto::tonic_health::pb::health_client::HealthClient;
use strata_tests::{
    StageSizing, TestCluster, eventually, generate, ids_request, reference, smollm2, static_plan, tiny_model,
};
use tonic::Code;

const PROMPT: [u32; 5] = [17, 42, 3, 250, 99];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_model_greedy_matches_the_engine_on_1_2_and_3_stages() -> Result<()> {
    let model = tiny_model()?;
    let expected = reference(model.path(), 1, &PROMPT, 12)?;
    ensure!(expected.len() == 12);
    for bounds in [&[0, 4][..], &[0, 2, 4], &[0, 1, 3, 4]] {
        let cluster = TestCluster::start(model.path(), bounds, StageSizing::default()).await?;
        let mut client = cluster.client().await?;
        let got = generate(&mut client, ids_request(&PROMPT, 12)).await?;
        assert_eq!(got.prompt_ids, PROMPT, "{bounds:?}");
        assert_eq!(got.token_ids, expected, "{bounds:?}");
        assert_eq!(got.finish_reason, pb::FinishReason::Length as i32);
        let usage = got.usage.context("no usage")?;
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (5, 12));
        // One prefill step and 11 decode steps; the pipeline time includes every stage's compute, queueing and
        // hand-off (each stage's part of a round trip lies inside it, and the stages' parts do not overlap).
        assert_eq!(usage.steps, 12, "{bounds:?}");
        let on_stages = usage.stage_compute_micros + usage.stage_queue_micros + usage.stage_handoff_micros;
        assert!(usage.stage_compute_micros > 0 && usage.pipeline_micros >= on_stages, "{usage:?}");

        let status = client.cluster_status(pb::ClusterStatusRequest {}).await?.into_inner();
        assert_eq!(status.stages.len(), bounds.len() - 1);
        assert_eq!(status.num_layers, 4);

        let with_logprobs = pb::GenerateRequest { logprobs: true, ..ids_request(&PROMPT, 3) };
        let mut stream = client.generate(with_logprobs).await?.into_inner();
        let mut logprobs = Vec::new();
        while let Some(msg) = stream.message().await? {
            assert_eq!(msg.logprobs.len(), msg.token_ids.len());
            logprobs.extend(msg.logprobs);
        }
        assert_eq!(logprobs.len(), 3);
        assert!(logprobs.iter().all(|&l| l <= 0.0 && l.is_finite()), "{logprobs:?}");
        cluster.stop().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_get_what_they_get_alone() -> Result<()> {
    let model = tiny_model()?;
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![200, 7], vec![5, 6, 7, 8, 9, 10, 11], vec![299]];
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| reference(model.path(), 1, p, 10)).collect::<Result<_>>()?;
    let cluster = TestCluster::start(model.path(), &[0, 2, 4], StageSizing::default()).await?;
    let client = cluster.client().await?;
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut client = client.clone();
            let req = ids_request(p, 10);
            tokio::spawn(async move { generate(&mut client, req).await })
        })
        .collect();
    for (task, expected) in tasks.into_iter().zip(&alone) {
        assert_eq!(&task.await??.token_ids, expected);
    }
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_stream_frees_kv_on_every_stage() -> Result<()> {
    let model = tiny_model()?;
    let cluster = TestCluster::start(model.path(), &[0, 1, 3, 4], StageSizing::default()).await?;
    let mut client = cluster.client().await?;
    let mut stream = client.generate(ids_request(&PROMPT, 200)).await?.into_inner();
    let mut tokens = 0;
    while tokens < 3 {
        let msg = stream.message().await?.ok_or_else(|| anyhow::anyhow!("stream ended early"))?;
        tokens += msg.token_ids.len();
    }
    let mid: Vec<pb::StageStatus> =
        futures_free_join(&cluster, 3).await?.into_iter().filter(|s| s.kv_free_blocks < s.kv_total_blocks).collect();
    assert_eq!(mid.len(), 3, "every stage holds the sequence's KV while it runs");
    drop(stream);
    eventually(Duration::from_secs(10), || cluster.kv_all_free()).await?;
    // The pipeline still serves after the cancellation.
    let got = generate(&mut client, ids_request(&PROMPT, 2)).await?;
    assert_eq!(got.token_ids.len(), 2);
    cluster.stop().await
}

async fn futures_free_join(cluster: &TestCluster, n: usize) -> Result<Vec<pb::StageStatus>> {
    let mut out = Vec::new();
    for i in 0..n {
        out.push(cluster.stage_status(i).await?);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_invalid_argument() -> Result<()> {
    let model = tiny_model()?;
    let cluster = TestCluster::start(model.path(), &[0, 4], StageSizing::default()).await?;
    let mut client = cluster.client().await?;
    let bad = [
        ids_request(&[], 4),
        ids_request(&[1, 300], 4),
        ids_request(&[1], 1000),
        // The tiny model has no tokenizer.
        pb::GenerateRequest { prompt: Some(pb::generate_request::Prompt::Text("hi".into())), ..Default::default() },
        pb::GenerateRequest {
            sampling: Some(pb::SamplingParams { temperature: -1.0, ..Default::default() }),
            ..ids_request(&[1], 4)
        },
    ];
    for req in bad {
        let err = generate(&mut client, req.clone()).await.expect_err("must be rejected");
        assert_eq!(err.code(), Code::InvalidArgument, "{req:?}: {err}");
    }
    let other = pb::GenerateRequest { model: "other-model".into(), ..ids_request(&[1], 4) };
    let err = generate(&mut client, other).await.expect_err("an unknown model must be rejected");
    assert_eq!(err.code(), Code::NotFound, "unknown model: {err}");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_working_plan_and_fails_only_after_the_recovery_timeout() -> Result<()> {
    let model = tiny_model()?;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.to_string()
    };
    // Nothing answers and nothing replans: UNAVAILABLE once the recovery timeout is over, naming the stage.
    let recovery = Duration::from_millis(800);
    let timeouts = Timeouts { recovery, ..Timeouts::default() };
    let options = PipelineOptions { timeouts, ..PipelineOptions::default() };
    let cluster = TestCluster::coordinator_with(model.path(), &[(dead.clone(), 0..4)], options).await?;
    let mut client = cluster.client().await?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.addr))?.connect().await?;
    let mut health = HealthClient::new(channel);
    let check = HealthCheckRequest { service: strata_proto::COORDINATOR_SERVICE.into() };
    assert_eq!(health.check(check).await?.into_inner().status, ServingStatus::Serving as i32);
    let started = Instant::now();
    let err = generate(&mut client, ids_request(&PROMPT, 4)).await.expect_err("no stage to reach");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains(&dead) && err.message().contains("recovery"), "{err}");
    assert!(started.elapsed() >= recovery && started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    cluster.stop().await?;

    // With the default (long) recovery timeout the request waits; a new plan through live stages serves it,
    // with the same tokens as one process.
    let cluster = TestCluster::coordinator(model.path(), &[(dead, 0..4)]).await?;
    let mut client = cluster.client().await?;
    let waiting = tokio::spawn(async move { generate(&mut client, ids_request(&PROMPT, 4)).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "the request must wait for a plan, not fail");
    let live = TestCluster::start(model.path(), &[0, 2, 4], StageSizing::default()).await?;
    let stages =
        live.workers.iter().zip([0..2, 2..4]).map(|(w, r)| (w.local_addr().to_string(), r)).collect::<Vec<_>>();
    cluster.pipeline.set_plan(static_plan(&cluster.pipeline.model().name, 4, &stages)).await?;
    let got = waiting.await??;
    assert_eq!(got.token_ids, reference(model.path(), 1, &PROMPT, 4)?);
    live.stop().await?;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_text_prompt_matches_the_engine_on_1_2_and_3_stages() -> Result<()> {
    let model = smollm2();
    let sizing = StageSizing { threads: 2, kv_blocks: 16, block_size: 16, ..StageSizing::default() };
    let info = strata_coordinator::ModelInfo::open(&model)?;
    let tok = info.tokenizer.clone().ok_or_else(|| anyhow::anyhow!("SmolLM2 has a tokenizer"))?;
    let prompt_ids = tok.encode("The capital of France is")?;
    let expected = reference(&model, sizing.threads, &prompt_ids, 3)?;
    for bounds in [&[0, 30][..], &[0, 12, 30], &[0, 10, 20, 30]] {
        let cluster = TestCluster::start(&model, bounds, sizing).await?;
        let mut client = cluster.client().await?;
        let req = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Text("The capital of France is".into())),
            max_tokens: 3,
            ..Default::default()
        };
        let got = generate(&mut client, req).await?;
        assert_eq!(got.prompt_ids, prompt_ids, "{bounds:?}");
        assert_eq!(got.token_ids, expected, "{bounds:?}");
        assert!(got.text.starts_with(" Paris"), "{bounds:?}: {:?}", got.text);

        // A stop string ends generation and is cut from the text.
        let req = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Text("The capital of France is".into())),
            max_tokens: 3,
            stop: vec!["aris".into()],
            ..Default::default()
        };
        let got = generate(&mut client, req).await?;
        assert_eq!(got.finish_reason, pb::FinishReason::Stop as i32, "{bounds:?}");
        assert_eq!(got.text, " P");
        assert_eq!(got.usage.map(|u| u.completion_tokens), Some(1));
        cluster.stop().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_change_mid_generation_recomputes_instead_of_failing() -> Result<()> {
    // SmolLM2 is slow enough (tens of ms a token) that the switch lands in the middle of the generation.
    let model = smollm2();
    let info = strata_coordinator::ModelInfo::open(&model)?;
    let tok = info.tokenizer.clone().ok_or_else(|| anyhow::anyhow!("SmolLM2 has a tokenizer"))?;
    let prompt = tok.encode("The capital of France is")?;
    let expected = reference(&model, 1, &prompt, 40)?;
    ensure!(expected.len() > 12, "too short to switch in the middle: {expected:?}");
    let old = TestCluster::start(&model, &[0, 10, 20, 30], StageSizing::default()).await?;
    let new = TestCluster::start(&model, &[0, 15, 30], StageSizing::default()).await?;
    let mut client = old.client().await?;
    let mut stream = client.generate(ids_request(&prompt, 40)).await?.into_inner();
    let mut tokens = Vec::new();
    while tokens.len() < 5 {
        let msg = stream.message().await?.ok_or_else(|| anyhow::anyhow!("stream ended early"))?;
        tokens.extend(msg.token_ids);
    }
    // Move the data path to other workers with another split while the sequence is running.
    let stages =
        new.workers.iter().zip([0..15, 15..30]).map(|(w, r)| (w.local_addr().to_string(), r)).collect::<Vec<_>>();
    old.pipeline.set_plan(static_plan(&old.pipeline.model().name, 30, &stages)).await?;
    let before = tokens.len();
    while tokens.len() == before {
        let msg = stream.message().await?.ok_or_else(|| anyhow::anyhow!("stream ended at the switch"))?;
        tokens.extend(msg.token_ids);
    }
    ensure!(tokens.len() < expected.len(), "the generation finished before the switch; the test proves nothing");
    let resident = new.stage_status(0).await?;
    ensure!(resident.kv_free_blocks < resident.kv_total_blocks, "the sequence is not on the new stages: {resident:?}");
    while let Some(msg) = stream.message().await? {
        tokens.extend(msg.token_ids);
    }
    assert_eq!(tokens, expected, "the sequence continued under the new plan with the same tokens");
    // The old stages were told to free it; the new ones free it when it finishes.
    for cluster in [&old, &new] {
        eventually(Duration::from_secs(10), || cluster.kv_all_free()).await?;
    }
    new.stop().await?;
    old.stop().await
}
