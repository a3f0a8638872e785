//! Workers without a layer range: they register (embedded registry and real etcd), turn READY with a measured
//! layer speed, load what each plan epoch assigns them (and only when the range changes), report a range they
//! cannot load, take themselves out of placement when their executor dies, and keep serving through an etcd
//! outage. (The coordinator planning registered workers is tested in `tests/tests/registered.rs`.)

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{Stream, chunk, status};
use strata_membership::{
    EmbeddedRegistry, EtcdOptions, EtcdRegistry, NodeRecord, NodeState, Plan, PlanStage, Registry,
};
use strata_proto::tonic_health::pb::health_check_response::ServingStatus;
use strata_proto::tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use strata_proto::{ErrorCode, NodeId, PlanEpoch, STAGE_SERVICE, ServiceError, pb};
use strata_stage_worker::{RegistrationOptions, Worker, WorkerConfig};
use strata_testkit::EtcdServer;

const PROMPT: [u32; 5] = [5, 17, 2, 99, 42];

fn registered_config(model: &Path, id: &str) -> WorkerConfig {
    WorkerConfig { threads: 1, kv_blocks: Some(64), block_size: 4, ..WorkerConfig::new(id, model, None) }
}

fn options() -> RegistrationOptions {
    RegistrationOptions { lease_ttl: Duration::from_secs(2), ..Default::default() }
}

/// Waits for `id`'s record to satisfy `ok` (registry errors count as "not yet").
fn total_ram() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    let kib = text.lines().find_map(|l| l.strip_prefix("MemTotal:")).context("no MemTotal")?;
    Ok(kib.trim().trim_end_matches("kB").trim().parse::<u64>()? * 1024)
}

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
    Plan { epoch: PlanEpoch(epoch), stages, model: "tiny".into(), num_layers: 4, ..Plan::default() }
}

/// Sends one batch of `tokens` for `seq` from position `start` under `epoch` and `term` on a fresh stream; returns
/// the sampled token or the error code.
async fn step(
    worker: &Worker,
    seq: u64,
    start: u32,
    tokens: &[u32],
    epoch: u64,
    term: u64,
) -> Result<Result<u32, ErrorCode>> {
    let mut stream = Stream::open(worker).await?;
    stream
        .send(pb::ForwardRequest {
            batch_id: seq * 1000 + u64::from(start),
            plan_epoch: epoch,
            term,
            chunks: vec![chunk(seq, start, tokens.len() as u32, false)],
            token_ids: tokens.to_vec(),
            ..Default::default()
        })
        .await?;
    let resp = stream.recv().await?;
    if let Some(err) = resp.error {
        return Ok(Err(ServiceError::from(err).code));
    }
    Ok(Ok(resp.tokens.first().map(|t| t.token_id).context("no token in the response")?))
}

/// The gRPC health of `worker`'s Stage service.
async fn stage_health(worker: &Worker) -> Result<ServingStatus> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", worker.local_addr()))?.connect().await?;
    let mut health = HealthClient::new(channel);
    let resp = health.check(HealthCheckRequest { service: STAGE_SERVICE.to_owned() }).await?.into_inner();
    Ok(resp.status())
}

/// Waits until `worker`'s Stage health is `wanted`.
async fn health_becomes(worker: &Worker, wanted: ServingStatus) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while stage_health(worker).await? != wanted {
        if Instant::now() >= deadline {
            bail!("Stage health did not become {wanted:?}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Ok(())
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
    // w0 offers a memory limit; w1 a share of the RAM.
    let limited = WorkerConfig { memory_limit: Some(1 << 30), ..registered_config(model.path(), "w0") };
    let w0 = Worker::start_registered(limited, registry.clone(), options(), "127.0.0.1:0").await?;
    let w1 =
        Worker::start_registered(registered_config(model.path(), "w1"), registry.clone(), options(), "127.0.0.1:0")
            .await?;
    for (id, w) in [("w0", &w0), ("w1", &w1)] {
        let rec = node_where(&registry, id, |r| r.state == NodeState::Ready).await?;
        ensure!(rec.layer_seconds > 0.0 && rec.layer_seconds.is_finite(), "{id}: layer_seconds {}", rec.layer_seconds);
        let memory = if id == "w0" { 1 << 30 } else { (total_ram()? as f64 * 0.9) as u64 };
        ensure!(rec.address == w.local_addr().to_string() && rec.memory_bytes == memory, "{rec:?}");
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
    let registry =
        EtcdRegistry::connect(&EtcdOptions::new(vec![etcd.endpoint()]), "outage", Duration::from_secs(5)).await?;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_range_keeps_the_executor_and_its_kv() -> Result<()> {
    let model = common::tiny_model()?;
    let registry = EmbeddedRegistry::new("keep");
    let (cfg, cfg2) = (registered_config(model.path(), "w"), registered_config(model.path(), "w2"));
    let w = Worker::start_registered(cfg, registry.clone(), options(), "127.0.0.1:0").await?;
    let w2 = Worker::start_registered(cfg2, registry.clone(), options(), "127.0.0.1:0").await?;
    node_where(&registry, "w2", |r| r.state == NodeState::Ready).await?;
    registry.write_plan(&plan(1, vec![stage(&w, "w", 0..4)]), PlanEpoch(0)).await?;
    node_where(&registry, "w", |r| r.plan_epoch_loaded == PlanEpoch(1)).await?;
    let first = step(&w, 1, 0, &PROMPT, 1, 0).await?.map_err(|c| anyhow::anyhow!("prefill failed: {c:?}"))?;
    let held = status(&w).await?;
    ensure!(held.kv_free_blocks == held.kv_total_blocks - 2, "5 tokens hold 2 blocks: {held:?}");

    // Epoch 2, same range: no reload. The live sequence's KV is still there and it decodes on under epoch 2
    // (a reloaded stage would answer NOT_FOUND); epoch 1 batches are refused now.
    registry.write_plan(&plan(2, vec![stage(&w, "w", 0..4)]), PlanEpoch(1)).await?;
    node_where(&registry, "w", |r| r.plan_epoch_loaded == PlanEpoch(2)).await?;
    let st = status(&w).await?;
    ensure!((st.plan_epoch, st.kv_free_blocks) == (2, held.kv_free_blocks), "{st:?}");
    ensure!(step(&w, 1, 5, &[first], 2, 0).await?.is_ok(), "the kept sequence did not decode under epoch 2");
    ensure!(step(&w, 2, 0, &PROMPT, 1, 0).await? == Err(ErrorCode::FailedPrecondition), "epoch 1 accepted");

    // Epoch 3, same range, written (fenced) by an elected leader under its term: the executor is kept, and the
    // term frees the previous (term 0) sequences at once.
    let leader = registry.campaign("leader", Duration::from_secs(5)).await?;
    let term = leader.term();
    registry.write_plan(&Plan { term, ..plan(3, vec![stage(&w, "w", 0..4)]) }, PlanEpoch(2)).await?;
    node_where(&registry, "w", |r| r.plan_epoch_loaded == PlanEpoch(3)).await?;
    let st = status(&w).await?;
    ensure!((st.plan_epoch, st.term, st.kv_free_blocks) == (3, term, st.kv_total_blocks), "{st:?}");
    ensure!(step(&w, 1, 6, &[first], 3, term).await? == Err(ErrorCode::NotFound), "the old term's KV survived");
    ensure!(step(&w, 1, 6, &[first], 3, 0).await? == Err(ErrorCode::FailedPrecondition), "term 0 after a term");
    ensure!(step(&w, 3, 0, &PROMPT, 3, term).await?.is_ok());
    ensure!(status(&w).await?.kv_free_blocks == st.kv_total_blocks - 2);

    // Epoch 4 changes the range: a fresh load, with an empty cache.
    registry.write_plan(&plan(4, vec![stage(&w, "w", 0..2), stage(&w2, "w2", 2..4)]), PlanEpoch(3)).await?;
    for id in ["w", "w2"] {
        node_where(&registry, id, |r| r.plan_epoch_loaded == PlanEpoch(4)).await?;
    }
    let st = status(&w).await?;
    ensure!((st.layer_end, st.plan_epoch, st.kv_free_blocks) == (2, 4, st.kv_total_blocks), "{st:?}");
    ensure!(status(&w2).await?.term == term, "the plan's term reached w2");
    leader.resign().await?;
    w.shutdown().await?;
    w2.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_that_cannot_load_is_recorded_and_the_old_one_served() -> Result<()> {
    let model = common::tiny_model()?;
    let etcd = EtcdServer::start()?;
    let registry =
        EtcdRegistry::connect(&EtcdOptions::new(vec![etcd.endpoint()]), "loadfail", Duration::from_secs(5)).await?;
    let w = Worker::start_registered(registered_config(model.path(), "w"), registry.clone(), options(), "127.0.0.1:0")
        .await?;
    registry.write_plan(&plan(1, vec![stage(&w, "w", 0..4)]), PlanEpoch(0)).await?;
    let rec = node_where(&registry, "w", |r| r.plan_epoch_loaded == PlanEpoch(1)).await?;
    ensure!(rec.load_failed_epoch == PlanEpoch(0), "{rec:?}");

    // Epoch 2 asks for layers the model does not have: the load fails, the record says so, epoch 1 serves on.
    let bad = Plan { num_layers: 9, ..plan(2, vec![stage(&w, "w", 0..9)]) };
    registry.write_plan(&bad, PlanEpoch(1)).await?;
    let rec = node_where(&registry, "w", |r| r.load_failed_epoch == PlanEpoch(2)).await?;
    ensure!(rec.plan_epoch_loaded == PlanEpoch(1) && rec.state == NodeState::Ready, "{rec:?}");
    ensure!(step(&w, 1, 0, &PROMPT, 1, 0).await?.is_ok(), "epoch 1 stopped serving");
    ensure!(status(&w).await?.plan_epoch == 1);

    // A rollback plan with the old range loads (no reload needed) and leaves the failure on record.
    registry.write_plan(&plan(3, vec![stage(&w, "w", 0..4)]), PlanEpoch(2)).await?;
    let rec = node_where(&registry, "w", |r| r.plan_epoch_loaded == PlanEpoch(3)).await?;
    ensure!(rec.load_failed_epoch == PlanEpoch(2), "{rec:?}");
    ensure!(step(&w, 2, 0, &PROMPT, 3, 0).await?.is_ok());
    w.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_panic_takes_the_worker_out_until_a_plan_reloads_it() -> Result<()> {
    let model = common::tiny_model()?;
    let registry = EmbeddedRegistry::new("panic");
    // The testing hook: the executor panics on its second batch.
    let cfg = WorkerConfig { fault_panic_after_batches: Some(1), ..registered_config(model.path(), "w") };
    let w = Worker::start_registered(cfg, registry.clone(), options(), "127.0.0.1:0").await?;
    registry.write_plan(&plan(1, vec![stage(&w, "w", 0..4)]), PlanEpoch(0)).await?;
    node_where(&registry, "w", |r| r.plan_epoch_loaded == PlanEpoch(1)).await?;
    ensure!(stage_health(&w).await? == ServingStatus::Serving);
    ensure!(step(&w, 1, 0, &PROMPT, 1, 0).await?.is_ok());

    // The panic: the batch it hit and every later one are UNAVAILABLE (retryable), never INTERNAL.
    for seq in [2, 3] {
        ensure!(step(&w, seq, 0, &PROMPT, 1, 0).await? == Err(ErrorCode::Unavailable), "batch for seq {seq}");
    }
    health_becomes(&w, ServingStatus::NotServing).await?;
    let rec = node_where(&registry, "w", |r| r.state == NodeState::Failed).await?;
    ensure!(rec.plan_epoch_loaded == PlanEpoch(1), "{rec:?}");
    let mut c = common::client_at(w.local_addr()).await?;
    let release = c.release(pb::ReleaseRequest { seq_ids: vec![1], propagate: true, term: 0 }).await;
    ensure!(release.as_ref().is_err_and(|s| s.code() == tonic::Code::Unavailable), "{release:?}");

    // A new plan with the same range reloads (a fresh executor) and the node is READY again.
    registry.write_plan(&plan(2, vec![stage(&w, "w", 0..4)]), PlanEpoch(1)).await?;
    node_where(&registry, "w", |r| r.state == NodeState::Ready && r.plan_epoch_loaded == PlanEpoch(2)).await?;
    health_becomes(&w, ServingStatus::Serving).await?;
    ensure!(step(&w, 4, 0, &PROMPT, 2, 0).await?.is_ok(), "the fresh executor did not serve");
    w.shutdown().await?;
    Ok(())
}
