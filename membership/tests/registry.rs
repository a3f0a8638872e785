//! Registry semantics, one test body run against a real etcd and against the embedded registry.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use strata_membership::{
    EmbeddedRegistry, Error, EtcdRegistry, NodeEvent, NodeRecord, NodeState, NodeWatch, Plan, PlanStage, Registry,
};
use strata_proto::{NodeId, PlanEpoch};
use strata_testkit::EtcdServer;

const TTL: Duration = Duration::from_secs(1);
const WAIT: Duration = Duration::from_secs(5);

fn plan(epoch: u64, ids: &[&str]) -> Plan {
    fenced_plan(epoch, ids, 0)
}

/// A plan written under leadership `term` (0: unfenced).
fn fenced_plan(epoch: u64, ids: &[&str], term: u64) -> Plan {
    let stages = ids
        .iter()
        .enumerate()
        .map(|(i, id)| PlanStage {
            node_id: NodeId::new(*id),
            address: format!("{id}:1"),
            layer_start: i as u32,
            layer_end: i as u32 + 1,
        })
        .collect();
    Plan { epoch: PlanEpoch(epoch), stages, model: "m".into(), num_layers: ids.len() as u32, term, ..Plan::default() }
}

/// A node record: 1 GiB, 10 ms per layer, nothing loaded yet.
fn node(id: &str, state: NodeState) -> NodeRecord {
    NodeRecord {
        node_id: NodeId::new(id),
        address: format!("{id}.local:7000"),
        device: "cpu".into(),
        memory_bytes: 1 << 30,
        layer_seconds: 0.01,
        offload_layer_seconds: 0.0,
        head_seconds: 0.0,
        state,
        plan_epoch_loaded: PlanEpoch(0),
        load_failed_epoch: PlanEpoch(0),
    }
}

async fn next_event(watch: &mut NodeWatch) -> anyhow::Result<NodeEvent> {
    tokio::time::timeout(WAIT, watch.next()).await.context("no node event in time")?.context("watch ended")
}

async fn register_list_and_watch_events<R: Registry>(reg: R) -> anyhow::Result<()> {
    let a = reg.register_node(node("a", NodeState::Joining), Duration::from_secs(5)).await?;
    let mut watch = reg.watch_nodes().await?;
    ensure!(watch.initial() == [node("a", NodeState::Joining)], "initial {:?}", watch.initial());

    let b = reg.register_node(node("b", NodeState::Ready), Duration::from_secs(5)).await?;
    ensure!(next_event(&mut watch).await? == NodeEvent::Added(node("b", NodeState::Ready)));

    a.update(|r| r.state = NodeState::Ready).await?;
    ensure!(next_event(&mut watch).await? == NodeEvent::Updated(node("a", NodeState::Ready)));

    let listed = reg.list_nodes().await?;
    ensure!(listed == [node("a", NodeState::Ready), node("b", NodeState::Ready)], "listed {listed:?}");

    b.deregister().await?;
    ensure!(next_event(&mut watch).await? == NodeEvent::Removed(NodeId::new("b")));
    ensure!(reg.get_node(&NodeId::new("b")).await?.is_none());

    let missing = reg.set_node_state(&NodeId::new("zz"), NodeState::Draining).await;
    ensure!(matches!(missing, Err(Error::NodeNotFound(_))), "{missing:?}");
    a.deregister().await?;
    Ok(())
}

async fn lease_expiry_removes_node<R: Registry>(reg: R) -> anyhow::Result<()> {
    let kept = reg.register_node(node("kept", NodeState::Ready), TTL).await?;
    let gone = reg.register_node(node("gone", NodeState::Ready), TTL).await?;
    let mut watch = reg.watch_nodes().await?;
    gone.abandon(); // stops the keep-alive, as a crash would
    ensure!(next_event(&mut watch).await? == NodeEvent::Removed(NodeId::new("gone")));
    // The other registration's keep-alive held its 1 s lease through all of that.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ensure!(reg.list_nodes().await? == [node("kept", NodeState::Ready)]);
    kept.deregister().await?;
    Ok(())
}

async fn plan_cas_rejects_stale_epoch_and_watch_sees_newest<R: Registry>(reg: R) -> anyhow::Result<()> {
    ensure!(reg.get_plan().await?.is_none());
    let mut plans = reg.watch_plan().await?;
    reg.write_plan(&plan(1, &["a", "b"]), PlanEpoch(0)).await?;
    // A second writer that also read "no plan" loses.
    match reg.write_plan(&plan(1, &["c"]), PlanEpoch(0)).await {
        Err(Error::StaleEpoch { expected: PlanEpoch(0), found: PlanEpoch(1) }) => {}
        other => bail!("expected a stale-epoch rejection, got {other:?}"),
    }
    ensure!(matches!(reg.write_plan(&plan(3, &["a"]), PlanEpoch(1)).await, Err(Error::EpochNotNext { .. })));
    reg.write_plan(&plan(2, &["a", "b", "c"]), PlanEpoch(1)).await?;
    ensure!(matches!(reg.write_plan(&plan(2, &["a"]), PlanEpoch(1)).await, Err(Error::StaleEpoch { .. })));
    ensure!(reg.get_plan().await? == Some(plan(2, &["a", "b", "c"])));

    tokio::time::timeout(WAIT, plans.wait_for(|p| p.as_ref().is_some_and(|p| p.epoch == PlanEpoch(2))))
        .await
        .context("plan watch did not reach epoch 2")??;
    Ok(())
}

async fn one_leader_and_failover<R: Registry>(reg: R) -> anyhow::Result<()> {
    let first = reg.campaign("c1", TTL).await?;
    ensure!(reg.leader().await?.as_deref() == Some("c1"));
    let second = tokio::spawn({
        let reg = reg.clone();
        async move { reg.campaign("c2", TTL).await }
    });
    // c1's lease is kept alive, so c2 keeps waiting well past the TTL.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    ensure!(!second.is_finished(), "two leaders at once");
    ensure!(!first.is_lost());
    first.resign().await?;
    let second = tokio::time::timeout(WAIT, second).await.context("c2 not elected after resign")???;
    ensure!(reg.leader().await?.as_deref() == Some("c2"));

    // A leader that dies without resigning is replaced once its lease expires.
    drop(second);
    let third = tokio::time::timeout(WAIT, reg.campaign("c3", TTL)).await.context("c3 not elected")??;
    ensure!(reg.leader().await?.as_deref() == Some("c3"));
    third.resign().await?;
    Ok(())
}

async fn terms_grow_and_fence_plan_writes<R: Registry>(reg: R) -> anyhow::Result<()> {
    let first = reg.campaign("c1", TTL).await?;
    let t1 = first.term();
    ensure!(t1 > 0, "an election has a term");
    reg.write_plan(&fenced_plan(1, &["a"], t1), PlanEpoch(0)).await?;
    first.resign().await?;

    // With no leader at all, a write under the old term is fenced out.
    match reg.write_plan(&fenced_plan(2, &["a"], t1), PlanEpoch(1)).await {
        Err(Error::Deposed { term }) if term == t1 => {}
        other => bail!("expected Deposed with no leader key, got {other:?}"),
    }
    let second = reg.campaign("c2", TTL).await?;
    let t2 = second.term();
    ensure!(t2 > t1, "terms grow across elections: {t1} then {t2}");
    // The deposed leader read the right epoch: only the fence (checked in the same transaction) stops it.
    match reg.write_plan(&fenced_plan(2, &["old"], t1), PlanEpoch(1)).await {
        Err(Error::Deposed { term }) if term == t1 => {}
        other => bail!("expected the deposed leader's write to fail with Deposed, got {other:?}"),
    }
    ensure!(reg.get_plan().await?.map(|p| p.epoch) == Some(PlanEpoch(1)), "the deposed write landed");
    reg.write_plan(&fenced_plan(2, &["a", "b"], t2), PlanEpoch(1)).await?;
    // The current leader with a stale epoch is told StaleEpoch, not Deposed; a deposed one with a stale epoch
    // is told Deposed (it must stop, not replan).
    ensure!(
        matches!(reg.write_plan(&fenced_plan(2, &["a"], t2), PlanEpoch(1)).await, Err(Error::StaleEpoch { .. })),
        "stale epoch under the current term"
    );
    ensure!(
        matches!(reg.write_plan(&fenced_plan(2, &["a"], t1), PlanEpoch(1)).await, Err(Error::Deposed { .. })),
        "stale epoch under an old term"
    );
    // Term 0 writes are not fenced, as before terms existed.
    reg.write_plan(&plan(3, &["a"]), PlanEpoch(2)).await?;

    // A leader that dies without resigning is deposed once a new candidate wins after its lease expired.
    drop(second);
    let third = tokio::time::timeout(WAIT, reg.campaign("c3", TTL)).await.context("c3 not elected")??;
    ensure!(third.term() > t2, "terms grow: {t2} then {}", third.term());
    ensure!(matches!(reg.write_plan(&fenced_plan(4, &["a"], t2), PlanEpoch(3)).await, Err(Error::Deposed { .. })));
    reg.write_plan(&fenced_plan(4, &["c"], third.term()), PlanEpoch(3)).await?;
    ensure!(reg.get_plan().await? == Some(fenced_plan(4, &["c"], third.term())));
    third.resign().await?;
    Ok(())
}

macro_rules! on_both_registries {
    ($($name:ident),* $(,)?) => {
        mod etcd {
            $(
                #[tokio::test]
                async fn $name() -> anyhow::Result<()> {
                    let server = super::EtcdServer::start()?;
                    let etcd = strata_membership::EtcdOptions::new(vec![server.endpoint()]);
                    let registry = super::EtcdRegistry::connect(&etcd, "t", super::Duration::from_secs(5)).await?;
                    super::$name(registry).await
                }
            )*
        }
        mod embedded {
            $(
                #[tokio::test]
                async fn $name() -> anyhow::Result<()> {
                    super::$name(super::EmbeddedRegistry::new("t")).await
                }
            )*
        }
    };
}

on_both_registries!(
    register_list_and_watch_events,
    lease_expiry_removes_node,
    plan_cas_rejects_stale_epoch_and_watch_sees_newest,
    one_leader_and_failover,
    terms_grow_and_fence_plan_writes,
);

/// The same registry over a secured etcd: TLS with client certificates, a root user with auth enabled.
mod secured_etcd {
    use std::path::PathBuf;

    use strata_membership::{EtcdOptions, EtcdPassword, EtcdTls, EtcdUser};
    use strata_testkit::{EtcdSecurity, pki::Ca};

    use super::*;

    const PASSWORD: &str = "s3cret-pw";

    async fn connect(etcd: &EtcdOptions) -> strata_membership::Result<EtcdRegistry> {
        EtcdRegistry::connect(etcd, "t", Duration::from_secs(2)).await
    }

    fn tls_options(server: &EtcdServer, client_cert: bool) -> anyhow::Result<EtcdOptions> {
        let pki = server.pki().context("etcd without TLS")?;
        let cert = |path: &PathBuf| client_cert.then(|| path.clone());
        let tls = EtcdTls { ca: pki.ca.clone(), cert: cert(&pki.client_cert), key: cert(&pki.client_key) };
        Ok(EtcdOptions { tls: Some(tls), ..EtcdOptions::new(vec![server.endpoint()]) })
    }

    fn as_root(server: &EtcdServer, password: &str) -> EtcdOptions {
        let user = EtcdUser { name: "root".into(), password: EtcdPassword::new(password) };
        EtcdOptions { user: Some(user), ..EtcdOptions::new(vec![server.endpoint()]) }
    }

    /// The refusal's reason, or what came instead.
    fn refusal(result: strata_membership::Result<EtcdRegistry>) -> String {
        match result {
            Err(Error::EtcdRefused { reason, .. }) => reason,
            Err(e) => format!("not a refusal: {e}"),
            Ok(_) => "connected".into(),
        }
    }

    #[tokio::test]
    async fn tls_with_a_client_certificate_carries_leases_watches_and_plans() -> anyhow::Result<()> {
        let server = EtcdServer::start_secured("127.0.0.1", &EtcdSecurity { tls: true, root_password: None })?;
        let registry = connect(&tls_options(&server, true)?).await?;
        register_list_and_watch_events(registry.clone()).await?;
        plan_cas_rejects_stale_epoch_and_watch_sees_newest(registry).await
    }

    #[tokio::test]
    async fn tls_without_the_client_certificate_or_the_right_ca_is_refused_clearly() -> anyhow::Result<()> {
        let server = EtcdServer::start_secured("127.0.0.1", &EtcdSecurity { tls: true, root_password: None })?;
        let no_cert = refusal(connect(&tls_options(&server, false)?).await);
        ensure!(no_cert.contains("did not accept our client certificate"), "{no_cert}");

        let dir = tempfile::tempdir()?;
        let stranger = dir.path().join("stranger.crt");
        std::fs::write(&stranger, Ca::new("someone else's CA")?.cert)?;
        let mut wrong_ca = tls_options(&server, true)?;
        wrong_ca.tls.as_mut().context("tls")?.ca = stranger;
        let wrong_ca = refusal(connect(&wrong_ca).await);
        ensure!(wrong_ca.contains("does not chain to --etcd-ca"), "{wrong_ca}");

        // No CA for an https endpoint, or a CA for a plaintext one: refused before dialling.
        let no_ca = connect(&EtcdOptions::new(vec![server.endpoint()])).await;
        ensure!(matches!(&no_ca, Err(Error::EtcdTls(m)) if m.contains("--etcd-ca")), "{no_ca:?}");
        let mut plaintext = tls_options(&server, true)?;
        plaintext.endpoints = vec![server.endpoint().replace("https://", "http://")];
        let plaintext = connect(&plaintext).await;
        ensure!(matches!(&plaintext, Err(Error::EtcdTls(m)) if m.contains("plaintext")), "{plaintext:?}");
        Ok(())
    }

    #[tokio::test]
    async fn auth_takes_the_right_password_and_names_a_wrong_or_missing_one() -> anyhow::Result<()> {
        let security = EtcdSecurity { tls: false, root_password: Some(PASSWORD.into()) };
        let server = EtcdServer::start_secured("127.0.0.1", &security)?;
        let registry = connect(&as_root(&server, PASSWORD)).await?;
        register_list_and_watch_events(registry).await?;

        let wrong = refusal(connect(&as_root(&server, "guess")).await);
        ensure!(wrong.contains("wrong etcd user or password"), "{wrong}");
        let missing = refusal(connect(&EtcdOptions::new(vec![server.endpoint()])).await);
        ensure!(missing.contains("--etcd-user"), "{missing}");
        Ok(())
    }

    /// What the chart's hook runs after every install and upgrade: the first run enables auth, later ones only
    /// check the password.
    #[tokio::test]
    async fn enable_auth_turns_auth_on_once_and_then_only_checks_the_password() -> anyhow::Result<()> {
        let server = EtcdServer::start_secured("127.0.0.1", &EtcdSecurity { tls: true, root_password: None })?;
        let root = |password: &str| -> anyhow::Result<EtcdOptions> {
            let user = EtcdUser { name: "root".into(), password: EtcdPassword::new(password) };
            Ok(EtcdOptions { user: Some(user), ..tls_options(&server, true)? })
        };
        let wait = Duration::from_secs(2);
        ensure!(connect(&tls_options(&server, true)?).await.is_ok(), "auth is off at first");
        ensure!(EtcdRegistry::enable_auth(&root(PASSWORD)?, wait).await?, "the first run enables auth");
        ensure!(!EtcdRegistry::enable_auth(&root(PASSWORD)?, wait).await?, "the second finds it on");
        let anonymous = refusal(connect(&tls_options(&server, true)?).await);
        ensure!(anonymous.contains("--etcd-user"), "{anonymous}");
        register_list_and_watch_events(connect(&root(PASSWORD)?).await?).await?;
        let wrong = EtcdRegistry::enable_auth(&root("guess")?, wait).await;
        ensure!(matches!(&wrong, Err(Error::EtcdRefused { reason, .. }) if reason.contains("password")), "{wrong:?}");
        Ok(())
    }
}
