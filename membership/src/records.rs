//! The records stored in the registry and the key layout they live under (see `docs/architecture.md`).

use serde::{Deserialize, Serialize};
use strata_proto::{NodeId, PlanEpoch, pb};

/// The registry's key layout for one cluster: everything lives under `/strata/<cluster>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// The layout for `cluster`.
    pub fn new(cluster: &str) -> Self {
        Self { root: format!("/strata/{cluster}/") }
    }

    /// Prefix of every node record: `/strata/<cluster>/nodes/`.
    pub fn nodes_prefix(&self) -> String {
        format!("{}nodes/", self.root)
    }

    /// One node's record: `/strata/<cluster>/nodes/<node_id>`.
    pub fn node(&self, id: &NodeId) -> String {
        format!("{}nodes/{id}", self.root)
    }

    /// The current plan: `/strata/<cluster>/plan`.
    pub fn plan(&self) -> String {
        format!("{}plan", self.root)
    }

    /// The coordinator leader's key: `/strata/<cluster>/leader`.
    pub fn leader(&self) -> String {
        format!("{}leader", self.root)
    }
}

/// A node's membership state, as stored (`"JOINING"`, `"READY"`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum NodeState {
    /// Registered, loading or being measured; not placed.
    Joining,
    /// Schedulable.
    Ready,
    /// Being taken out of the plan.
    Draining,
    /// Excluded from planning (also the end state of a drain: safe to remove).
    Cordoned,
    /// The worker's executor failed (it panicked): it answers batches with `UNAVAILABLE` and is not placed. A
    /// new plan that still assigns it layers reloads them and makes it READY again, and so does `UncordonNode`.
    Failed,
}

impl From<NodeState> for pb::NodeState {
    fn from(s: NodeState) -> Self {
        match s {
            NodeState::Joining => pb::NodeState::Joining,
            NodeState::Ready => pb::NodeState::Ready,
            NodeState::Draining => pb::NodeState::Draining,
            NodeState::Cordoned => pb::NodeState::Cordoned,
            NodeState::Failed => pb::NodeState::Failed,
        }
    }
}

/// A stage worker's record at `/strata/<cluster>/nodes/<node_id>`, attached to the worker's lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRecord {
    /// Stable node id (also the last key segment).
    pub node_id: NodeId,
    /// gRPC address (`host:port`) of the worker.
    pub address: String,
    /// Compute device, e.g. `cpu` or `cuda:0`.
    pub device: String,
    /// Memory available for weights and KV cache.
    pub memory_bytes: u64,
    /// Measured seconds to run one layer.
    pub layer_seconds: f64,
    /// Measured seconds to run one offloaded layer (paged in from the model file on a CPU, streamed from host
    /// memory on a GPU); 0 when unknown or the node cannot offload.
    #[serde(default)]
    pub offload_layer_seconds: f64,
    /// Measured seconds the last stage spends besides its layers on a batch (final norm, head and logits);
    /// placement gives the last stage fewer layers for it. 0 when unknown (records of older workers).
    #[serde(default)]
    pub head_seconds: f64,
    /// Membership state.
    pub state: NodeState,
    /// Epoch of the plan the worker has loaded (0: none).
    #[serde(default)]
    pub plan_epoch_loaded: PlanEpoch,
    /// The last plan epoch whose layers the worker could not load (0: none). Set when a load fails (the worker
    /// keeps serving `plan_epoch_loaded`), left as is by later successful loads: a failure is news while it is
    /// greater than `plan_epoch_loaded`, and the coordinator can roll back to a plan without the failed range.
    #[serde(default)]
    pub load_failed_epoch: PlanEpoch,
}

/// One stage of a stored plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanStage {
    /// The node holding the stage.
    pub node_id: NodeId,
    /// Its gRPC address.
    pub address: String,
    /// First layer (inclusive).
    pub layer_start: u32,
    /// One past the last layer.
    pub layer_end: u32,
}

/// The plan at `/strata/<cluster>/plan`: which node holds which layers, under which epoch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Generation of the plan; each new plan is exactly one more than the stored one.
    pub epoch: PlanEpoch,
    /// Stages in pipeline order; contiguous layer ranges covering `[0, num_layers)`.
    pub stages: Vec<PlanStage>,
    /// Name of the model served.
    pub model: String,
    /// Number of layers of the model.
    pub num_layers: u32,
    /// Leadership term of the coordinator that wrote it (the create revision of its election key; 0: written
    /// without an election, e.g. a static plan). A new leader writes a new plan under its term, and the write is
    /// fenced by it, so stages learn the term from the plan as well as from batches.
    #[serde(default)]
    pub term: u64,
    /// Tokens of KV cache every stage must hold (the coordinator's `--min-kv-tokens`); a stage that cannot
    /// fails its load. 0: no minimum (plans written before it existed).
    #[serde(default)]
    pub min_kv_tokens: u64,
    /// Most tokens the coordinator puts in one micro-batch: stages size their activation workspace for it.
    /// 0: the stage's default.
    #[serde(default)]
    pub max_batch_tokens: u32,
    /// Block format every stage quantizes float weights into as it loads (`q8_0`, `q4_0`, `q4_1`; the
    /// coordinator's `--quantize`), which placement sized the layers with. `None`: each worker's own setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize: Option<String>,
    /// Element type of every stage's KV cache (`f32`, `f16`, `bf16`, `q8_0`; the coordinator's `--kv-dtype`),
    /// which placement sized the KV reservation with. `None`: each worker's own setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_dtype: Option<String>,
}

impl Plan {
    /// The stage held by `node`, if any.
    pub fn stage_of(&self, node: &NodeId) -> Option<&PlanStage> {
        self.stages.iter().find(|s| &s.node_id == node)
    }

    /// Whether the layer ranges are contiguous and cover `[0, num_layers)` exactly once.
    pub fn covers_all_layers(&self) -> bool {
        let mut next = 0;
        for s in &self.stages {
            if s.layer_start != next || s.layer_end <= s.layer_start {
                return false;
            }
            next = s.layer_end;
        }
        next == self.num_layers
    }
}

/// A change in the set of registered nodes.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeEvent {
    /// A node registered.
    Added(NodeRecord),
    /// A registered node's record changed.
    Updated(NodeRecord),
    /// A node's record disappeared (deregistered, or its lease expired).
    Removed(NodeId),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_as_documented_json() -> Result<(), serde_json::Error> {
        let rec = NodeRecord {
            node_id: NodeId::new("gpu-a"),
            address: "10.0.0.1:7000".into(),
            device: "cuda:0".into(),
            memory_bytes: 80 << 30,
            layer_seconds: 0.002,
            offload_layer_seconds: 0.01,
            head_seconds: 0.004,
            state: NodeState::Ready,
            plan_epoch_loaded: PlanEpoch(3),
            load_failed_epoch: PlanEpoch(4),
        };
        let text = serde_json::to_string(&rec)?;
        assert!(text.contains(r#""state":"READY""#) && text.contains(r#""plan_epoch_loaded":3"#), "{text}");
        assert!(text.contains(r#""load_failed_epoch":4"#), "{text}");
        assert_eq!(serde_json::from_str::<NodeRecord>(&text)?, rec);
        assert!(serde_json::from_str::<NodeRecord>(&text.replace("READY", "SLEEPY")).is_err());
        let failed = serde_json::from_str::<NodeRecord>(&text.replace("READY", "FAILED"))?;
        assert_eq!(failed.state, NodeState::Failed);
        assert_eq!(pb::NodeState::from(failed.state), pb::NodeState::Failed);
        // Records written before the field existed read as "no failed load".
        let old = text.replace(r#","load_failed_epoch":4"#, "");
        assert_eq!(serde_json::from_str::<NodeRecord>(&old)?.load_failed_epoch, PlanEpoch(0));
        let old = text.replace(r#","offload_layer_seconds":0.01"#, "");
        assert_eq!(serde_json::from_str::<NodeRecord>(&old)?.offload_layer_seconds, 0.0);
        let old = text.replace(r#","head_seconds":0.004"#, "");
        assert_eq!(serde_json::from_str::<NodeRecord>(&old)?.head_seconds, 0.0);

        let plan = Plan {
            epoch: PlanEpoch(2),
            stages: vec![PlanStage { node_id: "a".into(), address: "a:1".into(), layer_start: 0, layer_end: 4 }],
            model: "m".into(),
            num_layers: 4,
            ..Plan::default()
        };
        let text = serde_json::to_string(&plan)?;
        assert_eq!(serde_json::from_str::<Plan>(&text)?, plan);
        assert!(plan.covers_all_layers());
        Ok(())
    }

    #[test]
    fn key_layout() {
        let k = Keys::new("prod");
        assert_eq!(k.node(&NodeId::new("a")), "/strata/prod/nodes/a");
        assert_eq!(k.nodes_prefix(), "/strata/prod/nodes/");
        assert_eq!(k.plan(), "/strata/prod/plan");
        assert_eq!(k.leader(), "/strata/prod/leader");
    }
}
