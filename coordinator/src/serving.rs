//! Runs the control loop and the public APIs (gRPC and HTTP) together: the APIs are served from the start, and
//! the data path switches to each plan once every stage of it is READY and has loaded that plan's epoch. A leader
//! that loses its lease (etcd unreachable) keeps serving the plan it has: the stages fence off its batches as soon as
//! a newer leader's plan or batch reaches them (leadership terms), and only then does its pipeline stop serving, so
//! an etcd outage alone fails nothing.
//!
//! Shutdown is graceful: when `shutdown` fires the APIs stop accepting connections and the pipeline refuses new
//! requests, the ones in flight get the grace period to finish, and only then does the control loop stop (and
//! resign, so a standby takes over without waiting for the lease). Resigning first would let the standby's newer
//! term fence off the batches still in flight here.

use std::sync::Arc;
use std::time::Duration;

use strata_proto::{PlanEpoch, Tls};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::Result;
use crate::api::{self, CoordinatorApi, NodeAdmin};
use crate::auth::ApiKeys;
use crate::coordinator::{ClusterSnapshot, ClusterView, Coordinator};
use crate::http::{self, HttpState};
use crate::pipeline::{ModelInfo, Pipeline, PipelineOptions};
use strata_membership::{NodeState, Plan, Registry};

/// The bound listeners of the public APIs, and the TLS they serve (also used towards the stages).
pub(crate) struct Listeners {
    /// The gRPC API's.
    pub grpc: TcpListener,
    /// The HTTP API's.
    pub http: TcpListener,
    /// TLS for both APIs and the stage connections; `None`: plaintext.
    pub tls: Option<Tls>,
    /// The API keys both APIs require (none: open).
    pub keys: Arc<ApiKeys>,
    /// The HTTP API's body limit.
    pub max_body_bytes: usize,
}

/// Leads (or stands by) with `coordinator` until `shutdown` and the grace period after it, serving both APIs
/// meanwhile.
pub(crate) async fn lead_and_serve<R: Registry>(
    coordinator: Coordinator<R>,
    registry: R,
    model: ModelInfo,
    options: PipelineOptions,
    grace: Duration,
    listeners: Listeners,
    shutdown: CancellationToken,
) -> Result<()> {
    // Not a child of `shutdown`: the pipeline and the control loop outlive it by the grace period.
    let stop = CancellationToken::new();
    let (suspects_tx, suspects_rx) = mpsc::channel(SUSPECTS_BUFFER);
    let coordinator = coordinator.with_suspects(suspects_rx);
    let view = coordinator.view();
    let empty = no_plan(&model.name);
    let Listeners { grpc, http, tls, keys, max_body_bytes } = listeners;
    let options = PipelineOptions { tls: tls.clone(), suspects: Some(suspects_tx), ..options };
    let pipeline = Arc::new(Pipeline::start_with(model, empty, options, stop.clone())?);
    tokio::spawn(follow_ready_plans(view.clone(), pipeline.clone(), stop.clone()));
    tokio::spawn(graceful_stop(pipeline.clone(), grace, shutdown.clone(), stop.clone()));
    let admin: Arc<dyn NodeAdmin> = Arc::new(registry);
    let state = HttpState::new(pipeline.clone()).with_keys(keys.clone()).with_max_body_bytes(max_body_bytes);
    let http = tokio::spawn(http::serve(http, state, tls.clone(), shutdown.clone()));
    let api = CoordinatorApi::new(pipeline, view, Some(admin)).with_keys(keys);
    let grpc = tokio::spawn(api::serve(grpc, api, tls, shutdown.clone()));
    let result = coordinator.run(stop.clone()).await;
    stop.cancel();
    for (name, server) in [("gRPC", grpc), ("HTTP", http)] {
        match server.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the {name} API server failed"),
            Err(e) => tracing::warn!(error = %e, "the {name} API server task failed"),
        }
    }
    result
}

/// Suspects reported by the pipeline, waiting for the control loop.
const SUSPECTS_BUFFER: usize = 64;

/// The plan of a coordinator that serves nothing (standing by, or deposed).
fn no_plan(model: &str) -> Plan {
    Plan { model: model.to_owned(), ..Plan::default() }
}

/// On `shutdown`: the pipeline refuses new requests and the ones in flight get `grace` to finish; then `stop`.
async fn graceful_stop(pipeline: Arc<Pipeline>, grace: Duration, shutdown: CancellationToken, stop: CancellationToken) {
    tokio::select! {
        () = stop.cancelled() => return,
        () = shutdown.cancelled() => {}
    }
    tracing::info!(?grace, "shutting down: refusing new requests, finishing the ones in flight");
    match tokio::time::timeout(grace, pipeline.quiesce()).await {
        Ok(_) => tracing::info!("every request finished"),
        Err(_) => tracing::warn!(?grace, "grace period over; failing the requests still running"),
    }
    stop.cancel();
}

/// Hands the pipeline every new plan that is ready to serve while this coordinator leads.
async fn follow_ready_plans(view: ClusterView, pipeline: Arc<Pipeline>, stop: CancellationToken) {
    let mut rx = view.subscribe();
    let mut served: (PlanEpoch, u64) = (PlanEpoch(0), 0);
    loop {
        let ready = {
            let snapshot = rx.borrow_and_update();
            ready_plan(&snapshot)
        };
        if let Some(plan) = ready.filter(|p| (p.epoch, p.term) != served) {
            served = (plan.epoch, plan.term);
            tracing::info!(epoch = %plan.epoch, term = plan.term, stages = plan.stages.len(), "serving through the new plan");
            if pipeline.set_plan(plan).await.is_err() {
                return;
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            changed = rx.changed() => if changed.is_err() { return },
        }
    }
}

/// The plan to serve through: this coordinator leads, and every stage's node is READY with the plan loaded.
pub(crate) fn ready_plan(s: &ClusterSnapshot) -> Option<Plan> {
    let plan = s.plan.as_ref()?;
    let stage_ready = |node_id| {
        s.nodes
            .iter()
            .any(|n| &n.node_id == node_id && n.state == NodeState::Ready && n.plan_epoch_loaded >= plan.epoch)
    };
    (s.leader && !plan.stages.is_empty() && plan.stages.iter().all(|st| stage_ready(&st.node_id))).then(|| plan.clone())
}

#[cfg(test)]
mod tests {
    use strata_proto::NodeId;

    use super::*;
    use strata_membership::{NodeRecord, PlanStage};

    fn node(id: &str, state: NodeState, loaded: u64) -> NodeRecord {
        NodeRecord {
            node_id: NodeId::new(id),
            address: format!("{id}:7000"),
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            layer_seconds: 0.001,
            offload_layer_seconds: 0.0,
            head_seconds: 0.0,
            state,
            plan_epoch_loaded: PlanEpoch(loaded),
            load_failed_epoch: PlanEpoch(0),
        }
    }

    #[test]
    fn a_plan_is_served_once_every_stage_is_ready_and_loaded() {
        let stage = |id: &str, r: (u32, u32)| PlanStage {
            node_id: NodeId::new(id),
            address: format!("{id}:7000"),
            layer_start: r.0,
            layer_end: r.1,
        };
        let plan = Plan {
            epoch: PlanEpoch(2),
            stages: vec![stage("a", (0, 2)), stage("b", (2, 4))],
            model: "m".into(),
            num_layers: 4,
            ..Plan::default()
        };
        let mut s = ClusterSnapshot {
            nodes: vec![node("a", NodeState::Ready, 2), node("b", NodeState::Ready, 1)],
            plan: Some(plan.clone()),
            leader: true,
            placement_error: None,
        };
        assert_eq!(ready_plan(&s), None, "b has not loaded epoch 2");
        s.nodes[1].plan_epoch_loaded = PlanEpoch(2);
        assert_eq!(ready_plan(&s), Some(plan));
        s.nodes[1].state = NodeState::Joining;
        assert_eq!(ready_plan(&s), None, "b is not READY");
        s.nodes[1].state = NodeState::Ready;
        s.leader = false;
        assert_eq!(ready_plan(&s), None, "only the leader serves");
    }
}
