//! Admin rights from a client certificate: a real coordinator (`run_with_registry`) and stage worker under mutual TLS,
//! with API keys and `admin_cert_identities = ["ops-admin"]`. A caller presenting the CA's certificate named
//! `ops-admin` may cordon, uncordon and generate without a key, from Rust and from the `strata` CLI; a certificate
//! with another name (a user's, or the nodes' own) gets nothing without a key, and a plain key still cannot cordon.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use strata_coordinator::CoordinatorConfig;
use strata_coordinator::auth::ApiKey;
use strata_membership::{EmbeddedRegistry, NodeState, Registry};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_proto::{NodeId, pb};
use strata_stage_worker::{RegistrationOptions, Worker, WorkerConfig};
use strata_testkit::{free_port, workspace_bin};
use strata_tests::pki::{Pem, Pki, tls_endpoint};
use strata_tests::{eventually, generate, ids_request, tiny_model};
use tokio_util::sync::CancellationToken;
use tonic::Code;

const USER_KEY: &str = "user-key-0123456789";
const ADMIN_KEY: &str = "admin-key-0123456789";

/// What `CordonNode` on w0 answers with `identity` and `key`; a served cordon is undone at once.
async fn cordon(grpc: std::net::SocketAddr, pki: &Pki, identity: &Pem, key: Option<&str>) -> Result<Code> {
    let mut client = CoordinatorClient::new(tls_endpoint(grpc, &pki.ca, Some(identity))?.connect().await?);
    let mut request = tonic::Request::new(pb::NodeRequest { node_id: "w0".into() });
    if let Some(key) = key {
        request.metadata_mut().insert("authorization", format!("Bearer {key}").parse()?);
    }
    match client.cordon_node(request).await {
        Ok(reply) => {
            ensure!(reply.into_inner().state == pb::NodeState::Cordoned as i32, "cordoned");
            let mut undo = tonic::Request::new(pb::NodeRequest { node_id: "w0".into() });
            undo.metadata_mut().insert("authorization", format!("Bearer {ADMIN_KEY}").parse()?);
            client.uncordon_node(undo).await?;
            Ok(Code::Ok)
        }
        Err(status) => Ok(status.code()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_with_an_admin_identity_is_an_administrator() -> Result<()> {
    let model = tiny_model()?;
    let pki = Pki::new()?;
    let admin = pki.client("ops-admin")?;
    let alice = pki.client("alice")?;
    let registry = EmbeddedRegistry::new("admin-cert");
    let mut worker_config = WorkerConfig::new("w0", model.path(), None);
    worker_config.kv_blocks = Some(64);
    worker_config.tls = Some(pki.files());
    let worker =
        Worker::start_registered(worker_config, registry.clone(), RegistrationOptions::default(), "127.0.0.1:0")
            .await?;
    let grpc = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let http = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let config = CoordinatorConfig {
        cluster: "admin-cert".into(),
        candidate: Some("admin-cert-coordinator".into()),
        min_kv_tokens: Some(256),
        tls: Some(pki.files()),
        api_keys: vec![ApiKey::new(USER_KEY)],
        admin_api_keys: vec![ApiKey::new(ADMIN_KEY)],
        admin_cert_identities: vec!["ops-admin".into()],
        ..CoordinatorConfig::new(model.path(), grpc, http)
    };
    let shutdown = CancellationToken::new();
    let coordinator = tokio::spawn(strata_coordinator::run_with_registry(config, registry.clone(), shutdown.clone()));
    let result = async {
        // Generation works once the plan through w0 serves; the admin certificate needs no key for it.
        let admin_endpoint = tls_endpoint(grpc, &pki.ca, Some(&admin))?;
        eventually(Duration::from_secs(60), || {
            let endpoint = admin_endpoint.clone();
            async move {
                let Ok(channel) = endpoint.connect().await else { return Ok(false) };
                Ok(generate(&mut CoordinatorClient::new(channel), ids_request(&[17, 42], 2)).await.is_ok())
            }
        })
        .await
        .context("the admin certificate never generated")?;

        ensure!(cordon(grpc, &pki, &admin, None).await? == Code::Ok, "the admin certificate cordons without a key");
        for (who, identity) in [("alice", &alice), ("the nodes' certificate", &pki.node)] {
            let code = cordon(grpc, &pki, identity, None).await?;
            ensure!(code == Code::Unauthenticated, "{who} without a key: {code:?}");
            let code = cordon(grpc, &pki, identity, Some(USER_KEY)).await?;
            ensure!(code == Code::PermissionDenied, "{who} with a plain key: {code:?}");
            ensure!(cordon(grpc, &pki, identity, Some(ADMIN_KEY)).await? == Code::Ok, "{who} with the admin key");
        }
        let mut alice_client = CoordinatorClient::new(tls_endpoint(grpc, &pki.ca, Some(&alice))?.connect().await?);
        let refused = generate(&mut alice_client, ids_request(&[17, 42], 2)).await.err().map(|s| s.code());
        ensure!(refused == Some(Code::Unauthenticated), "alice generates only with a key: {refused:?}");

        // The CLI with the admin certificate, as an operator runs it: no key.
        let strata = workspace_bin("strata")?;
        let url = format!("https://127.0.0.1:{}", grpc.port());
        let (cert, key, ca) = (pki.path("ops-admin.crt"), pki.path("ops-admin.key"), pki.path("ca.crt"));
        let out = tokio::task::spawn_blocking(move || {
            Command::new(strata)
                .args(["nodes", "cordon", "w0"])
                .env_remove("STRATA_API_KEY")
                .env("STRATA_COORDINATOR", url)
                .env("STRATA_TLS_CERT", cert)
                .env("STRATA_TLS_KEY", key)
                .env("STRATA_TLS_CA", ca)
                .output()
        })
        .await??;
        let printed = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        ensure!(out.status.success() && printed.contains("CORDONED"), "strata nodes cordon: {printed}");
        let state = registry.get_node(&NodeId::new("w0")).await?.map(|n| n.state);
        ensure!(state == Some(NodeState::Cordoned), "the registry holds the cordon: {state:?}");
        Ok(())
    }
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), coordinator).await.context("coordinator did not stop")???;
    tokio::time::timeout(Duration::from_secs(10), worker.shutdown()).await.context("worker did not stop")??;
    result
}
