//! The coordinator's own control loop, on etcd, over stage workers that register themselves (moved here from the
//! stage worker's tests, which no longer depend on the coordinator).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use strata_coordinator::CoordinatorConfig;
use strata_membership::{EtcdOptions, EtcdRegistry, Registry};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_stage_worker::{RegistrationOptions, Worker, WorkerConfig};
use strata_testkit::{EtcdServer, free_port};
use strata_tests::{generate, ids_request, reference, tiny_model};
use tonic::{Code, Status};

const PROMPT: [u32; 5] = [5, 17, 2, 99, 42];

/// The coordinator places the model over the two registered workers (both, unless one measured so much slower
/// — tests run in parallel — that placement rightly leaves it idle); every stage of its plan loads it, and a
/// greedy request through the coordinator's API yields the single-process engine's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_plans_registered_workers() -> Result<()> {
    let model = tiny_model()?;
    let expected = reference(model.path(), 1, &PROMPT, 1)?;
    let etcd = EtcdServer::start()?;
    let registry =
        EtcdRegistry::connect(&EtcdOptions::new(vec![etcd.endpoint()]), "planned", Duration::from_secs(5)).await?;
    let options = RegistrationOptions { lease_ttl: Duration::from_secs(2), ..Default::default() };
    let mut workers = Vec::new();
    for id in ["a", "b"] {
        let cfg = WorkerConfig {
            threads: 1,
            kv_blocks: Some(64),
            block_size: 4,
            ..WorkerConfig::new(id, model.path(), None)
        };
        workers.push(Worker::start_registered(cfg, registry.clone(), options.clone(), "127.0.0.1:0").await?);
    }
    let grpc = format!("127.0.0.1:{}", free_port()?).parse()?;
    let config = CoordinatorConfig {
        etcd: Some(EtcdOptions::new(vec![etcd.endpoint()])),
        cluster: "planned".into(),
        min_stages: 2,
        lease_ttl_secs: 2,
        ..CoordinatorConfig::new(model.path(), grpc, "127.0.0.1:0".parse()?)
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let coordinator = tokio::spawn(strata_coordinator::run(config, stop.clone()));

    let deadline = Instant::now() + Duration::from_secs(60);
    let plan = loop {
        if Instant::now() >= deadline {
            let (plan, nodes) = (registry.get_plan().await?, registry.list_nodes().await?);
            let state = if coordinator.is_finished() { "stopped" } else { "running" };
            bail!("no plan loaded by every stage in time; coordinator {state}; plan {plan:?}; nodes {nodes:?}");
        }
        if let Some(plan) = registry.get_plan().await?.filter(|p| !p.stages.is_empty()) {
            let nodes = registry.list_nodes().await?;
            let loaded = plan
                .stages
                .iter()
                .all(|s| nodes.iter().any(|n| n.node_id == s.node_id && n.plan_epoch_loaded == plan.epoch));
            if loaded {
                break plan;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(plan.covers_all_layers() && plan.num_layers == 4, "{plan:?}");
    if plan.stages.len() == 1 {
        let nodes = registry.list_nodes().await?;
        let speed = |id: &str| nodes.iter().find(|n| n.node_id.as_str() == id).map_or(0.0, |n| n.layer_seconds);
        let (used, idle) = if plan.stages[0].node_id.as_str() == "a" { ("a", "b") } else { ("b", "a") };
        ensure!(speed(idle) > 2.0 * speed(used), "a one-stage plan with two similar workers: {plan:?} {nodes:?}");
    }

    // The coordinator serves once its pipeline has taken the plan up: UNAVAILABLE (or no answer) until then.
    let url = format!("http://{grpc}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        let attempt = async {
            let mut client =
                CoordinatorClient::connect(url.clone()).await.map_err(|e| Status::unavailable(e.to_string()))?;
            generate(&mut client, ids_request(&PROMPT, 1)).await
        };
        match attempt.await {
            Ok(out) => break out.token_ids,
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => bail!("the coordinator did not serve the plan: {s}"),
        }
    };
    ensure!(got == expected, "coordinator's pipeline gave {got:?}, the engine {expected:?}");

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), coordinator).await.context("coordinator did not stop")???;
    for w in workers {
        w.shutdown().await?;
    }
    Ok(())
}
