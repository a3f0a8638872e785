//! The coordinator's control loop: campaign for leadership, watch the nodes, place the model and write each new
//! plan with the next epoch; finish drains once the stages have loaded the plan that excludes the drained node.
//! Stages the pipeline could not reach ([`Suspect`]s), and workers that could not load the range a plan gave them,
//! are left out of placement for a while (or until they register again), so a crashed, hung or failing stage is
//! planned around at once, not only when its lease expires.
//!
//! Every plan carries the leader's term (its election's revision) and its write is fenced by it: a new leader
//! writes a plan under its own term first thing, even with unchanged stages, so the stages learn the term and
//! refuse the batches of the leader before; a deposed leader's write fails and it campaigns again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_proto::{NodeId, PlanEpoch, WireLayers, pb, wire_u32};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use strata_membership::{
    Backoff, EmbeddedRegistry, EtcdRegistry, Leadership, NodeEvent, NodeRecord, NodeState, Plan, PlanStage, Registry,
};

use crate::pipeline::{ModelInfo, Suspect, model_name};
use crate::placement::{self, ModelShape, NodeCapacity, StageAssignment};
use crate::serving::{Listeners, lead_and_serve};
use crate::{CoordinatorConfig, Error, Result};

/// What the coordinator currently knows, as the `ClusterStatus` RPC serves it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterSnapshot {
    /// Every registered node, sorted by id.
    pub nodes: Vec<NodeRecord>,
    /// The plan in effect, if one was written.
    pub plan: Option<Plan>,
    /// Whether this coordinator is the leader.
    pub leader: bool,
    /// Why the last placement attempt failed, if it did.
    pub placement_error: Option<String>,
}

impl ClusterSnapshot {
    /// The `ClusterStatusResponse` for this snapshot.
    pub fn to_proto(&self) -> pb::ClusterStatusResponse {
        let plan = self.plan.as_ref();
        let nodes = self
            .nodes
            .iter()
            .map(|n| {
                let stage = plan.and_then(|p| p.stage_of(&n.node_id));
                pb::NodeInfo {
                    node_id: n.node_id.to_string(),
                    address: n.address.clone(),
                    state: pb::NodeState::from(n.state) as i32,
                    device: n.device.clone(),
                    memory_bytes: n.memory_bytes,
                    layer_seconds: n.layer_seconds,
                    offload_layer_seconds: n.offload_layer_seconds,
                    head_seconds: n.head_seconds,
                    layer_start: stage.map_or(0, |s| s.layer_start),
                    layer_end: stage.map_or(0, |s| s.layer_end),
                    plan_epoch_loaded: n.plan_epoch_loaded.0,
                    ..Default::default()
                }
            })
            .collect();
        let stages = plan
            .map(|p| {
                p.stages
                    .iter()
                    .enumerate()
                    .map(|(i, s)| pb::StageInfo {
                        index: u32::try_from(i).unwrap_or(u32::MAX),
                        node_id: s.node_id.to_string(),
                        address: s.address.clone(),
                        layer_start: s.layer_start,
                        layer_end: s.layer_end,
                    })
                    .collect()
            })
            .unwrap_or_default();
        pb::ClusterStatusResponse {
            nodes,
            plan_epoch: plan.map_or(0, |p| p.epoch.0),
            stages,
            model: plan.map(|p| p.model.clone()).unwrap_or_default(),
            num_layers: plan.map_or(0, |p| p.num_layers),
        }
    }
}

/// A shared, observable [`ClusterSnapshot`]: the control loop publishes, readers take snapshots or wait.
#[derive(Clone, Debug)]
pub struct ClusterView {
    tx: Arc<watch::Sender<ClusterSnapshot>>,
}

impl Default for ClusterView {
    fn default() -> Self {
        Self::new()
    }
}

impl ClusterView {
    /// An empty view.
    pub fn new() -> Self {
        Self { tx: Arc::new(watch::Sender::new(ClusterSnapshot::default())) }
    }

    /// A view that starts at `snapshot` (e.g. a static plan, without a control loop).
    pub fn from_snapshot(snapshot: ClusterSnapshot) -> Self {
        Self { tx: Arc::new(watch::Sender::new(snapshot)) }
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> ClusterSnapshot {
        self.tx.borrow().clone()
    }

    /// A receiver notified on every change.
    pub fn subscribe(&self) -> watch::Receiver<ClusterSnapshot> {
        self.tx.subscribe()
    }

    /// Waits until `ready` holds for the snapshot and returns it.
    pub async fn wait_for(&self, mut ready: impl FnMut(&ClusterSnapshot) -> bool) -> ClusterSnapshot {
        let mut rx = self.tx.subscribe();
        match rx.wait_for(|s| ready(s)).await {
            Ok(s) => s.clone(),
            // The sender lives in `self`, so the channel cannot close while we wait.
            Err(_) => self.snapshot(),
        }
    }

    fn update(&self, change: impl FnOnce(&mut ClusterSnapshot)) {
        self.tx.send_modify(change);
    }
}

/// Starts a coordinator from its config and runs it until `shutdown`: opens the model, connects to etcd (or
/// starts the embedded registry), then leads or waits to lead, serving the gRPC API on `grpc_addr` and the
/// OpenAI-compatible HTTP API on `http_addr` meanwhile (generation goes through the current plan once all its
/// stages are READY), over TLS when `tls` is configured. Fails only at start (bad config or TLS files, unreadable
/// model, an address taken, etcd unreachable within `connect_timeout_ms`); later registry trouble is retried.
pub async fn run(config: CoordinatorConfig, shutdown: CancellationToken) -> Result<()> {
    config.validate()?;
    match config.etcd.clone() {
        Some(etcd) => {
            let registry = EtcdRegistry::connect(&etcd, &config.cluster, config.connect_timeout()).await?;
            run_with_registry(config, registry, shutdown).await
        }
        None => {
            tracing::info!("no etcd configured; using the embedded registry");
            let registry = EmbeddedRegistry::new(&config.cluster);
            run_with_registry(config, registry, shutdown).await
        }
    }
}

/// Like [`run`], with a registry the caller already holds (`strata local` shares one embedded registry between
/// the coordinator and its in-process workers); `config.etcd` is ignored. `grpc_addr` and `http_addr` are bound
/// here.
pub async fn run_with_registry<R: Registry>(
    config: CoordinatorConfig,
    registry: R,
    shutdown: CancellationToken,
) -> Result<()> {
    config.validate()?;
    let grpc = bind_api("gRPC", config.grpc_addr).await?;
    let http = bind_api("HTTP", config.http_addr).await?;
    serve_with_registry(config, registry, grpc, http, shutdown).await
}

/// Like [`run_with_registry`], serving the gRPC and HTTP APIs on listeners the caller has bound (to port 0, say:
/// nothing can take the port between choosing it and serving on it); `grpc_addr` and `http_addr` are not read.
pub async fn serve_with_registry<R: Registry>(
    config: CoordinatorConfig,
    registry: R,
    grpc: tokio::net::TcpListener,
    http: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<()> {
    config.validate()?;
    let model = ModelInfo::open(&config.model)?;
    let (context, min_kv_tokens) = config.context(model.context)?;
    let shape = ModelShape::from_model_path(&config.model, &config.size_options(min_kv_tokens))?;
    let model_name = config.model_name.clone().unwrap_or_else(|| model_name(&config.model));
    tracing::info!(
        model = %model_name,
        layers = shape.num_layers,
        layer_bytes = shape.layer_bytes,
        max_model_len = context,
        min_kv_tokens,
        "model sized"
    );
    let model = ModelInfo { name: model_name.clone(), context, ..model };
    let tls = config.tls()?;
    let options = config.pipeline_options(tls.clone());
    let grace = config.shutdown_grace();
    let listeners = Listeners { grpc, http, tls, keys: Arc::new(config.keys()), max_body_bytes: config.max_body_bytes };
    let coordinator = Coordinator::new(registry.clone(), config, shape, model_name);
    lead_and_serve(coordinator, registry, model, options, grace, listeners, shutdown).await
}

/// Binds the listener of `api` (`gRPC` or `HTTP`) on `addr`; a taken address is [`Error::Bind`], naming both.
pub async fn bind_api(api: &'static str, addr: std::net::SocketAddr) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Bind { api, addr, source })
}

/// Marks a node DRAINING (`strata nodes drain ID`): the leader replans without it and, once every stage of the
/// new plan reports that epoch loaded, marks it CORDONED (safe to remove).
pub async fn drain_node<R: Registry>(registry: &R, id: &NodeId) -> Result<NodeRecord> {
    Ok(registry.set_node_state(id, NodeState::Draining).await?)
}

/// Marks a node CORDONED: excluded from the next plan.
pub async fn cordon_node<R: Registry>(registry: &R, id: &NodeId) -> Result<NodeRecord> {
    Ok(registry.set_node_state(id, NodeState::Cordoned).await?)
}

/// Makes a cordoned or drained node schedulable again.
pub async fn uncordon_node<R: Registry>(registry: &R, id: &NodeId) -> Result<NodeRecord> {
    Ok(registry.set_node_state(id, NodeState::Ready).await?)
}

/// How a leadership term ended.
enum Term {
    Shutdown,
    Lost,
}

/// The control loop over one registry.
pub struct Coordinator<R: Registry> {
    registry: R,
    config: CoordinatorConfig,
    shape: ModelShape,
    model_name: String,
    view: ClusterView,
    suspects: Option<mpsc::Receiver<Suspect>>,
}

/// State of one leadership term.
struct LeaderState {
    nodes: BTreeMap<NodeId, NodeRecord>,
    plan: Option<Plan>,
    /// Draining nodes and the epoch whose loading completes their drain.
    pending_drains: BTreeMap<NodeId, PlanEpoch>,
    /// Nodes left out of placement because the pipeline could not reach them, and until when.
    suspects: BTreeMap<NodeId, Instant>,
    /// This leadership's term, written into every plan.
    leadership_term: u64,
    /// The stages of the last plan every stage loaded: where a plan that a stage cannot load rolls back to.
    last_good: Option<Vec<PlanStage>>,
    /// A placement a stage could not load; not written again until the nodes change.
    failed_target: Option<Vec<PlanStage>>,
}

/// What wakes the leader up.
enum Input {
    Node(Option<NodeEvent>),
    Suspect(Suspect),
    SuspicionOver,
}

impl<R: Registry> Coordinator<R> {
    /// A coordinator over `registry` for a model of `shape`.
    pub fn new(registry: R, config: CoordinatorConfig, shape: ModelShape, model_name: String) -> Self {
        Self { registry, config, shape, model_name, view: ClusterView::new(), suspects: None }
    }

    /// Plans around the stages reported on `suspects` (the pipeline's [`Suspect`]s).
    pub fn with_suspects(mut self, suspects: mpsc::Receiver<Suspect>) -> Self {
        self.suspects = Some(suspects);
        self
    }

    /// The view this coordinator publishes.
    pub fn view(&self) -> ClusterView {
        self.view.clone()
    }

    /// Campaigns, leads while elected, campaigns again when leadership is lost; returns on `shutdown`
    /// (resigning, so a standby takes over at once).
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<()> {
        let mut suspects = self.suspects.take();
        let candidate = self.config.candidate_name();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let campaign = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                c = self.registry.campaign(&candidate, self.config.lease_ttl()) => c,
            };
            let leadership = match campaign {
                Ok(l) => l,
                Err(e) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?delay, "campaign failed");
                    if sleep_or_shutdown(delay, &shutdown).await {
                        return Ok(());
                    }
                    continue;
                }
            };
            self.view.update(|s| s.leader = true);
            let outcome = self.lead(&leadership, &shutdown, &mut suspects).await;
            self.view.update(|s| s.leader = false);
            match outcome {
                Ok(Term::Shutdown) => {
                    if let Err(e) = leadership.resign().await {
                        tracing::warn!(error = %e, "resigning failed; the lease will expire instead");
                    }
                    return Ok(());
                }
                Ok(Term::Lost) => tracing::warn!(candidate, "lost leadership; campaigning again"),
                Err(e) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?delay, "leading failed; stepping down");
                    let _ = leadership.resign().await;
                    if sleep_or_shutdown(delay, &shutdown).await {
                        return Ok(());
                    }
                }
            }
        }
    }

    async fn lead(
        &self,
        leadership: &Leadership<R>,
        shutdown: &CancellationToken,
        suspects: &mut Option<mpsc::Receiver<Suspect>>,
    ) -> Result<Term> {
        let mut watch = self.registry.watch_nodes().await?;
        let mut term = LeaderState {
            nodes: watch.initial().iter().map(|n| (n.node_id.clone(), n.clone())).collect(),
            plan: self.registry.get_plan().await?,
            pending_drains: BTreeMap::new(),
            suspects: BTreeMap::new(),
            leadership_term: leadership.term(),
            last_good: None,
            failed_target: None,
        };
        tracing::info!(term = term.leadership_term, "leading");
        // Reports from before this term are about plans this leader did not serve.
        if let Some(rx) = suspects.as_mut() {
            while rx.try_recv().is_ok() {}
        }
        self.publish(&term);
        note_loaded(&mut term);
        if let Some(lost) = deposed(self.reconcile(&mut term).await)? {
            return Ok(lost);
        }
        loop {
            let expiry = term.suspects.values().min().copied();
            let input = tokio::select! {
                () = shutdown.cancelled() => return Ok(Term::Shutdown),
                () = leadership.lost() => return Ok(Term::Lost),
                e = watch.next() => Input::Node(e),
                Some(s) = next_suspect(suspects) => Input::Suspect(s),
                () = sleep_until(expiry), if expiry.is_some() => Input::SuspicionOver,
            };
            let event = match input {
                Input::Node(Some(event)) => event,
                Input::Node(None) => return Ok(Term::Lost),
                Input::Suspect(s) => {
                    if self.suspect(&mut term, s)
                        && let Some(lost) = deposed(self.reconcile(&mut term).await)?
                    {
                        return Ok(lost);
                    }
                    continue;
                }
                Input::SuspicionOver => {
                    let now = Instant::now();
                    term.suspects.retain(|id, until| {
                        let keep = *until > now;
                        if !keep {
                            tracing::info!(node = %id, "suspicion over: the node may be placed again");
                        }
                        keep
                    });
                    if let Some(lost) = deposed(self.reconcile(&mut term).await)? {
                        return Ok(lost);
                    }
                    continue;
                }
            };
            let replan = match event {
                NodeEvent::Added(rec) => {
                    // Registered again: whatever made it unreachable is over (a restart, a resumed process).
                    term.suspects.remove(&rec.node_id);
                    term.failed_target = None;
                    let ready = rec.state == NodeState::Ready;
                    term.nodes.insert(rec.node_id.clone(), rec);
                    ready
                }
                NodeEvent::Updated(rec) => {
                    let failed_load = term
                        .plan
                        .as_ref()
                        .is_some_and(|p| rec.load_failed_epoch == p.epoch && p.stage_of(&rec.node_id).is_some());
                    let prev = term.nodes.insert(rec.node_id.clone(), rec.clone());
                    if prev.as_ref().is_some_and(|p| p.state != rec.state) {
                        term.failed_target = None;
                    }
                    if failed_load && let Some(lost) = deposed(self.load_failed(&mut term, &rec).await)? {
                        return Ok(lost);
                    }
                    // Speed re-measurements alone do not move layers; membership and capacity changes do.
                    failed_load
                        || prev.is_none_or(|p| {
                            p.state != rec.state || p.address != rec.address || p.memory_bytes != rec.memory_bytes
                        })
                }
                NodeEvent::Removed(id) => {
                    term.failed_target = None;
                    term.nodes.remove(&id).is_some()
                }
            };
            note_loaded(&mut term);
            self.publish(&term);
            let done = if replan { self.reconcile(&mut term).await } else { self.finish_drains(&mut term).await };
            if let Some(lost) = deposed(done)? {
                return Ok(lost);
            }
        }
    }

    /// Leaves a stage the pipeline could not reach out of placement for the suspect period; returns whether that
    /// calls for a new plan (it is in the current one).
    fn suspect(&self, term: &mut LeaderState, s: Suspect) -> bool {
        if term.plan.as_ref().is_none_or(|p| p.stage_of(&s.node_id).is_none()) {
            return false;
        }
        let until = Instant::now() + self.config.suspect_for();
        if term.suspects.insert(s.node_id.clone(), until).is_none() {
            tracing::warn!(node = %s.node_id, epoch = s.epoch, reason = %s.reason, "stage unreachable: planning around it");
        }
        true
    }

    fn publish(&self, term: &LeaderState) {
        let nodes = term.nodes.values().cloned().collect();
        let plan = term.plan.clone();
        self.view.update(|s| {
            s.nodes = nodes;
            s.plan = plan;
        });
    }

    /// Places the model on the usable nodes and writes a new plan if it differs from the current one.
    async fn reconcile(&self, term: &mut LeaderState) -> Result<()> {
        // min_stages gates the first plan only: once a plan exists, a plan through a dead or drained node
        // serves nothing, so later changes replan with whatever is usable.
        let ready = term.nodes.values().filter(|n| n.state == NodeState::Ready).count();
        if term.plan.is_none() && ready < self.config.min_stages {
            tracing::info!(ready, min_stages = self.config.min_stages, "waiting for READY nodes");
            return self.finish_drains(term).await;
        }
        let capacities: Vec<NodeCapacity> = term
            .nodes
            .values()
            .map(|n| NodeCapacity {
                node_id: n.node_id.clone(),
                address: n.address.clone(),
                memory_bytes: n.memory_bytes,
                seconds_per_layer: n.layer_seconds,
                offload_seconds_per_layer: n.offload_layer_seconds,
                head_seconds: n.head_seconds,
                // A suspect is placed like a cordoned node: not at all.
                state: if term.suspects.contains_key(&n.node_id) { NodeState::Cordoned } else { n.state },
            })
            .collect();
        // Keep the current pipeline order and insert newcomers where the fewest layers move.
        let current: Vec<StageAssignment> = term.plan.as_ref().map_or_else(Vec::new, |p| {
            p.stages
                .iter()
                .map(|s| StageAssignment {
                    node_id: s.node_id.clone(),
                    address: s.address.clone(),
                    layer_start: s.layer_start as usize,
                    layer_end: s.layer_end as usize,
                    offloaded_layers: 0,
                })
                .collect()
        });
        let placed =
            placement::plan_from(&self.shape, &capacities, &current).map_err(Error::Placement).and_then(|stages| {
                stages.iter().map(plan_stage).collect::<Result<Vec<PlanStage>, _>>().map_err(Error::Wire)
            });
        let stages = match placed {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "no placement; keeping the current plan");
                self.view.update(|s| s.placement_error = Some(e.to_string()));
                return self.finish_drains(term).await;
            }
        };
        self.view.update(|s| s.placement_error = None);
        if term.failed_target.as_ref() == Some(&stages) {
            tracing::warn!(
                "a stage could not load this placement before; keeping the plan in effect until the nodes change"
            );
            return self.finish_drains(term).await;
        }
        self.write_stages(term, stages).await?;
        self.publish(term);
        self.finish_drains(term).await
    }

    /// A stage could not load its range of the current plan: roll back to the last plan every stage loaded (the
    /// failing worker still serves its range of it), and do not write the failed placement again until the nodes
    /// change. Without such a plan, the worker is planned around for the suspect period instead.
    async fn load_failed(&self, term: &mut LeaderState, rec: &NodeRecord) -> Result<()> {
        let target = term.plan.as_ref().map(|p| p.stages.clone());
        match term.last_good.clone() {
            Some(good) if target.as_ref() != Some(&good) => {
                tracing::warn!(
                    node = %rec.node_id,
                    epoch = %rec.load_failed_epoch,
                    "a stage could not load its layers: rolling back to the last plan every stage loaded"
                );
                term.failed_target = target;
                self.write_stages(term, good).await?;
                self.publish(term);
                Ok(())
            }
            _ => {
                let reason = format!("could not load its layers of plan epoch {}", rec.load_failed_epoch);
                let epoch = rec.load_failed_epoch.0;
                self.suspect(term, Suspect { node_id: rec.node_id.clone(), epoch, reason });
                Ok(())
            }
        }
    }

    /// Writes a plan of `stages` under this leader's term with the next epoch, unless the current plan is just that.
    async fn write_stages(&self, term: &mut LeaderState, stages: Vec<PlanStage>) -> Result<()> {
        for _ in 0..3 {
            // Same stages under this leader's term: nothing to write. A plan of an older term is rewritten as is,
            // so that the stages learn the new term.
            if term.plan.as_ref().is_some_and(|p| p.stages == stages && p.term == term.leadership_term) {
                break;
            }
            let expected = term.plan.as_ref().map_or(PlanEpoch(0), |p| p.epoch);
            let next = Plan {
                epoch: expected.next(),
                stages: stages.clone(),
                model: self.model_name.clone(),
                num_layers: wire_u32("layer count", self.shape.num_layers).map_err(Error::Wire)?,
                term: term.leadership_term,
                min_kv_tokens: self.shape.kv_reserve_tokens,
                max_batch_tokens: wire_u32("max batch tokens", self.config.max_batch_tokens).map_err(Error::Wire)?,
                quantize: self.config.quantize.map(|q| q.to_string()),
                kv_dtype: self.config.kv_dtype.map(|d| d.to_string()),
            };
            // Written at once: the pipeline keeps serving the old plan until every stage has loaded this one, then
            // recomputes the active sequences under it (serving::ready_plan; docs/architecture.md, plan epochs).
            match self.registry.write_plan(&next, expected).await {
                Ok(()) => {
                    tracing::info!(epoch = %next.epoch, term = next.term, stages = next.stages.len(), "plan written");
                    term.plan = Some(next);
                    break;
                }
                Err(strata_membership::Error::StaleEpoch { found, .. }) => {
                    tracing::warn!(expected = %expected, found = %found, "plan changed under us; re-reading");
                    term.plan = self.registry.get_plan().await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Tracks draining nodes that the current plan excludes, and marks them CORDONED once every stage of the
    /// plan reports its epoch loaded.
    async fn finish_drains(&self, term: &mut LeaderState) -> Result<()> {
        let epoch = term.plan.as_ref().map_or(PlanEpoch(0), |p| p.epoch);
        for n in term.nodes.values() {
            let placed = term.plan.as_ref().is_some_and(|p| p.stage_of(&n.node_id).is_some());
            if n.state == NodeState::Draining && !placed {
                term.pending_drains.entry(n.node_id.clone()).or_insert(epoch);
            }
        }
        let pending: Vec<(NodeId, PlanEpoch)> = term.pending_drains.iter().map(|(k, v)| (k.clone(), *v)).collect();
        for (id, needed) in pending {
            if term.nodes.get(&id).is_none_or(|n| n.state != NodeState::Draining) {
                term.pending_drains.remove(&id);
                continue;
            }
            let loaded = term.plan.as_ref().is_some_and(|p| {
                p.stages.iter().all(|s| term.nodes.get(&s.node_id).is_some_and(|n| n.plan_epoch_loaded >= needed))
            });
            if !loaded {
                continue;
            }
            match self
                .registry
                .update_node(&id, |r| {
                    if r.state == NodeState::Draining {
                        r.state = NodeState::Cordoned;
                    }
                })
                .await
            {
                Ok(rec) => {
                    tracing::info!(node = %id, epoch = %needed, "drain complete; node cordoned and removable");
                    term.nodes.insert(id.clone(), rec);
                }
                Err(strata_membership::Error::NodeNotFound(_)) => {
                    term.nodes.remove(&id);
                }
                Err(e) => return Err(e.into()),
            }
            term.pending_drains.remove(&id);
        }
        self.publish(term);
        Ok(())
    }
}

/// Remembers the current plan as the last good one once every stage is READY with it loaded.
fn note_loaded(term: &mut LeaderState) {
    let Some(plan) = &term.plan else { return };
    let loaded = plan.stages.iter().all(|s| {
        term.nodes.get(&s.node_id).is_some_and(|n| n.state == NodeState::Ready && n.plan_epoch_loaded >= plan.epoch)
    });
    if loaded && !plan.stages.is_empty() {
        term.last_good = Some(plan.stages.clone());
    }
}

/// `Ok(Some(Term::Lost))` when `result` says another coordinator leads now (a fenced plan write failed), so the
/// caller steps down instead of treating it as an error.
fn deposed(result: Result<()>) -> Result<Option<Term>> {
    match result {
        Ok(()) => Ok(None),
        Err(Error::Membership(strata_membership::Error::Deposed { term })) => {
            tracing::warn!(term, "deposed: another coordinator leads now");
            Ok(Some(Term::Lost))
        }
        Err(e) => Err(e),
    }
}

/// A placed stage as the plan stores it (the wire's `u32` layer indices, checked).
fn plan_stage(s: &StageAssignment) -> Result<PlanStage, strata_proto::ProtoError> {
    let layers = WireLayers::try_from(s.layer_start..s.layer_end)?;
    Ok(PlanStage {
        node_id: s.node_id.clone(),
        address: s.address.clone(),
        layer_start: layers.start,
        layer_end: layers.end,
    })
}

/// The next suspect the pipeline reports; never, without a channel.
async fn next_suspect(rx: &mut Option<mpsc::Receiver<Suspect>>) -> Option<Suspect> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`; forever when `None`.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

/// Sleeps for `delay`; returns true if `shutdown` fired first.
async fn sleep_or_shutdown(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => true,
        () = tokio::time::sleep(delay) => false,
    }
}
