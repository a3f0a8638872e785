//! The coordinator's control loop against real etcd (and the embedded registry): plans, joins, drains,
//! leader failover, and a clear error when etcd cannot be reached.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use common::{EtcdServer, node, tiny_model};
use strata_coordinator::{ClusterSnapshot, ClusterView, Coordinator, CoordinatorConfig, Error, ModelShape, drain_node};
use strata_membership::{EmbeddedRegistry, EtcdOptions, NodeRegistration, NodeState, Registry};
use strata_proto::NodeId;
use tokio_util::sync::CancellationToken;

const LAYERS: usize = 8;
const WAIT: Duration = Duration::from_secs(10);

fn config(model: &std::path::Path, min_stages: usize, candidate: &str) -> CoordinatorConfig {
    let addr = |p| SocketAddr::from(([127, 0, 0, 1], p));
    let mut c = CoordinatorConfig::new(model, addr(0), addr(0));
    c.min_stages = min_stages;
    c.candidate = Some(candidate.into());
    c.lease_ttl_secs = 1;
    c.min_kv_tokens = Some(64);
    c
}

async fn wait(
    view: &ClusterView,
    what: &str,
    ready: impl FnMut(&ClusterSnapshot) -> bool,
) -> anyhow::Result<ClusterSnapshot> {
    tokio::time::timeout(WAIT, view.wait_for(ready)).await.with_context(|| format!("timed out waiting for {what}"))
}

fn epoch(s: &ClusterSnapshot) -> u64 {
    s.plan.as_ref().map_or(0, |p| p.epoch.0)
}

fn stage_ids(s: &ClusterSnapshot) -> Vec<String> {
    s.plan.as_ref().map(|p| p.stages.iter().map(|st| st.node_id.to_string()).collect()).unwrap_or_default()
}

/// Every stage of the current plan reports it loaded, as stage workers will.
async fn load_plan<R: Registry>(regs: &[NodeRegistration<R>], snap: &ClusterSnapshot) -> anyhow::Result<()> {
    let plan = snap.plan.as_ref().context("no plan")?;
    for r in regs.iter().filter(|r| plan.stage_of(r.node_id()).is_some()) {
        r.update(|rec| rec.plan_epoch_loaded = plan.epoch).await?;
    }
    Ok(())
}

async fn plan_join_and_drain<R: Registry>(reg: R) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let model = tiny_model(dir.path(), LAYERS)?;
    let cfg = config(&model, 3, "solo");
    let shape = ModelShape::from_model_path(&model, &cfg.size_options(64))?;
    ensure!(shape.num_layers == LAYERS && shape.layer_bytes > 0 && shape.embed_bytes > 0);
    let coordinator = Coordinator::new(reg.clone(), cfg, shape, "tiny-llama".into());
    let view = coordinator.view();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(coordinator.run(shutdown.clone()));

    let ttl = Duration::from_secs(5);
    let mut regs = Vec::new();
    for id in ["a", "b"] {
        regs.push(reg.register_node(node(id, NodeState::Ready), ttl).await?);
    }
    wait(&view, "two nodes seen", |s| s.leader && s.nodes.len() == 2).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(view.snapshot().plan.is_none(), "planned below min_stages");

    regs.push(reg.register_node(node("c", NodeState::Ready), ttl).await?);
    let s = wait(&view, "first plan", |s| epoch(s) == 1).await?;
    let plan = s.plan.as_ref().context("plan")?;
    ensure!(plan.covers_all_layers() && plan.num_layers as usize == LAYERS, "{plan:?}");
    ensure!(stage_ids(&s) == ["a", "b", "c"]);
    ensure!(reg.get_plan().await?.as_ref() == Some(plan), "view and store disagree");

    // A joining node gets layers only once READY.
    let d = reg.register_node(node("d", NodeState::Joining), ttl).await?;
    wait(&view, "d seen", |s| s.nodes.len() == 4).await?;
    ensure!(epoch(&view.snapshot()) == 1);
    d.update(|r| r.state = NodeState::Ready).await?;
    regs.push(d);
    let s = wait(&view, "plan with d", |s| epoch(s) == 2).await?;
    // Inserted where the fewest layers load (2 of 8), not appended (5 would).
    ensure!(stage_ids(&s) == ["a", "d", "b", "c"], "{:?}", stage_ids(&s));
    ensure!(s.plan.as_ref().is_some_and(|p| p.covers_all_layers()));
    load_plan(&regs, &s).await?;

    // Drain b: a plan without it, then CORDONED once every stage has loaded that plan.
    drain_node(&reg, &NodeId::new("b")).await?;
    let s = wait(&view, "plan without b", |s| epoch(s) == 3).await?;
    ensure!(stage_ids(&s) == ["a", "d", "c"], "{:?}", stage_ids(&s));
    ensure!(s.plan.as_ref().is_some_and(|p| p.covers_all_layers()));
    let b = reg.get_node(&NodeId::new("b")).await?.context("b")?;
    ensure!(b.state == NodeState::Draining, "b finished draining before the stages loaded epoch 3");
    load_plan(&regs, &s).await?;
    let cordoned =
        |s: &ClusterSnapshot| s.nodes.iter().any(|n| n.node_id.as_str() == "b" && n.state == NodeState::Cordoned);
    wait(&view, "b cordoned", cordoned).await?;
    ensure!(reg.get_node(&NodeId::new("b")).await?.is_some_and(|n| n.state == NodeState::Cordoned));
    ensure!(epoch(&view.snapshot()) == 3, "cordoning a node outside the plan must not replan");

    // A node in the plan dying (lease lost) also replans.
    let c = regs.remove(2);
    ensure!(c.node_id().as_str() == "c");
    c.deregister().await?;
    let s = wait(&view, "plan without c", |s| epoch(s) == 4).await?;
    ensure!(stage_ids(&s) == ["a", "d"], "{:?}", stage_ids(&s));

    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await??.map_err(anyhow::Error::from)?;
    ensure!(reg.leader().await?.is_none(), "shutdown must resign");
    Ok(())
}

#[tokio::test]
async fn etcd_plan_join_and_drain() -> anyhow::Result<()> {
    let server = EtcdServer::start()?;
    plan_join_and_drain(common::registry(&server, "flow").await?).await
}

#[tokio::test]
async fn embedded_plan_join_and_drain() -> anyhow::Result<()> {
    plan_join_and_drain(EmbeddedRegistry::new("flow")).await
}

#[tokio::test]
async fn two_coordinators_one_leader_and_failover() -> anyhow::Result<()> {
    let server = EtcdServer::start()?;
    let dir = tempfile::tempdir()?;
    let model = tiny_model(dir.path(), LAYERS)?;
    let reg = common::registry(&server, "ha").await?;
    let _nodes = [
        reg.register_node(node("a", NodeState::Ready), Duration::from_secs(5)).await?,
        reg.register_node(node("b", NodeState::Ready), Duration::from_secs(5)).await?,
    ];
    let mut running = Vec::new();
    for name in ["one", "two"] {
        let cfg = config(&model, 2, name);
        let shape = ModelShape::from_model_path(&model, &cfg.size_options(64))?;
        let c = Coordinator::new(common::registry(&server, "ha").await?, cfg, shape, "tiny".into());
        let (view, shutdown) = (c.view(), CancellationToken::new());
        let task = tokio::spawn(c.run(shutdown.clone()));
        running.push((name, view, shutdown, task));
    }
    let deadline = Instant::now() + WAIT;
    let leader = loop {
        let leaders: Vec<usize> = (0..2).filter(|&i| running[i].1.snapshot().leader).collect();
        if leaders.len() == 1 && epoch(&running[leaders[0]].1.snapshot()) == 1 {
            break leaders[0];
        }
        ensure!(leaders.len() <= 1, "two leaders");
        ensure!(Instant::now() < deadline, "no leader elected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ensure!(!running[1 - leader].1.snapshot().leader, "the standby took over while the leader lived");
    ensure!(reg.leader().await?.as_deref() == Some(running[leader].0));

    let (_, _, shutdown, task) = running.remove(leader);
    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await??.map_err(anyhow::Error::from)?;
    let (name, view, shutdown, task) = running.remove(0);
    let s = wait(&view, "standby takes over", |s| s.leader && s.plan.is_some()).await?;
    ensure!(epoch(&s) == 1, "same nodes, same plan: the new leader must not bump the epoch");
    ensure!(reg.leader().await?.as_deref() == Some(name));
    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await??.map_err(anyhow::Error::from)?;
    Ok(())
}

#[tokio::test]
async fn unreachable_etcd_is_a_clear_error_in_bounded_time() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let model = tiny_model(dir.path(), 2)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut cfg = config(&model, 1, "lonely");
    cfg.etcd = Some(EtcdOptions::new(vec![format!("http://127.0.0.1:{port}")]));
    cfg.connect_timeout_ms = 1500;
    let start = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(10), strata_coordinator::run(cfg, CancellationToken::new()))
        .await
        .context("run did not give up in bounded time")?;
    let elapsed = start.elapsed();
    match result {
        Err(Error::Membership(e @ strata_membership::Error::EtcdUnreachable { attempts, .. })) => {
            ensure!(attempts >= 2, "no retry: {e}");
            ensure!(e.to_string().contains(&port.to_string()), "error does not name the endpoint: {e}");
        }
        other => anyhow::bail!("expected EtcdUnreachable, got {other:?}"),
    }
    ensure!(elapsed >= Duration::from_millis(1000) && elapsed < Duration::from_secs(5), "gave up after {elapsed:?}");
    Ok(())
}

#[tokio::test]
async fn run_without_etcd_uses_the_embedded_registry_and_rejects_bad_config() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let model = tiny_model(dir.path(), 2)?;
    let mut bad = config(&model, 0, "x");
    bad.min_stages = 0;
    ensure!(matches!(strata_coordinator::run(bad, CancellationToken::new()).await, Err(Error::Config(_))));
    let missing = config(&dir.path().join("nope"), 1, "x");
    ensure!(matches!(strata_coordinator::run(missing, CancellationToken::new()).await, Err(Error::Model(_))));
    // An address already taken is a clear error naming the API and the address.
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut busy = config(&model, 1, "x");
    busy.http_addr = taken.local_addr()?;
    match strata_coordinator::run(busy, CancellationToken::new()).await {
        Err(e @ Error::Bind { api: "HTTP", addr, .. }) if addr == taken.local_addr()? => {
            ensure!(e.to_string().starts_with(&format!("cannot bind the HTTP API on {addr}")), "{e}");
        }
        other => anyhow::bail!("expected a bind error for the HTTP API, got {other:?}"),
    }

    let shutdown = CancellationToken::new();
    let task = tokio::spawn(strata_coordinator::run(config(&model, 1, "local"), shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(!task.is_finished(), "embedded coordinator exited early");
    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await??.map_err(anyhow::Error::from)?;
    Ok(())
}

#[tokio::test]
async fn etcd_outage_is_survived_and_watches_resume() -> anyhow::Result<()> {
    let mut server = EtcdServer::start()?;
    let dir = tempfile::tempdir()?;
    let model = tiny_model(dir.path(), LAYERS)?;
    let reg = common::registry(&server, "outage").await?;
    let cfg = config(&model, 1, "survivor");
    let shape = ModelShape::from_model_path(&model, &cfg.size_options(64))?;
    let coordinator = Coordinator::new(reg.clone(), cfg, shape, "tiny".into());
    let view = coordinator.view();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(coordinator.run(shutdown.clone()));
    let a = reg.register_node(node("a", NodeState::Ready), Duration::from_secs(5)).await?;
    wait(&view, "first plan", |s| epoch(s) == 1).await?;

    server.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ensure!(!task.is_finished(), "the coordinator exited while etcd was down");
    ensure!(epoch(&view.snapshot()) == 1, "the plan must survive the outage");
    server.restart()?;

    // The node's keep-alive and the coordinator's watch both recover: a node joining now is planned.
    let b = reg.register_node(node("b", NodeState::Ready), Duration::from_secs(5)).await?;
    let s = wait(&view, "plan with b after the outage", |s| epoch(s) >= 2 && stage_ids(s).contains(&"b".to_string()))
        .await?;
    ensure!(stage_ids(&s) == ["a", "b"], "{:?}", stage_ids(&s));
    ensure!(reg.get_node(a.node_id()).await?.is_some(), "a's registration was lost");
    drop(b);
    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await??.map_err(anyhow::Error::from)?;
    Ok(())
}

#[tokio::test]
async fn a_plan_a_stage_cannot_load_is_rolled_back_to_the_last_loaded_one() -> anyhow::Result<()> {
    let reg = EmbeddedRegistry::new("rollback");
    let dir = tempfile::tempdir()?;
    let model = tiny_model(dir.path(), LAYERS)?;
    let cfg = config(&model, 3, "solo");
    let shape = ModelShape::from_model_path(&model, &cfg.size_options(64))?;
    let coordinator = Coordinator::new(reg.clone(), cfg, shape, "tiny".into());
    let view = coordinator.view();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(coordinator.run(shutdown.clone()));
    let ttl = Duration::from_secs(5);
    let mut regs = Vec::new();
    for id in ["a", "b", "c"] {
        regs.push(reg.register_node(node(id, NodeState::Ready), ttl).await?);
    }
    let first = wait(&view, "first plan", |s| epoch(s) == 1).await?;
    load_plan(&regs, &first).await?;
    let loaded = |s: &ClusterSnapshot| s.nodes.iter().filter(|n| n.plan_epoch_loaded.0 == 1).count() == 3;
    wait(&view, "epoch 1 loaded", loaded).await?;

    // d joins; b cannot load its new range of epoch 2 (it keeps serving epoch 1's).
    regs.push(reg.register_node(node("d", NodeState::Ready), ttl).await?);
    let second = wait(&view, "plan with d", |s| epoch(s) == 2).await?;
    ensure!(stage_ids(&second).contains(&"d".to_owned()));
    regs[1].update(|r| r.load_failed_epoch = strata_proto::PlanEpoch(2)).await?;
    let third = wait(&view, "rollback", |s| epoch(s) == 3).await?;
    let stages = |s: &ClusterSnapshot| s.plan.as_ref().map(|p| p.stages.clone());
    ensure!(stages(&third) == stages(&first), "epoch 3 must be epoch 1's stages: {:?}", third.plan);
    // The placement that failed is not written again while the nodes stay as they are.
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(epoch(&view.snapshot()) == 3, "{:?}", view.snapshot().plan);
    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await??.map_err(anyhow::Error::from)?;
    Ok(())
}
