//! API keys on a real coordinator (`run_with_registry`, as `strata local` and the binary run it) in front of a real
//! stage worker: every HTTP endpoint and every gRPC call is refused without a key and with a wrong one and served
//! with the right one; the node administration calls need the admin key; the probes, `/metrics`, health and
//! reflection stay open; and the `strata` CLI sends `--api-key` / `STRATA_API_KEY`.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use strata_coordinator::CoordinatorConfig;
use strata_coordinator::auth::ApiKey;
use strata_membership::{EmbeddedRegistry, NodeState, Registry};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_proto::{NodeId, pb};
use strata_stage_worker::{RegistrationOptions, Worker, WorkerConfig};
use strata_testkit::{free_port, workspace_bin};
use strata_tests::{eventually, grpcurl, http_client, ids_request, tiny_model};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const USER_KEY: &str = "user-key-0123456789";
const SECOND_USER_KEY: &str = "user-key-from-the-file";
const ADMIN_KEY: &str = "admin-key-0123456789";
const WRONG_KEY: &str = "user-key-0123456780";

/// A coordinator with API keys and one registered worker holding every layer.
struct Keyed {
    grpc: SocketAddr,
    http: SocketAddr,
    model_name: String,
    worker: Worker,
    shutdown: CancellationToken,
    coordinator: tokio::task::JoinHandle<strata_coordinator::Result<()>>,
    _model: tempfile::TempDir,
}

impl Keyed {
    async fn start() -> Result<Self> {
        let model = tiny_model()?;
        let registry = EmbeddedRegistry::new("auth");
        let mut worker_config = WorkerConfig::new("w0", model.path(), None);
        worker_config.kv_blocks = Some(64);
        let worker =
            Worker::start_registered(worker_config, registry.clone(), RegistrationOptions::default(), "127.0.0.1:0")
                .await?;
        let grpc = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let http = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let config = CoordinatorConfig {
            cluster: "auth".into(),
            candidate: Some("auth-coordinator".into()),
            min_kv_tokens: Some(256),
            api_keys: vec![ApiKey::new(USER_KEY), ApiKey::new(SECOND_USER_KEY)],
            admin_api_keys: vec![ApiKey::new(ADMIN_KEY)],
            ..CoordinatorConfig::new(model.path(), grpc, http)
        };
        let shutdown = CancellationToken::new();
        let coordinator =
            tokio::spawn(strata_coordinator::run_with_registry(config, registry.clone(), shutdown.clone()));
        // /health is open: it turns 200 once the plan through the worker serves.
        eventually(Duration::from_secs(60), || async move {
            Ok(http_client::get(http, "/health").await.is_ok_and(|r| r.status == 200))
        })
        .await
        .context("the keyed cluster never became healthy")?;
        let ready = registry.get_node(&NodeId::new("w0")).await?.is_some_and(|n| n.state == NodeState::Ready);
        ensure!(ready, "w0 is not READY");
        let models =
            http_client::request(http, "GET", "/v1/models", &[("authorization", &format!("Bearer {USER_KEY}"))], None)
                .await?
                .json()?;
        let model_name = models["data"][0]["id"].as_str().context("no model id")?.to_owned();
        Ok(Keyed { grpc, http, model_name, worker, shutdown, coordinator, _model: model })
    }

    async fn channel(&self) -> Result<Channel> {
        Ok(strata_proto::endpoint(&self.grpc.to_string(), None)?.connect().await?)
    }

    async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.coordinator)
            .await
            .context("coordinator did not stop")???;
        tokio::time::timeout(Duration::from_secs(10), self.worker.shutdown())
            .await
            .context("worker did not stop")??;
        Ok(())
    }
}

/// The `Authorization` header of `key`.
fn bearer(key: Option<&str>) -> Vec<(&'static str, String)> {
    key.map(|k| vec![("authorization", format!("Bearer {k}"))]).unwrap_or_default()
}

async fn call_http(k: &Keyed, method: &str, path: &str, body: Option<&Value>, key: Option<&str>) -> Result<Value> {
    let headers = bearer(key);
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let body = body.map(serde_json::to_vec).transpose()?;
    let reply = http_client::request(k.http, method, path, &headers, body).await?;
    let mut json = reply.json().unwrap_or(Value::Null);
    json["__status"] = json!(reply.status);
    Ok(json)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_every_endpoint_and_rpc() -> Result<()> {
    let k = Keyed::start().await?;
    let result = check_http(&k).await;
    let result = match result {
        Ok(()) => check_grpc(&k).await,
        e => e,
    };
    let result = match result {
        Ok(()) => check_cli(&k).await,
        e => e,
    };
    let result = match result {
        Ok(()) => check_drain(&k).await,
        e => e,
    };
    k.stop().await?;
    result
}

async fn check_http(k: &Keyed) -> Result<()> {
    let completion = json!({"prompt": [17, 42, 3], "max_tokens": 2});
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let model_path = format!("/v1/models/{}", k.model_name);
    // Every guarded endpoint, with the status the right key gets.
    let tokenize = json!({"prompt": "hi"});
    let detokenize = json!({"tokens": [17]});
    let guarded: [(&str, &str, Option<&Value>, u16); 8] = [
        ("GET", "/v1/models", None, 200),
        ("GET", &model_path, None, 200),
        ("POST", "/v1/completions", Some(&completion), 200),
        // The tiny model has no tokenizer: the key is accepted, the request is not.
        ("POST", "/v1/chat/completions", Some(&chat), 400),
        ("POST", "/tokenize", Some(&tokenize), 400),
        ("POST", "/detokenize", Some(&detokenize), 400),
        ("GET", "/v1/nope", None, 404),
        ("GET", "/version", None, 200),
    ];
    for (method, path, body, served) in guarded {
        for key in [None, Some(WRONG_KEY), Some("")] {
            let r = call_http(k, method, path, body, key).await?;
            ensure!(r["__status"] == 401, "{method} {path} with {key:?}: {r}");
            ensure!(r["error"]["code"] == "invalid_api_key", "{method} {path} with {key:?}: {r}");
            ensure!(r["error"]["type"] == "authentication_error", "{method} {path}: {r}");
            ensure!(r["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{method} {path}: {r}");
        }
        for key in [USER_KEY, SECOND_USER_KEY, ADMIN_KEY] {
            let r = call_http(k, method, path, body, Some(key)).await?;
            ensure!(r["__status"] == served, "{method} {path} with a right key: {r}");
        }
    }
    let r = call_http(k, "GET", "/v1/models", None, Some(USER_KEY)).await?;
    ensure!(r["data"][0]["id"] == k.model_name.as_str(), "{r}");
    let r = call_http(k, "POST", "/v1/completions", Some(&completion), Some(USER_KEY)).await?;
    ensure!(r["usage"]["completion_tokens"] == 2, "{r}");
    for open in ["/health", "/live", "/metrics"] {
        let reply = http_client::get(k.http, open).await?;
        ensure!(reply.status == 200, "{open} must stay open: {}", reply.status);
    }
    let metrics = String::from_utf8(http_client::get(k.http, "/metrics").await?.body)?;
    ensure!(metrics.contains("status=\"401\""), "refusals are counted: {metrics}");
    Ok(())
}

/// A request carrying `key` as gRPC metadata.
fn keyed<T>(message: T, key: Option<&str>) -> Result<tonic::Request<T>> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request.metadata_mut().insert("authorization", format!("Bearer {key}").parse()?);
    }
    Ok(request)
}

/// What each `Coordinator` call answers with `key`.
async fn grpc_codes(
    client: &mut CoordinatorClient<Channel>,
    key: Option<&str>,
) -> Result<Vec<(&'static str, tonic::Code)>> {
    let code = |r: std::result::Result<(), tonic::Status>| r.err().map_or(tonic::Code::Ok, |s| s.code());
    let generate = async {
        let mut stream = client.clone().generate(keyed(ids_request(&[17, 42], 2), key)?).await?.into_inner();
        while stream.message().await?.is_some() {}
        Ok::<_, anyhow::Error>(())
    };
    let generated = match generate.await {
        Ok(()) => tonic::Code::Ok,
        Err(e) => e.downcast_ref::<tonic::Status>().map(tonic::Status::code).context(e.to_string())?,
    };
    let status = code(client.cluster_status(keyed(pb::ClusterStatusRequest {}, key)?).await.map(drop));
    let node = || pb::NodeRequest { node_id: "w0".into() };
    let cordon = code(client.cordon_node(keyed(node(), key)?).await.map(drop));
    let uncordon = code(client.uncordon_node(keyed(node(), key)?).await.map(drop));
    Ok(vec![("Generate", generated), ("ClusterStatus", status), ("CordonNode", cordon), ("UncordonNode", uncordon)])
}

async fn check_grpc(k: &Keyed) -> Result<()> {
    use tonic::Code::{Ok as Served, PermissionDenied, Unauthenticated};
    let mut client = CoordinatorClient::new(k.channel().await?);
    for key in [None, Some(WRONG_KEY)] {
        let codes = grpc_codes(&mut client, key).await?;
        ensure!(codes.iter().all(|(_, c)| *c == Unauthenticated), "{key:?}: {codes:?}");
    }
    let user = grpc_codes(&mut client, Some(USER_KEY)).await?;
    let want = vec![
        ("Generate", Served),
        ("ClusterStatus", Served),
        ("CordonNode", PermissionDenied),
        ("UncordonNode", PermissionDenied),
    ];
    ensure!(user == want, "a plain key: {user:?}");
    let admin = grpc_codes(&mut client, Some(ADMIN_KEY)).await?;
    ensure!(admin.iter().all(|(_, c)| *c == Served), "the admin key: {admin:?}");

    // Health and reflection need no key.
    let mut health = tonic_health::pb::health_client::HealthClient::new(k.channel().await?);
    let check = tonic_health::pb::HealthCheckRequest { service: strata_proto::COORDINATOR_SERVICE.into() };
    health.check(check).await.context("health must stay open")?;
    check_grpcurl(k).await
}

/// grpcurl lists the services (reflection is open) and calls `Generate` with `-H 'authorization: Bearer KEY'`.
async fn check_grpcurl(k: &Keyed) -> Result<()> {
    let Some(grpcurl) = strata_tests::grpcurl::find()? else { return Ok(()) };
    let addr = k.grpc.to_string();
    tokio::task::spawn_blocking(move || -> Result<()> {
        let listed = grpcurl::run(&grpcurl, &addr, &[], None, &["list"])?;
        ensure!(listed.ok && listed.stdout.contains(strata_proto::COORDINATOR_SERVICE), "list: {listed:?}");
        let method = format!("{}/Generate", strata_proto::COORDINATOR_SERVICE);
        let request = Some(r#"{"ids": {"ids": [17, 42]}, "maxTokens": 2}"#);
        let refused = grpcurl::run(&grpcurl, &addr, &[], request, &[&method])?;
        ensure!(!refused.ok && refused.stderr.contains("Unauthenticated"), "Generate without a key: {refused:?}");
        let header = format!("authorization: Bearer {USER_KEY}");
        let served = grpcurl::run(&grpcurl, &addr, &[&header], request, &[&method])?;
        ensure!(served.ok && served.stdout.contains("FINISH_REASON_LENGTH"), "Generate with -H: {served:?}");
        Ok(())
    })
    .await?
}

/// `DrainNode`, last: it takes the only worker out of the plan.
async fn check_drain(k: &Keyed) -> Result<()> {
    use tonic::Code::{PermissionDenied, Unauthenticated};
    let mut client = CoordinatorClient::new(k.channel().await?);
    for (key, want) in [(None, Unauthenticated), (Some(WRONG_KEY), Unauthenticated), (Some(USER_KEY), PermissionDenied)]
    {
        let r = client.drain_node(keyed(pb::NodeRequest { node_id: "w0".into() }, key)?).await;
        ensure!(r.as_ref().err().map(tonic::Status::code) == Some(want), "DrainNode with {key:?}: {r:?}");
    }
    let drained = client.drain_node(keyed(pb::NodeRequest { node_id: "w0".into() }, Some(ADMIN_KEY))?).await?;
    ensure!(drained.into_inner().state == pb::NodeState::Draining as i32, "DrainNode with the admin key");
    Ok(())
}

/// `strata nodes` and `strata client generate` present `--api-key` (or `STRATA_API_KEY`).
async fn check_cli(k: &Keyed) -> Result<()> {
    let strata = workspace_bin("strata")?;
    let url = format!("http://{}", k.grpc);
    let bench_url = url.clone();
    let run = move |args: &[&str], env_key: Option<&str>| -> Result<(bool, String)> {
        let mut cmd = Command::new(&strata);
        cmd.args(args).env_remove("STRATA_API_KEY").env("STRATA_COORDINATOR", &url);
        if let Some(key) = env_key {
            cmd.env("STRATA_API_KEY", key);
        }
        let out = cmd.output()?;
        Ok((
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        ))
    };
    let cli = tokio::task::spawn_blocking(move || -> Result<()> {
        let generate = ["client", "generate", "--prompt-ids", "17,42", "--max-tokens", "2", "--wait", "60"];
        let (ok, out) = run(&generate, None)?;
        ensure!(!ok && out.contains("API key"), "client generate without a key: {out}");
        let mut with_key = generate.to_vec();
        with_key.extend(["--api-key", USER_KEY]);
        let (ok, out) = run(&with_key, None)?;
        ensure!(ok, "client generate with --api-key: {out}");
        let (ok, out) = run(&["nodes", "list"], None)?;
        ensure!(!ok && out.contains("API key"), "nodes list without a key: {out}");
        let (ok, out) = run(&["nodes", "list"], Some(&format!("{USER_KEY},{SECOND_USER_KEY}")))?;
        ensure!(ok && out.contains("w0"), "nodes list with STRATA_API_KEY: {out}");
        let (ok, out) = run(&["nodes", "cordon", "w0", "--api-key", USER_KEY], None)?;
        ensure!(!ok && out.contains("admin"), "nodes cordon with a plain key: {out}");
        let (ok, out) = run(&["nodes", "cordon", "w0", "--api-key", ADMIN_KEY], None)?;
        ensure!(ok && out.contains("CORDONED"), "nodes cordon with the admin key: {out}");
        let (ok, out) = run(&["nodes", "uncordon", "w0", "--api-key", ADMIN_KEY], None)?;
        ensure!(ok && out.contains("READY"), "nodes uncordon with the admin key: {out}");
        let out_dir = tempfile::tempdir()?;
        let report = out_dir.path().join("bench.json");
        let report = report.to_str().context("temp path")?;
        let bench = [
            "bench",
            "--coordinator",
            &bench_url,
            "--concurrency",
            "1",
            "--requests-per-client",
            "1",
            "--prompt-tokens",
            "2",
            "--decode-tokens",
            "2",
            "--out",
            report,
        ];
        let (ok, out) = run(&bench, None)?;
        ensure!(!ok && out.contains("API key"), "bench without a key: {out}");
        // Its prompts draw ids beyond the tiny model's vocabulary, so the measured requests fail; getting the plan
        // and a first generation (ready_client) through shows the key went with every call.
        let (_, out) = run(&bench, Some(USER_KEY))?;
        ensure!(out.contains("plan: 1 stage(s)") && !out.contains("API key"), "bench with STRATA_API_KEY: {out}");
        Ok(())
    });
    cli.await?
}
