//! Workers without a layer range: they register (embedded registry and real etcd), turn READY with a measured
//! layer speed, load what each plan epoch assigns them, and keep serving through an etcd outage. (The coordinator
//! planning registered workers is tested in `tests/tests/registered.rs`.)

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{Stream, chunk, status};
use strata_membership::{EmbeddedRegistry, EtcdRegistry, NodeRecord, NodeState, Plan, PlanStage, Registry};
use strata_proto::{NodeId, PlanEpoch, pb};
use strata_stage_worker::{RegistrationOptions, Worker, WorkerConfig};
use strata_testkit::EtcdServer;

const PROMPT: [u32; 5] = [5, 17, 2, 99, 42];

fn registered_config(model: &Path, id: &str) -> WorkerConfig {
    WorkerConfig { threads: 1, kv_blocks: 64, block_size: 4, ..WorkerConfig::new(id, model, None) }
}

fn options() -> RegistrationOptions {
    RegistrationOptions { memory_limit: Some(1 << 30), lease_ttl: Duration::from_secs(2), ..Default::default() }
}

/// Waits for `id`'s record to satisfy `ok` (registry errors count as "not yet").
async fn node_where<R: Registry>(registry: &R, id: &str, ok: impl Fn(&NodeRecord) -> bool) -> Result<NodeRecord> {
    let id = NodeId::new(id);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(rec) = registry.get_node(&id).await.ok().flatten()
            && ok(&rec)
        {
            return Ok(rec);
        }
        if Instant::now() >= deadline {
            bail!("node {id} did not reach the expected record in time");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn stage(worker: &Worker, id: &str, layers: std::ops::Range<u32>) -> PlanStage {
    PlanStage {
        node_id: NodeId::new(id),
        address: worker.local_addr().to_string(),
        layer_start: layers.start,
        layer_end: layers.end,
    }
}

fn plan(epoch: u64, stages: Vec<PlanStage>) -> Plan {
    Plan { epoch: PlanEpoch(epoch), stages, model: "tiny".into(), num_layers: 4, term: 0 }
}

/// The greedy first token of `PROMPT` from the single-process engine.
fn engine_token(model: &Path) -> Result<u32> {
    let out = common::Schedule::new(&[(1, PROMPT.to_vec(), 0, 0)], 1).run_engine(model)?;
    out.get(&1).and_then(|t| t.first().copied()).context("engine produced no token")
}

/// Prefills `PROMPT` as sequence `seq` through `worker` under `epoch`; returns the sampled token (or the error).
async fn forward(worker: &Worker, seq: u64, epoch: u64) -> Result<std::result::Result<u32, pb::Error>> {
    let mut stream = Stream::open(worker).await?;
    stream
        .send(pb::ForwardRequest {
            batch_id: seq,
            plan_epoch: epoch,
            chunks: vec![chunk(seq, 0, PROMPT.len() as u32, false)],
            token_ids: PROMPT.to_vec(),
            ..Default::default()
        })
        .await?;
    let resp = stream.recv().await?;
    if let Some(err) = resp.error {
        return Ok(Err(err));
    }
    let token = resp.tokens.first().map(|t| t.token_id).context("no token in the response")?;
    Ok(Ok(token))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_plan_epochs_with_the_embedded_registry() -> Result<()> {
    let model = common::tiny_model()?;
    let expected = engine_token(model.path())?;
    let registry = EmbeddedRegistry::new("test");
    let w0 =
        Worker::start_registered(registered_config(model.path(), "w0"), registry.clone(), options(), "127.0.0.1:0")
            .await?;
    let w1 =
        Worker::start_registered(registered_config(model.path(), "w1"), registry.clone(), options(), "127.0.0.1:0")
            .await?;
    for (id, w) in [("w0", &w0), ("w1", &w1)] {
        let rec = node_where(&registry, id, |r| r.state == NodeState::Ready).await?;
        ensure!(rec.layer_seconds > 0.0 && rec.layer_seconds.is_finite(), "{id}: layer_seconds {}", rec.layer_seconds);
        ensure!(rec.address == w.local_addr().to_string() && rec.memory_bytes == 1 << 30, "{rec:?}");
        ensure!(rec.plan_epoch_loaded == PlanEpoch(0));
        // No plan yet: the worker answers, but holds no layers.
        ensure!(status(w).await?.layer_end == 0);
        let refused = forward(w, 90, 0).await?;
        ensure!(refused.is_err(), "{id} served without layers: {refused:?}");
    }

    // Epoch 1: w0 holds the whole model, w1 nothing.
    registry.write_plan(&plan(1, vec![stage(&w0, "w0", 0..4)]), PlanEpoch(0)).await?;
    node_where(&registry, "w0", |r| r.plan_epoch_loaded == PlanEpoch(1)).await?;
    let st = status(&w0).await?;
    ensure!((st.layer_start, st.layer_end, st.plan_epoch) == (0, 4, 1), "w0 status {st:?}");
    ensure!(forward(&w0, 1, 1).await? == Ok(expected), "epoch 1 token differs from the engine's {expected}");

    // Epoch 2: the model split over both; both reload, and stage 0 still yields the engine's token.
    registry.write_plan(&plan(2, vec![stage(&w0, "w0", 0..2), stage(&w1, "w1", 2..4)]), PlanEpoch(1)).await?;
    for id in ["w0", "w1"] {
        node_where(&registry, id, |r| r.plan_epoch_loaded == PlanEpoch(2)).await?;
    }
    let (s0, s1) = (status(&w0).await?, status(&w1).await?);
    ensure!((s0.layer_start, s0.layer_end, s0.plan_epoch) == (0, 2, 2), "w0 status {s0:?}");
    ensure!((s1.layer_start, s1.layer_end, s1.plan_epoch) == (2, 4, 2), "w1 status {s1:?}");
    ensure!(forward(&w0, 2, 2).await? == Ok(expected), "epoch 2 token differs from the engine's {expected}");
    // A batch scheduled under the old epoch is refused.
    ensure!(forward(&w0, 3, 1).await?.is_err(), "stale epoch accepted");

    // Epoch 3 leaves w1 out: it drops its layers and stays registered and READY.
    registry.write_plan(&plan(3, vec![stage(&w0, "w0", 0..4)]), PlanEpoch(2)).await?;
    let rec = node_where(&registry, "w1", |r| r.plan_epoch_loaded == PlanEpoch(3)).await?;
    ensure!(rec.state == NodeState::Ready);
    ensure!(status(&w1).await?.layer_end == 0, "w1 kept its layers");

    w0.shutdown().await?;
    w1.shutdown().await?;
    // Shutting down deregisters.
    ensure!(registry.list_nodes().await?.is_empty(), "records left after shutdown");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_rides_out_an_etcd_outage() -> Result<()> {
    let model = common::tiny_model()?;
    let expected = engine_token(model.path())?;
    let mut etcd = EtcdServer::start()?;
    let registry = EtcdRegistry::connect(&[etcd.endpoint()], "outage", Duration::from_secs(5)).await?;
    let w = Worker::start_registered(registered_config(model.path(), "w"), registry.clone(), options(), "127.0.0.1:0")
        .await?;
    let rec = node_where(&registry, "w", |r| r.state == NodeState::Ready).await?;
    ensure!(rec.layer_seconds > 0.0, "{rec:?}");
    registry.write_plan(&plan(1, vec![stage(&w, "w", 0..4)]), PlanEpoch(0)).await?;
    node_where(&registry, "w", |r| r.plan_epoch_loaded == PlanEpoch(1)).await?;
    ensure!(forward(&w, 1, 1).await? == Ok(expected));

    // etcd gone for longer than the lease TTL: the worker keeps serving its plan.
    etcd.kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(forward(&w, 2, 1).await? == Ok(expected), "worker stopped serving while etcd was down");
    let st = status(&w).await?;
    ensure!((st.layer_start, st.layer_end, st.plan_epoch) == (0, 4, 1), "{st:?}");

    // etcd back: the record is there again, READY with the loaded epoch.
    etcd.restart()?;
    let rec =
        node_where(&registry, "w", |r| r.state == NodeState::Ready && r.plan_epoch_loaded == PlanEpoch(1)).await?;
    ensure!(rec.address == w.local_addr().to_string());
    ensure!(forward(&w, 3, 1).await? == Ok(expected));

    // The lease revoked behind its back (as if it had expired): the record vanishes, and the worker registers
    // again with everything it had reported.
    ensure!(etcd.revoke_all_leases()? >= 1, "no lease to revoke");
    ensure!(registry.get_node(&NodeId::new("w")).await?.is_none(), "record survived its lease");
    let rec =
        node_where(&registry, "w", |r| r.state == NodeState::Ready && r.plan_epoch_loaded == PlanEpoch(1)).await?;
    ensure!(rec.layer_seconds > 0.0, "{rec:?}");
    w.shutdown().await?;
    Ok(())
}
