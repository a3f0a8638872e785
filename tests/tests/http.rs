//! The OpenAI-compatible HTTP API of a coordinator in front of real in-process stage workers: responses against
//! the gRPC `Generate` of the same cluster, streaming against whole responses, every error's status and shape,
//! cancellation on disconnect, and `/health`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use strata_coordinator::{PipelineOptions, SchedulerLimits, Timeouts};
use strata_proto::pb;
use strata_tests::http_client::{self, EventStream};
use strata_tests::{
    StageSizing, TestCluster, eventually, generate, ids_request, smollm2, tiny_model, tiny_model_with_context,
};

const PROMPT: [u32; 5] = [17, 42, 3, 250, 99];

/// The `data` of every event of a stream, checking it is SSE and ends with `[DONE]`; the chunks are parsed.
async fn sse_chunks(stream: EventStream) -> Result<Vec<Value>> {
    ensure!(stream.status == 200, "status {}", stream.status);
    ensure!(stream.content_type.starts_with("text/event-stream"), "content type {}", stream.content_type);
    let mut data = stream.collect().await?;
    ensure!(data.pop().as_deref() == Some("[DONE]"), "the stream must end with [DONE]");
    data.iter().map(|d| serde_json::from_str(d).with_context(|| format!("chunk {d}"))).collect()
}

/// Checks `reply` is an OpenAI error with `status`, and returns its `error` object.
fn expect_error(reply: &http_client::Reply, status: u16, what: &str) -> Result<Value> {
    let body = reply.json()?;
    ensure!(reply.status == status, "{what}: status {} (want {status}): {body}", reply.status);
    ensure!(reply.content_type.starts_with("application/json"), "{what}: content type {}", reply.content_type);
    let error = body.get("error").with_context(|| format!("{what}: no error object: {body}"))?;
    ensure!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {body}");
    ensure!(error["type"].is_string(), "{what}: {body}");
    ensure!(error.get("param").is_some() && error.get("code").is_some(), "{what}: {body}");
    Ok(error.clone())
}

/// The f32 log-probabilities the wire carries (serde_json's default parser may land a 17-digit number an f64 ulp
/// away, never an f32 one).
fn logprobs_of(choice: &Value) -> Vec<f32> {
    choice["logprobs"]["token_logprobs"]
        .as_array()
        .map_or_else(Vec::new, |a| a.iter().filter_map(Value::as_f64).map(|l| l as f32).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_model_completions_match_grpc_whole_and_streamed() -> Result<()> {
    let model = tiny_model()?;
    let cluster = TestCluster::start(model.path(), &[0, 1, 3, 4], StageSizing::default()).await?;
    let http = cluster.http_addr;
    let mut client = cluster.client().await?;
    // The gRPC reference: greedy, with log-probabilities.
    let mut stream =
        client.generate(pb::GenerateRequest { logprobs: true, ..ids_request(&PROMPT, 12) }).await?.into_inner();
    let mut grpc_logprobs = Vec::new();
    while let Some(msg) = stream.message().await? {
        grpc_logprobs.extend(msg.logprobs.iter().copied());
    }
    ensure!(grpc_logprobs.len() == 12);

    let models = http_client::get(http, "/v1/models").await?.json()?;
    let name = cluster.pipeline.model().name.clone();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], name.as_str(), "{models}");
    assert_eq!(http_client::get(http, &format!("/v1/models/{name}")).await?.json()?["id"], name.as_str());

    for prompt in [json!(PROMPT), json!([PROMPT])] {
        let body = json!({"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
                          "some_future_field": {"ignored": true}});
        let reply = http_client::post(http, "/v1/completions", &body).await?;
        let whole = reply.json()?;
        assert_eq!(reply.status, 200, "{whole}");
        assert_eq!(whole["object"], "text_completion");
        assert!(whole["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")), "{whole}");
        assert_eq!(whole["model"], name.as_str());
        assert_eq!(whole["choices"][0]["finish_reason"], "length");
        // f32 weights: `auto` prefix caching is off, so nothing is cached.
        let usage = json!({"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                           "prompt_tokens_details": {"cached_tokens": 0}});
        assert_eq!(whole["usage"], usage);
        assert_eq!(logprobs_of(&whole["choices"][0]), grpc_logprobs, "HTTP and gRPC sample the same tokens");
    }

    let body = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    let chunks = sse_chunks(http_client::post_stream(http, "/v1/completions", &body).await?).await?;
    let (usage, choices) = chunks.split_last().context("no chunks")?;
    assert_eq!(usage["choices"], json!([]), "the usage chunk has no choices");
    let expected = json!({"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                          "prompt_tokens_details": {"cached_tokens": 0}});
    assert_eq!(usage["usage"], expected);
    let streamed: Vec<f32> = choices.iter().flat_map(|c| logprobs_of(&c["choices"][0])).collect();
    assert_eq!(streamed, grpc_logprobs);
    let finishes: Vec<&Value> = choices.iter().map(|c| &c["choices"][0]["finish_reason"]).collect();
    assert_eq!(finishes.last(), Some(&&json!("length")), "the last chunk says why it ended");
    assert!(finishes[..finishes.len() - 1].iter().all(|f| f.is_null()), "{finishes:?}");
    assert!(choices.iter().all(|c| c["object"] == "text_completion" && c.get("usage").is_none()));
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_the_service_keeps_serving() -> Result<()> {
    let model = tiny_model()?;
    let cluster = TestCluster::start(model.path(), &[0, 2, 4], StageSizing::default()).await?;
    let http = cluster.http_addr;
    let ok = json!({"prompt": [1, 2], "max_tokens": 2});
    let with = |patch: Value| {
        let mut body = ok.clone();
        for (k, v) in patch.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        body
    };
    // (what, body, status, param, code)
    let cases: Vec<(&str, Value, u16, Value, Value)> = vec![
        ("empty text prompt", with(json!({"prompt": ""})), 400, json!("prompt"), Value::Null),
        ("empty id prompt", with(json!({"prompt": []})), 400, json!("prompt"), Value::Null),
        ("no prompt", json!({"max_tokens": 2}), 400, Value::Null, Value::Null),
        ("two prompts", with(json!({"prompt": ["a", "b"]})), 400, json!("prompt"), Value::Null),
        ("max_tokens beyond the context", with(json!({"max_tokens": 255})), 400, Value::Null, Value::Null),
        ("prompt longer than the context", with(json!({"prompt": vec![1; 256]})), 400, json!("prompt"), Value::Null),
        ("max_tokens 0", with(json!({"max_tokens": 0})), 400, json!("max_tokens"), Value::Null),
        ("n = 2", with(json!({"n": 2})), 400, json!("n"), Value::Null),
        ("token outside the vocabulary", with(json!({"prompt": [1, 300]})), 400, Value::Null, Value::Null),
        ("negative temperature", with(json!({"temperature": -1})), 400, json!("temperature"), Value::Null),
        ("top_p 0", with(json!({"top_p": 0})), 400, json!("top_p"), Value::Null),
        ("top_p above 1", with(json!({"top_p": 1.5})), 400, json!("top_p"), Value::Null),
        ("negative top_p", with(json!({"top_p": -0.5})), 400, json!("top_p"), Value::Null),
        ("min_p above 1", with(json!({"min_p": 1.5})), 400, json!("min_p"), Value::Null),
        ("presence_penalty 3", with(json!({"presence_penalty": 3})), 400, json!("presence_penalty"), Value::Null),
        ("repetition_penalty 0", with(json!({"repetition_penalty": 0})), 400, json!("repetition_penalty"), Value::Null),
        (
            "negative repetition_penalty",
            with(json!({"repetition_penalty": -1})),
            400,
            json!("repetition_penalty"),
            Value::Null,
        ),
        ("max_tokens of the wrong type", with(json!({"max_tokens": "2"})), 400, json!("max_tokens"), Value::Null),
        ("stop of the wrong type", with(json!({"stop": 5})), 400, json!("stop"), Value::Null),
        ("a text prompt without a tokenizer", with(json!({"prompt": "hi"})), 400, json!("prompt"), Value::Null),
        ("top alternatives", with(json!({"logprobs": 2})), 400, json!("logprobs"), Value::Null),
        ("unknown model", with(json!({"model": "gpt-4"})), 404, json!("model"), json!("model_not_found")),
        (
            "errors before streaming are not streamed",
            with(json!({"n": 3, "stream": true})),
            400,
            json!("n"),
            Value::Null,
        ),
    ];
    for (what, body, status, param, code) in cases {
        let reply = http_client::post(http, "/v1/completions", &body).await?;
        let error = expect_error(&reply, status, what)?;
        assert_eq!(error["param"], param, "{what}: {error}");
        assert_eq!(error["code"], code, "{what}: {error}");
    }
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let error =
        expect_error(&http_client::post(http, "/v1/chat/completions", &chat).await?, 400, "chat, no tokenizer")?;
    assert_eq!(error["param"], "messages");
    let image = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]});
    expect_error(&http_client::post(http, "/v1/chat/completions", &image).await?, 400, "an image part")?;
    let no_messages = json!({"messages": "hi"});
    expect_error(&http_client::post(http, "/v1/chat/completions", &no_messages).await?, 400, "messages not a list")?;

    for (what, raw) in [
        ("malformed JSON", &b"{\"prompt\": [1, 2"[..]),
        ("trailing garbage", b"{\"prompt\": [1]} {}"),
        ("invalid UTF-8", b"{\"prompt\": \"\xff\xfe\"}"),
        ("not an object", b"[1, 2]"),
        ("empty body", b""),
    ] {
        expect_error(&http_client::post_raw(http, "/v1/completions", raw.to_vec()).await?, 400, what)?;
    }
    let error = expect_error(&http_client::get(http, "/v1/models/gpt-4").await?, 404, "unknown model card")?;
    assert_eq!(error["code"], "model_not_found");
    expect_error(&http_client::get(http, "/v1/nothing").await?, 404, "unknown path")?;
    expect_error(&http_client::get(http, "/v1/completions").await?, 405, "wrong method")?;

    let reply = http_client::post(http, "/v1/completions", &ok).await?;
    assert_eq!(reply.status, 200, "still serving after the bad requests: {}", reply.json()?);
    assert_eq!(reply.json()?["usage"]["completion_tokens"], 2);
    cluster.stop().await
}

async fn kv_in_use(cluster: &TestCluster) -> Result<Vec<u64>> {
    let mut used = Vec::new();
    for i in 0..cluster.workers.len() {
        let s = cluster.stage_status(i).await?;
        used.push(s.kv_total_blocks - s.kv_free_blocks + u64::from(s.inflight_batches));
    }
    Ok(used)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_response_frees_kv_on_every_stage() -> Result<()> {
    // A long context and enough KV that, uncancelled, the sequence would run for thousands of tokens.
    let model = tiny_model_with_context(4096)?;
    let sizing = StageSizing { kv_blocks: 1100, ..StageSizing::default() };
    let cluster = TestCluster::start(model.path(), &[0, 1, 3, 4], sizing).await?;
    let max_tokens = 4000;
    let body = json!({"prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 0, "stream": true});
    let mut stream = http_client::post_stream(cluster.http_addr, "/v1/completions", &body).await?;
    ensure!(stream.status == 200);
    let started = Instant::now();
    let mut tokens = 0;
    while tokens < 20 {
        let data = stream.next_data().await?.context("the stream ended early")?;
        tokens +=
            serde_json::from_str::<Value>(&data)?["choices"][0]["logprobs"]["tokens"].as_array().map_or(0, Vec::len);
    }
    let per_token = started.elapsed() / 20;
    let used = kv_in_use(&cluster).await?;
    assert!(used.iter().all(|&u| u > 0), "every stage holds the sequence's KV while it runs: {used:?}");
    drop(stream);
    let gone = Instant::now();
    eventually(Duration::from_secs(20), || async { Ok(kv_in_use(&cluster).await?.iter().all(|&u| u == 0)) }).await?;
    // Uncancelled, the sequence would hold its KV until its remaining tokens were generated.
    let natural_end = per_token * (max_tokens - 20);
    assert!(
        gone.elapsed() < natural_end / 2,
        "freed after {:?}; the generation alone would end in {natural_end:?}",
        gone.elapsed()
    );

    // The same for a whole (non-streamed) response: the client gives up while the handler waits.
    let body = json!({"prompt": PROMPT, "max_tokens": max_tokens});
    let addr = cluster.http_addr;
    let waiting = tokio::spawn(async move { http_client::post(addr, "/v1/completions", &body).await });
    eventually(Duration::from_secs(10), || async { Ok(kv_in_use(&cluster).await?.iter().all(|&u| u > 0)) }).await?;
    waiting.abort();
    let gone = Instant::now();
    eventually(Duration::from_secs(20), || async { Ok(kv_in_use(&cluster).await?.iter().all(|&u| u == 0)) }).await?;
    assert!(gone.elapsed() < natural_end / 2, "whole response: freed after {:?}", gone.elapsed());

    let reply =
        http_client::post(cluster.http_addr, "/v1/completions", &json!({"prompt": PROMPT, "max_tokens": 2})).await?;
    assert_eq!(reply.status, 200, "still serving after the disconnects");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_coordinator_answers_429_until_a_slot_frees() -> Result<()> {
    let model = tiny_model_with_context(4096)?;
    let limits = SchedulerLimits { max_concurrent_requests: 1, ..SchedulerLimits::default() };
    let sizing = StageSizing { kv_blocks: 1100, limits, ..StageSizing::default() };
    let cluster = TestCluster::start(model.path(), &[0, 2, 4], sizing).await?;
    let http = cluster.http_addr;
    let body = json!({"prompt": PROMPT, "max_tokens": 4000, "logprobs": 0, "stream": true});
    let mut busy = http_client::post_stream(http, "/v1/completions", &body).await?;
    ensure!(busy.status == 200);
    busy.next_data().await?.context("the first request streams")?;
    let small = json!({"prompt": PROMPT, "max_tokens": 2});
    let reply = http_client::post(http, "/v1/completions", &small).await?;
    let error = expect_error(&reply, 429, "one request over the limit")?;
    assert_eq!((&error["type"], &error["code"]), (&json!("rate_limit_error"), &json!("rate_limit_exceeded")));
    drop(busy);
    eventually(Duration::from_secs(10), || async {
        Ok(http_client::post(http, "/v1/completions", &small).await?.status == 200)
    })
    .await?;
    cluster.stop().await
}

async fn health(addr: SocketAddr) -> Result<(u16, Value)> {
    let reply = http_client::get(addr, "/health").await?;
    Ok((reply.status, reply.json()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_ok_through_every_stage_and_503_once_one_dies() -> Result<()> {
    let model = tiny_model()?;
    let mut cluster = TestCluster::start(model.path(), &[0, 1, 3, 4], StageSizing::default()).await?;
    let (status, body) = health(cluster.http_addr).await?;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let dead = cluster.workers.remove(1);
    dead.shutdown().await?;
    let (status, body) = health(cluster.http_addr).await?;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "unavailable");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert_eq!(http_client::get(cluster.http_addr, "/live").await?.status, 200, "alive without a stage");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_stage_0_is_503() -> Result<()> {
    let model = tiny_model()?;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.to_string();
    // Requests wait this long for a working pipeline (nothing replans a static plan), then fail.
    let timeouts = Timeouts { recovery: Duration::from_millis(500), ..Timeouts::default() };
    let options = PipelineOptions { timeouts, ..PipelineOptions::default() };
    let cluster = TestCluster::coordinator_with(model.path(), &[(dead, 0..4)], options).await?;
    let reply = http_client::post(cluster.http_addr, "/v1/completions", &json!({"prompt": PROMPT})).await?;
    let error = expect_error(&reply, 503, "no stage 0")?;
    assert_eq!(error["type"], "server_error");
    assert_eq!(health(cluster.http_addr).await?.0, 503);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_completions_and_chat_match_grpc_whole_and_streamed() -> Result<()> {
    let model = smollm2();
    let sizing = StageSizing { threads: 2, kv_blocks: 16, block_size: 16, ..StageSizing::default() };
    let cluster = TestCluster::start(&model, &[0, 12, 30], sizing).await?;
    let http = cluster.http_addr;
    let mut client = cluster.client().await?;
    let prompt = "The capital of France is";
    let text_req = |chat| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(prompt.into())),
        max_tokens: 8,
        chat,
        ..Default::default()
    };

    // Completions: whole = streamed = gRPC. The prompt is shorter than a KV block: nothing to cache.
    let grpc = generate(&mut client, text_req(false)).await?;
    let usage = json!({"prompt_tokens": grpc.prompt_ids.len(), "completion_tokens": grpc.token_ids.len(),
                       "total_tokens": grpc.prompt_ids.len() + grpc.token_ids.len(),
                       "prompt_tokens_details": {"cached_tokens": 0}});
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let whole = http_client::post(http, "/v1/completions", &body).await?.json()?;
    assert_eq!(whole["choices"][0]["text"], grpc.text.as_str(), "{whole}");
    assert!(grpc.text.starts_with(" Paris"), "{}", grpc.text);
    assert_eq!(whole["usage"], usage);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = sse_chunks(http_client::post_stream(http, "/v1/completions", &streamed).await?).await?;
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, grpc.text);
    // min_p 1 keeps only the most likely token: a draw at temperature 1 gives the greedy text. (Without it, the
    // same seed's text differs: the check can fail.)
    let drawn = |min_p: f64| json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 11, "min_p": min_p});
    let reply = http_client::post(http, "/v1/completions", &drawn(1.0)).await?.json()?;
    assert_eq!(reply["choices"][0]["text"], grpc.text.as_str(), "{reply}");
    let reply = http_client::post(http, "/v1/completions", &drawn(0.0)).await?.json()?;
    assert_ne!(reply["choices"][0]["text"], grpc.text.as_str(), "{reply}");

    // Chat: the same template as gRPC's `chat`; whole = streamed = gRPC. The gRPC request cached the full
    // 16-token blocks of the templated prompt (SmolLM2's system prompt makes it longer than one): the HTTP ones
    // find them, and say so in their usage.
    let grpc = generate(&mut client, text_req(true)).await?;
    let cached = (grpc.prompt_ids.len() - 1) / 16 * 16;
    ensure!(cached > 0, "a chat prompt of {} tokens fills no KV block", grpc.prompt_ids.len());
    let again = generate(&mut client, text_req(true)).await?;
    assert_eq!(again.usage.map(|u| u.cached_prompt_tokens), Some(u32::try_from(cached)?));
    assert_eq!(grpc.usage.map(|u| u.cached_prompt_tokens), Some(0), "the first one found nothing cached");
    let usage = json!({"prompt_tokens": grpc.prompt_ids.len(), "completion_tokens": grpc.token_ids.len(),
                       "total_tokens": grpc.prompt_ids.len() + grpc.token_ids.len(),
                       "prompt_tokens_details": {"cached_tokens": cached}});
    let body = json!({"model": cluster.pipeline.model().name, "messages": [{"role": "user", "content": prompt}],
                      "max_completion_tokens": 8, "temperature": 0, "logprobs": true});
    let whole = http_client::post(http, "/v1/chat/completions", &body).await?.json()?;
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    assert_eq!(whole["choices"][0]["message"]["content"], grpc.text.as_str(), "{whole}");
    assert_eq!(whole["usage"], usage);
    let lp = whole["choices"][0]["logprobs"]["content"].as_array().context("chat logprobs")?;
    assert_eq!(lp.len(), grpc.token_ids.len());
    assert!(lp.iter().all(|t| t["logprob"].as_f64().is_some_and(|l| l <= 0.0)), "{lp:?}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = sse_chunks(http_client::post_stream(http, "/v1/chat/completions", &streamed).await?).await?;
    let (usage_chunk, chunks) = chunks.split_last().context("no chunks")?;
    assert_eq!(usage_chunk["usage"], usage);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "the role comes first");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, grpc.text);
    let last = &chunks[chunks.len() - 1]["choices"][0];
    assert_eq!(
        last["finish_reason"],
        if grpc.finish_reason == pb::FinishReason::Length as i32 { "length" } else { "stop" }
    );
    assert_eq!(last["delta"], json!({}));

    // A stop string ends generation (finish_reason stop) and is cut from the text.
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": "aris"});
    let whole = http_client::post(http, "/v1/completions", &body).await?.json()?;
    assert_eq!(whole["choices"][0]["text"], " P");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    cluster.stop().await
}
