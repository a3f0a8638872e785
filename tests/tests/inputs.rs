//! What the HTTP API accepts, over real HTTP against a coordinator in front of a real stage worker (SmolLM2, so
//! there is a tokenizer and a chat template): the body limit, the caps on stop strings, chat roles and content,
//! the sampling fields it reads (checked against gRPC `Generate` with the same settings), the fields it refuses by
//! name, and vLLM's `/tokenize`, `/detokenize` and `/version` (checked against the prompt ids `Generate` reports).

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use strata_coordinator::http::{self, HttpState};
use strata_coordinator::request::{MAX_STOP_BYTES, MAX_STOP_STRINGS};
use strata_proto::pb;
use strata_tests::{StageSizing, TestCluster, generate, http_client, smollm2};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const PROMPT: &str = "The capital of France is";

/// POSTs `body` and returns (status, JSON body).
async fn post(addr: std::net::SocketAddr, path: &str, body: &Value) -> Result<(u16, Value)> {
    let reply = http_client::post(addr, path, body).await?;
    Ok((reply.status, reply.json()?))
}

/// Checks `(status, body)` is a 400 naming `param`.
fn refused(reply: &(u16, Value), param: &str, what: &str) -> Result<()> {
    let (status, body) = reply;
    ensure!(*status == 400, "{what}: status {status}: {body}");
    ensure!(body["error"]["type"] == "invalid_request_error", "{what}: {body}");
    ensure!(body["error"]["param"] == param, "{what}: want param {param}: {body}");
    ensure!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {body}");
    Ok(())
}

fn completion(extra: Value) -> Value {
    let mut body = json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_inputs_are_capped_refused_by_name_or_read() -> Result<()> {
    let sizing = StageSizing { threads: 2, kv_blocks: 16, block_size: 16, ..StageSizing::default() };
    let cluster = TestCluster::start(&smollm2(), &[0, 30], sizing).await?;
    let result = checks(&cluster).await;
    cluster.stop().await?;
    result
}

async fn checks(cluster: &TestCluster) -> Result<()> {
    let addr = cluster.http_addr;
    let mut client = cluster.client().await?;

    // Stop strings: up to MAX_STOP_STRINGS of up to MAX_STOP_BYTES are served; more, longer or empty are 400.
    let most = vec!["x".repeat(MAX_STOP_BYTES); MAX_STOP_STRINGS];
    let (status, body) = post(addr, "/v1/completions", &completion(json!({"stop": most}))).await?;
    ensure!(status == 200, "the most stop strings allowed: {body}");
    let too_many = vec!["x"; MAX_STOP_STRINGS + 1];
    refused(&post(addr, "/v1/completions", &completion(json!({"stop": too_many}))).await?, "stop", "too many")?;
    let too_long = "x".repeat(MAX_STOP_BYTES + 1);
    refused(&post(addr, "/v1/completions", &completion(json!({"stop": too_long}))).await?, "stop", "too long")?;
    let grpc_many = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(PROMPT.into())),
        max_tokens: 2,
        stop: vec!["x".into(); 10_000],
        ..Default::default()
    };
    let err = generate(&mut client, grpc_many).await.err().map(|s| s.code());
    ensure!(err == Some(tonic::Code::InvalidArgument), "gRPC takes the same caps: {err:?}");

    // Chat messages: unknown roles and missing or null content are refused, naming the message.
    let chat = |messages: Value| json!({"messages": messages, "max_tokens": 2, "temperature": 0});
    let cases = [
        (json!([{"role": "wizard", "content": "hi"}]), "messages[0].role"),
        (json!([{"role": "tool", "content": "42"}]), "messages[0].role"),
        (json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]), "messages[1].content"),
        (json!([{"role": "user"}]), "messages[0].content"),
    ];
    for (messages, param) in cases {
        refused(&post(addr, "/v1/chat/completions", &chat(messages.clone())).await?, param, &messages.to_string())?;
    }
    let (status, body) = post(addr, "/v1/chat/completions", &chat(json!([{"role": "user", "content": "hi"}]))).await?;
    ensure!(status == 200, "a plain chat: {body}");

    // Fields asking for what is not served are 400 naming them; their no-op values are accepted.
    let unsupported = [
        ("tools", json!([{"type": "function", "function": {"name": "f"}}])),
        ("tool_choice", json!("auto")),
        ("response_format", json!({"type": "json_object"})),
        ("logit_bias", json!({"17": 5})),
        ("n", json!(2)),
        ("echo", json!(true)),
        ("best_of", json!(3)),
        ("suffix", json!("the end")),
        // Read, but outside OpenAI's range.
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-3)),
    ];
    for (field, value) in unsupported {
        let reply = post(addr, "/v1/completions", &completion(json!({field: value}))).await?;
        refused(&reply, field, field)?;
        let mut chat_body = chat(json!([{"role": "user", "content": "hi"}]));
        chat_body[field] = value;
        refused(&post(addr, "/v1/chat/completions", &chat_body).await?, field, field)?;
    }
    let defaults = json!({"tools": [], "logit_bias": {}, "n": 1, "echo": false, "best_of": 1,
                          "response_format": {"type": "text"}, "tool_choice": null});
    let (status, body) = post(addr, "/v1/completions", &completion(defaults)).await?;
    ensure!(status == 200, "no-op values of unsupported fields: {body}");

    // top_k and repetition_penalty are read: the same tokens as gRPC with the same settings.
    let sampled = |top_k: u32, repetition_penalty: f32| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(PROMPT.into())),
        max_tokens: 12,
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            top_k,
            repetition_penalty,
            seed: Some(11),
            top_p: 1.0,
            ..Default::default()
        }),
        ..Default::default()
    };
    for (top_k, penalty) in [(1, 1.0), (5, 1.0), (5, 1.8)] {
        let grpc = generate(&mut client, sampled(top_k, penalty)).await?;
        let body = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_k": top_k, "seed": 11,
                   "repetition_penalty": penalty});
        let (status, reply) = post(addr, "/v1/completions", &body).await?;
        ensure!(status == 200, "{reply}");
        ensure!(
            reply["choices"][0]["text"] == grpc.text.as_str(),
            "top_k {top_k}, penalty {penalty}: {reply} vs {grpc:?}"
        );
    }
    let greedy = generate(&mut client, sampled(1, 1.0)).await?;
    let plain_greedy = post(addr, "/v1/completions", &completion(json!({"max_tokens": 12}))).await?.1;
    ensure!(plain_greedy["choices"][0]["text"] == greedy.text.as_str(), "top_k 1 at temperature 1 is greedy");
    // presence_penalty and frequency_penalty are read too, and change a greedy text long enough to repeat itself.
    let long_greedy = generate(&mut client, pb::GenerateRequest { max_tokens: 40, ..sampled(1, 1.0) }).await?;
    for (presence, frequency) in [(2.0, 0.0), (0.0, 2.0)] {
        let mut req = pb::GenerateRequest { max_tokens: 40, ..sampled(1, 1.0) };
        if let Some(s) = req.sampling.as_mut() {
            (s.presence_penalty, s.frequency_penalty) = (presence, frequency);
        }
        let grpc = generate(&mut client, req).await?;
        ensure!(grpc.text != long_greedy.text, "presence {presence}, frequency {frequency} changed nothing");
        let body = json!({"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "presence_penalty": presence,
                          "frequency_penalty": frequency});
        let (status, reply) = post(addr, "/v1/completions", &body).await?;
        ensure!(status == 200 && reply["choices"][0]["text"] == grpc.text.as_str(), "{reply} vs {grpc:?}");
    }
    let (status, _) = post(addr, "/v1/completions", &completion(json!({"top_k": -1}))).await?;
    ensure!(status == 200, "top_k -1 is vLLM's off");
    refused(&post(addr, "/v1/completions", &completion(json!({"top_k": -2}))).await?, "top_k", "top_k -2")?;
    let zero_penalty = completion(json!({"repetition_penalty": 0}));
    refused(&post(addr, "/v1/completions", &zero_penalty).await?, "repetition_penalty", "penalty 0")?;

    check_tokenize(cluster, &mut client).await?;
    check_body_limit(cluster).await
}

/// `/tokenize` answers the prompt ids `Generate` starts from; `/detokenize` turns them back; `/version`.
async fn check_tokenize(
    cluster: &TestCluster,
    client: &mut strata_proto::pb::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
) -> Result<()> {
    let addr = cluster.http_addr;
    let text_req = |chat| pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text(PROMPT.into())),
        max_tokens: 1,
        chat,
        ..Default::default()
    };
    let plain = generate(client, text_req(false)).await?.prompt_ids;
    let templated = generate(client, text_req(true)).await?.prompt_ids;
    ensure!(plain != templated, "the chat template adds tokens");
    let model = cluster.pipeline.model();
    let (status, t) = post(addr, "/tokenize", &json!({"model": model.name, "prompt": PROMPT})).await?;
    ensure!(status == 200, "{t}");
    ensure!(t["tokens"] == json!(plain), "{t} vs {plain:?}");
    ensure!(t["count"] == plain.len() && t["max_model_len"] == model.context, "{t}");
    ensure!(t["token_strs"].is_null(), "{t}");
    let (status, t) = post(addr, "/tokenize", &json!({"messages": [{"role": "user", "content": PROMPT}]})).await?;
    ensure!(status == 200 && t["tokens"] == json!(templated), "{t} vs {templated:?}");
    // vLLM's options: the vocabulary strings spell the prompt (byte-level BPE writes a space as Ġ), and a
    // conversation without the generation prompt is the templated prompt less the assistant's opening.
    let (status, t) = post(addr, "/tokenize", &json!({"prompt": PROMPT, "return_token_strs": true})).await?;
    let strs = t["token_strs"].as_array().context("token_strs")?;
    ensure!(status == 200 && strs.len() == plain.len(), "{t}");
    let spelled: String = strs.iter().filter_map(Value::as_str).collect::<String>().replace('Ġ', " ");
    ensure!(spelled.ends_with(PROMPT), "{spelled:?} vs {PROMPT:?}");
    let (status, t) = post(addr, "/tokenize", &json!({"prompt": PROMPT, "add_special_tokens": false})).await?;
    ensure!(status == 200 && t["tokens"] == json!(plain), "SmolLM2 adds no BOS: {t} vs {plain:?}");
    let no_opening = json!({"messages": [{"role": "user", "content": PROMPT}], "add_generation_prompt": false});
    let (status, t) = post(addr, "/tokenize", &no_opening).await?;
    let shorter: Vec<u32> = serde_json::from_value(t["tokens"].clone()).context("tokens")?;
    ensure!(status == 200 && shorter.len() < templated.len() && templated.starts_with(&shorter), "{t}");
    refused(
        &post(addr, "/tokenize", &json!({"messages": [{"role": "x", "content": "y"}]})).await?,
        "messages[0].role",
        "tokenize role",
    )?;
    let (status, t) = post(addr, "/tokenize", &json!({})).await?;
    ensure!(status == 400, "neither prompt nor messages: {t}");
    let (status, t) = post(addr, "/tokenize", &json!({"model": "other", "prompt": "x"})).await?;
    ensure!(status == 404 && t["error"]["code"] == "model_not_found", "{t}");

    let (status, d) = post(addr, "/detokenize", &json!({"tokens": plain})).await?;
    ensure!(status == 200, "{d}");
    let text = d["prompt"].as_str().context("detokenize prompt")?;
    ensure!(text.ends_with(PROMPT), "{text:?}");
    let vocab = model.vocab_size;
    refused(&post(addr, "/detokenize", &json!({"tokens": [vocab]})).await?, "tokens", "outside the vocabulary")?;

    let v = http_client::get(addr, "/version").await?;
    ensure!(v.status == 200 && v.json()?["version"] == env!("CARGO_PKG_VERSION"), "{:?}", v.json());
    Ok(())
}

/// A body over the limit is 413 in OpenAI's shape; one under it is read (and judged on its content).
async fn check_body_limit(cluster: &TestCluster) -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let state = HttpState::new(cluster.pipeline.clone()).with_max_body_bytes(1024);
    let server = tokio::spawn(http::serve(listener, state, None, stop.clone()));
    let big = completion(json!({"prompt": "x".repeat(2048)}));
    let (status, body) = post(addr, "/v1/completions", &big).await?;
    let small = post(addr, "/v1/completions", &completion(json!({"max_tokens": 1}))).await?;
    stop.cancel();
    server.await??;
    ensure!(status == 413, "over the limit: {status} {body}");
    ensure!(body["error"]["code"] == "request_too_large" && body["error"]["type"] == "invalid_request_error", "{body}");
    ensure!(small.0 == 200, "under the limit: {small:?}");
    Ok(())
}
