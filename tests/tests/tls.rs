//! TLS end to end, with a CA and certificates made here: a two-stage cluster whose nodes all use mutual TLS generates
//! exactly what the plaintext cluster does (over gRPC, the HTTPS API and the `strata` CLI); gRPC turns away clients
//! without a certificate from the CA and plaintext clients, and a stage takes no `Forward` from them; HTTPS needs a client that trusts the CA but no client
//! certificate, and a client that never finishes its handshake does not hold up the others.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_proto::pb::stage_client::StageClient;
use strata_proto::{pb, trace_interceptor};
use strata_testkit::workspace_bin;
use strata_tests::http_client::{self, Https};
use strata_tests::pki::{Pki, tls_endpoint};
use strata_tests::{StageSizing, TestCluster, generate, ids_request, tiny_model};
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
use tonic::transport::Endpoint;

const PROMPT: [u32; 5] = [17, 42, 3, 250, 99];
const BOUNDS: [usize; 3] = [0, 2, 4];

async fn tls_cluster(model: &Path, pki: &Pki) -> Result<TestCluster> {
    TestCluster::start_with_tls(model, &BOUNDS, StageSizing::default(), Some(pki.files())).await
}

/// Whether a greedy generation through `endpoint` fails (at connect or at the call) within 10 s.
async fn generation_refused(endpoint: Endpoint) -> bool {
    let attempt = async {
        let mut client = CoordinatorClient::new(endpoint.connect().await?);
        generate(&mut client, ids_request(&PROMPT, 2)).await.map_err(anyhow::Error::from)
    };
    !matches!(tokio::time::timeout(Duration::from_secs(10), attempt).await, Ok(Ok(_)))
}

/// Whether a `Forward` stream to the stage at `endpoint` opens and answers a batch (with its refusal of the batch's
/// plan epoch, since no plan 99 exists) within 10 s.
async fn forward_opens(endpoint: Endpoint) -> bool {
    let attempt = async {
        let mut client = StageClient::with_interceptor(endpoint.connect().await?, trace_interceptor);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(pb::ForwardRequest { plan_epoch: 99, batch_id: 1, ..Default::default() }).await?;
        let mut replies = client.forward(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
        let answer = replies.message().await;
        anyhow::Ok(matches!(answer, Err(ref s) if s.code() == tonic::Code::FailedPrecondition) || answer.is_ok())
    };
    matches!(tokio::time::timeout(Duration::from_secs(10), attempt).await, Ok(Ok(true)))
}

/// An HTTPS client trusting only `roots_pem`, checking the server's certificate for `server_name`.
fn https_trusting(roots_pem: &str, server_name: &str) -> Result<Https> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Https { config: Arc::new(config), server_name: server_name.to_owned() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mutual_tls_cluster_generates_what_the_plaintext_one_does() -> Result<()> {
    let model = tiny_model()?;
    let pki = Pki::new()?;
    let plain = TestCluster::start(model.path(), &BOUNDS, StageSizing::default()).await?;
    let expected = generate(&mut plain.client().await?, ids_request(&PROMPT, 12)).await?.token_ids;
    ensure!(expected.len() == 12, "{expected:?}");
    plain.stop().await?;

    let cluster = tls_cluster(model.path(), &pki).await?;
    let got = generate(&mut cluster.client().await?, ids_request(&PROMPT, 12)).await?;
    assert_eq!(got.token_ids, expected, "coordinator -> stage 0 -> stage 1 over mutual TLS");
    let status = cluster.stage_status(1).await?;
    assert_eq!(status.kv_total_blocks, 64, "a stage answers a client with the CA's certificate");

    // The CLI, configured the way the Helm chart configures it: env only, https:// URL.
    let url = format!("https://127.0.0.1:{}", cluster.addr.port());
    let ids = PROMPT.map(|i| i.to_string()).join(",");
    let cli = |url: &str| -> Result<std::process::Output> {
        let args = ["client", "generate", "--coordinator", url, "--prompt-ids", &ids, "--max-tokens", "12"];
        Ok(Command::new(workspace_bin("strata")?)
            .args(args)
            .args(["--format", "json", "--wait", "2"])
            .env("STRATA_TLS_CERT", pki.path("tls.crt"))
            .env("STRATA_TLS_KEY", pki.path("tls.key"))
            .env("STRATA_TLS_CA", pki.path("ca.crt"))
            .output()?)
    };
    let out = cli(&url)?;
    ensure!(out.status.success(), "strata client generate over TLS: {}", String::from_utf8_lossy(&out.stderr));
    let json: Value = serde_json::from_slice(&out.stdout).context("the CLI prints one JSON object")?;
    assert_eq!(json["token_ids"], json!(expected), "{json}");
    let plaintext = cli(&format!("http://127.0.0.1:{}", cluster.addr.port()))?;
    assert!(!plaintext.status.success(), "an http:// URL must not reach the TLS coordinator");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_turns_away_clients_without_a_certificate_from_the_ca_and_plaintext() -> Result<()> {
    let model = tiny_model()?;
    let pki = Pki::new()?;
    let cluster = tls_cluster(model.path(), &pki).await?;
    let addr = cluster.addr;
    let ok = tls_endpoint(addr, &pki.ca, Some(&pki.node))?;
    assert!(!generation_refused(ok).await, "a client with the CA's certificate is served");
    assert!(generation_refused(tls_endpoint(addr, &pki.ca, None)?).await, "no client certificate");
    let stranger = tls_endpoint(addr, &pki.ca, Some(&pki.stranger))?;
    assert!(generation_refused(stranger).await, "a client certificate from another CA");
    let distrustful = tls_endpoint(addr, &pki.stranger_ca, Some(&pki.node))?;
    assert!(generation_refused(distrustful).await, "a client that does not trust the server's CA");
    assert!(generation_refused(Endpoint::from_shared(format!("http://{addr}"))?).await, "plaintext");

    // A stage worker is as strict as the coordinator.
    let stage = tls_endpoint(cluster.workers[0].local_addr(), &pki.ca, None)?;
    let asked = async {
        let mut client = StageClient::with_interceptor(stage.connect().await?, trace_interceptor);
        anyhow::Ok(client.status(pb::StageStatusRequest {}).await?)
    };
    let answered = matches!(tokio::time::timeout(Duration::from_secs(10), asked).await, Ok(Ok(_)));
    assert!(!answered, "a stage must refuse a client without a certificate");
    // Nor may anyone without the CA's certificate send it batches: a Forward stream never opens.
    let worker = cluster.workers[0].local_addr();
    for (who, identity) in [("no certificate", None), ("another CA's certificate", Some(&pki.stranger))] {
        assert!(!forward_opens(tls_endpoint(worker, &pki.ca, identity)?).await, "Forward with {who}");
    }
    assert!(forward_opens(tls_endpoint(worker, &pki.ca, Some(&pki.node))?).await, "Forward with the CA's certificate");
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_serves_clients_that_trust_the_ca_and_a_stalled_handshake_blocks_no_one() -> Result<()> {
    let model = tiny_model()?;
    let pki = Pki::new()?;
    let cluster = tls_cluster(model.path(), &pki).await?;
    let http = cluster.http_addr;
    let expected = generate(&mut cluster.client().await?, ids_request(&PROMPT, 6)).await?;
    let body = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0});

    // Connected but silent: its handshake never completes while others are served.
    let _stalled = tokio::net::TcpStream::connect(http).await?;
    let trusting = https_trusting(&pki.ca, "localhost")?;
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        http_client::post_https(http, &trusting, "/v1/completions", &body),
    )
    .await
    .context("an HTTPS request waited behind a stalled handshake")??;
    let whole = reply.json()?;
    assert_eq!(reply.status, 200, "{whole}");
    assert_eq!(whole["usage"]["completion_tokens"], 6, "{whole}");
    let logprobs = whole["choices"][0]["logprobs"]["token_logprobs"].as_array().map_or(0, Vec::len);
    assert_eq!(logprobs, expected.token_ids.len(), "{whole}");

    let untrusting = https_trusting(&pki.stranger_ca, "localhost")?;
    let refused = http_client::post_https(http, &untrusting, "/v1/completions", &body).await;
    let err = refused.err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err.contains("certificate"), "a client that does not trust the CA fails the handshake: {err}");
    let wrong_name = https_trusting(&pki.ca, "strata.example")?;
    assert!(http_client::post_https(http, &wrong_name, "/v1/completions", &body).await.is_err(), "name mismatch");
    assert!(http_client::post(http, "/v1/completions", &body).await.is_err(), "plaintext HTTP to the HTTPS port");
    cluster.stop().await
}
