//! Placement: a pure function from the model's shape and the nodes' capacities to contiguous layer ranges.
//!
//! Usable nodes (READY, in `node_id` order) get layers in proportion to their speed (`1 / seconds_per_layer`),
//! capped by what fits in their memory: weights of the layers, a KV reservation per layer, what every stage holds
//! besides ([`ModelShape::stage_overhead_bytes`]), plus the embeddings on the first stage and the head and logits
//! on the last. A node whose share rounds to zero gets no stage. When the model does not fit resident, nodes that
//! can offload take more layers than fit, keeping the rest paged in from a slower tier, and the split minimises
//! the slowest stage counting offloaded layers at their measured speed (see `shares`).
//!
//! Replanning ([`plan_from`]) keeps the pipeline order of the plan in effect and inserts each new node where it
//! makes the fewest layers load, so a join or a departure moves as few layers as the balance allows.

use strata_proto::NodeId;

use strata_membership::NodeState;

mod shares;

use shares::{Room, apportion, most_layers, offload_shares, resident_shares};

pub use crate::sizing::{ModelShape, SizeOptions, context_limits};

/// What placement needs to know about one node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeCapacity {
    /// The node.
    pub node_id: NodeId,
    /// Its gRPC address.
    pub address: String,
    /// Memory available for weights and KV cache.
    pub memory_bytes: u64,
    /// Measured seconds to run one layer (smaller is faster).
    pub seconds_per_layer: f64,
    /// Measured seconds to run one offloaded layer (paged in from its file on a CPU, streamed from host memory
    /// on a GPU); 0 when the node cannot offload. Only used when the model does not fit resident.
    pub offload_seconds_per_layer: f64,
    /// Measured seconds the node spends on the head (final norm, logits) when it is the last stage; 0 when
    /// unknown. The last stage gets correspondingly fewer layers.
    pub head_seconds: f64,
    /// Membership state; only READY nodes are placed.
    pub state: NodeState,
}

/// One stage of a placement: a node and its half-open layer range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageAssignment {
    /// The node holding the stage.
    pub node_id: NodeId,
    /// Its gRPC address.
    pub address: String,
    /// First layer (inclusive).
    pub layer_start: usize,
    /// One past the last layer.
    pub layer_end: usize,
    /// How many of the stage's layers placement expects it to offload (its last ones; the worker decides from
    /// its own budget by the same rule).
    pub offloaded_layers: usize,
}

/// Why no placement exists.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    /// No node is READY.
    #[error("no READY node to place {num_layers} layers on")]
    NoUsableNodes {
        /// Layers to place.
        num_layers: usize,
    },
    /// The model has no layers.
    #[error("the model has no layers")]
    EmptyModel,
    /// A READY node reports a speed that cannot be used to balance.
    #[error("node {node_id} reports seconds_per_layer {seconds}, which must be finite and positive")]
    InvalidSpeed {
        /// The node.
        node_id: NodeId,
        /// What it reported.
        seconds: f64,
    },
    /// The usable nodes together cannot hold the model.
    #[error(
        "the model does not fit: {num_layers} layers needed, {fit} fit on {nodes} node(s); {} more needed ({shortfall_bytes} bytes; {layer_cost} bytes per layer incl. KV reservation)",
        gib(*shortfall_bytes)
    )]
    InsufficientMemory {
        /// Layers to place.
        num_layers: usize,
        /// Layers the nodes can hold.
        fit: usize,
        /// Usable nodes considered.
        nodes: usize,
        /// Memory missing, in bytes.
        shortfall_bytes: u64,
        /// Bytes one layer costs.
        layer_cost: u64,
    },
}

/// `bytes` in GiB, for messages.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Computes contiguous stages over the usable nodes (in `node_id` order), or says why the model does not fit.
pub fn plan(model: &ModelShape, nodes: &[NodeCapacity]) -> Result<Vec<StageAssignment>, PlacementError> {
    plan_from(model, nodes, &[])
}

/// Like [`plan`], moving as few layers as possible away from `current`, the stages of the plan in effect: its
/// nodes that are still usable keep their pipeline order, and every other usable node (in `node_id` order) is
/// inserted at the position where the fewest layers must load on any node (ties: the latest position, so the first
/// stage and its embeddings stay put when nothing is gained by moving them). Layer
/// counts still follow speed and memory; only the order, which decides where the boundaries fall, is chosen.
pub fn plan_from(
    model: &ModelShape,
    nodes: &[NodeCapacity],
    current: &[StageAssignment],
) -> Result<Vec<StageAssignment>, PlacementError> {
    let n = model.num_layers;
    if n == 0 {
        return Err(PlacementError::EmptyModel);
    }
    let mut usable: Vec<&NodeCapacity> = nodes.iter().filter(|c| c.state == NodeState::Ready).collect();
    usable.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    if usable.is_empty() {
        return Err(PlacementError::NoUsableNodes { num_layers: n });
    }
    if let Some(bad) = usable.iter().find(|c| !(c.seconds_per_layer.is_finite() && c.seconds_per_layer > 0.0)) {
        return Err(PlacementError::InvalidSpeed { node_id: bad.node_id.clone(), seconds: bad.seconds_per_layer });
    }
    let mut order: Vec<&NodeCapacity> =
        current.iter().filter_map(|s| usable.iter().find(|c| c.node_id == s.node_id).copied()).collect();
    let newcomers: Vec<&NodeCapacity> =
        usable.iter().filter(|c| !order.iter().any(|o| o.node_id == c.node_id)).copied().collect();
    if order.is_empty() {
        return place(model, newcomers);
    }
    for node in newcomers {
        let mut best: Option<(usize, Vec<&NodeCapacity>)> = None;
        for pos in 0..=order.len() {
            let mut candidate = order.clone();
            candidate.insert(pos, node);
            let Ok(stages) = place(model, candidate.clone()) else { continue };
            let cost = layers_to_load(current, &stages);
            if best.as_ref().is_none_or(|(c, _)| cost <= *c) {
                best = Some((cost, candidate));
            }
        }
        match best {
            Some((_, candidate)) => order = candidate,
            None => order.push(node),
        }
    }
    place(model, order)
}

/// Layers the nodes of `next` must load that they do not hold in `current`.
pub fn layers_to_load(current: &[StageAssignment], next: &[StageAssignment]) -> usize {
    next.iter()
        .map(|s| {
            let held = current.iter().find(|c| c.node_id == s.node_id).map_or(0..0, |c| c.layer_start..c.layer_end);
            let kept = s.layer_end.min(held.end).saturating_sub(s.layer_start.max(held.start));
            (s.layer_end - s.layer_start) - kept
        })
        .sum()
}

/// Places the model on `usable` in this pipeline order.
fn place(model: &ModelShape, mut usable: Vec<&NodeCapacity>) -> Result<Vec<StageAssignment>, PlacementError> {
    let n = model.num_layers;
    // The first and last nodes carry extras; if either ends up with no layers the extras move on, so drop
    // it and place again. Every round removes a node, so this terminates.
    loop {
        let k = usable.len();
        let rooms: Vec<Room> = usable
            .iter()
            .enumerate()
            .map(|(i, c)| Room {
                memory: c.memory_bytes,
                fixed: model.stage_fixed_bytes(i == 0, i == k - 1),
                layer_bytes: model.layer_bytes,
                kv_bytes: model.layer_cost().saturating_sub(model.layer_bytes),
                seconds: c.seconds_per_layer,
                offload_seconds: c.offload_seconds_per_layer,
                fixed_seconds: if i == k - 1 { c.head_seconds.max(0.0) } else { 0.0 },
            })
            .collect();
        let caps: Vec<usize> = rooms.iter().map(|r| r.resident_cap().min(n)).collect();
        let resident: usize = caps.iter().sum();
        let counts = if resident >= n && rooms.iter().any(|r| r.fixed_seconds > 0.0) {
            resident_shares(n, &rooms, &caps)
        } else if resident >= n {
            let weights: Vec<f64> = usable.iter().map(|c| 1.0 / c.seconds_per_layer).collect();
            Some(apportion(n, &weights, &caps))
        } else {
            offload_shares(n, &rooms)
        };
        let Some(counts) = counts else {
            let fit: usize = rooms.iter().map(|r| most_layers(r, n)).sum();
            let missing = n.saturating_sub(fit).max(1) as u64;
            return Err(PlacementError::InsufficientMemory {
                num_layers: n,
                fit,
                nodes: k,
                shortfall_bytes: missing.saturating_mul(model.layer_cost()),
                layer_cost: model.layer_cost(),
            });
        };
        let first_empty = counts.first().is_some_and(|&c| c == 0);
        let last_empty = counts.last().is_some_and(|&c| c == 0);
        if k > 1 && (first_empty || last_empty) {
            if first_empty {
                usable.remove(0);
            } else {
                usable.pop();
            }
            continue;
        }
        let mut start = 0;
        let mut stages = Vec::with_capacity(k);
        for ((node, room), count) in usable.iter().zip(&rooms).zip(counts) {
            if count == 0 {
                continue;
            }
            stages.push(StageAssignment {
                node_id: node.node_id.clone(),
                address: node.address.clone(),
                layer_start: start,
                layer_end: start + count,
                offloaded_layers: count - room.resident_of(count).unwrap_or(count),
            });
            start += count;
        }
        return Ok(stages);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use proptest::prelude::*;

    use super::*;

    fn shape(n: usize) -> ModelShape {
        ModelShape {
            num_layers: n,
            layer_bytes: 100,
            embed_bytes: 50,
            head_bytes: 70,
            kv_bytes_per_token_layer: 1,
            kv_reserve_tokens: 10,
            stage_overhead_bytes: 0,
            logits_bytes: 0,
        }
    }

    fn node(id: &str, memory: u64, secs: f64) -> NodeCapacity {
        NodeCapacity {
            node_id: NodeId::new(id),
            address: format!("{id}:1"),
            memory_bytes: memory,
            seconds_per_layer: secs,
            offload_seconds_per_layer: 0.0,
            head_seconds: 0.0,
            state: NodeState::Ready,
        }
    }

    fn offloading(id: &str, memory: u64, secs: f64, offload_secs: f64) -> NodeCapacity {
        NodeCapacity { offload_seconds_per_layer: offload_secs, ..node(id, memory, secs) }
    }

    /// A tiny Qwen2-shaped Hugging Face directory (`testing::tiny_config` with q/k/v biases, untied head, bf16
    /// matrices): hidden 64, MLP 96, q 64, kv 32, vocab 300.
    fn qwen_like(dir: &Path) -> anyhow::Result<std::path::PathBuf> {
        let mut config = strata_engine::testing::tiny_config();
        config.architecture = strata_engine::config::Architecture::Qwen2;
        config.attention_bias = true;
        let spec = strata_engine::testing::TinySpec { config, dtype: strata_engine::tensor::DType::BF16, seed: 3 };
        strata_engine::testing::write_hf(dir, &spec, &strata_engine::testing::random_weights(&spec))?;
        Ok(dir.to_path_buf())
    }

    /// Sizes computed by hand from each model's shape; the same numbers the per-tensor formula placement used
    /// before it went through the engine's layout module gave.
    #[test]
    fn model_sizes_come_from_the_engine_layout() -> anyhow::Result<()> {
        // Weights and KV only: the overheads are sizing's own test.
        let opts = SizeOptions { min_kv_tokens: 7, ..SizeOptions::default() };
        let sized = |p: &Path| -> anyhow::Result<ModelShape> {
            let got = ModelShape::from_model_path(p, &opts)?;
            Ok(ModelShape { stage_overhead_bytes: 0, logits_bytes: 0, ..got })
        };
        let shape = |layers, layer, embed, head, kv| ModelShape {
            num_layers: layers,
            layer_bytes: layer,
            embed_bytes: embed,
            head_bytes: head,
            kv_bytes_per_token_layer: kv,
            kv_reserve_tokens: 7,
            stage_overhead_bytes: 0,
            logits_bytes: 0,
        };
        // SmolLM2-135M Q4_1 GGUF: hidden 576, MLP 1536, q 576, kv 192; Q4_1 layers (20 bytes per 32), a Q8_0
        // embedding table (34 per 32) of 49152 × 576 that the tied head reuses, f32 norms and KV.
        let q4_1 = |n: u64| n / 32 * 20;
        let smol_layer = q4_1(2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576) + 2 * 576 * 4;
        let smol_embed = 49152 * 576 / 32 * 34;
        let expected = shape(30, smol_layer, smol_embed, 576 * 4 + smol_embed, 2 * 192 * 4);
        assert_eq!(sized(&strata_testkit::smollm2())?, expected);
        // The same shape as f32 synthetic weights.
        let layer = (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576 + 2 * 576) * 4;
        let expected = shape(30, layer, 49152 * 576 * 4, (576 + 49152 * 576) * 4, 2 * 192 * 4);
        assert_eq!(sized(Path::new("random:smollm2"))?, expected);
        // random:tiny in bf16, untied: hidden 128, MLP 256, q 128, kv 64, vocab 512.
        let layer = (2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128) * 2 + 2 * 128 * 4;
        let expected = shape(4, layer, 512 * 128 * 2, 128 * 4 + 512 * 128 * 2, 2 * 64 * 4);
        assert_eq!(sized(Path::new("random:tiny:bf16"))?, expected);
        // A Qwen2-shaped safetensors directory: its q/k/v biases count with the norms.
        let dir = tempfile::tempdir()?;
        let layer = (2 * 64 * 64 + 2 * 32 * 64 + 3 * 96 * 64) * 2 + (2 * 64 + 64 + 2 * 32) * 4;
        let expected = shape(4, layer, 300 * 64 * 2, 64 * 4 + 300 * 64 * 2, 2 * 32 * 4);
        assert_eq!(sized(&qwen_like(dir.path())?)?, expected);
        Ok(())
    }

    fn check_invariants(m: &ModelShape, nodes: &[NodeCapacity], stages: &[StageAssignment]) {
        assert!(!stages.is_empty());
        assert_eq!(stages[0].layer_start, 0);
        assert_eq!(stages[stages.len() - 1].layer_end, m.num_layers);
        for w in stages.windows(2) {
            assert_eq!(w[0].layer_end, w[1].layer_start, "contiguous");
            assert!(w[0].node_id < w[1].node_id, "stable node order");
        }
        for s in stages {
            assert!(s.layer_start < s.layer_end, "no empty stage");
            let node = nodes.iter().find(|c| c.node_id == s.node_id).expect("stage on a known node");
            assert_eq!(node.state, NodeState::Ready);
            let extras = m.stage_fixed_bytes(s.layer_start == 0, s.layer_end == m.num_layers);
            let layers = (s.layer_end - s.layer_start) as u64;
            let kv = m.layer_cost() - m.layer_bytes;
            let offloaded = s.offloaded_layers as u64;
            // Offloaded layers keep their KV and pass through two slots; their weights stay out of memory.
            let slots = if offloaded > 0 { 2 * m.layer_bytes } else { 0 };
            let used = extras + layers * kv + (layers - offloaded) * m.layer_bytes + slots;
            assert!(used <= node.memory_bytes, "{s:?} needs {used} > {}", node.memory_bytes);
            assert!(offloaded == 0 || node.offload_seconds_per_layer > 0.0, "{s:?} offloads on a node that cannot");
        }
    }

    #[test]
    fn the_last_stage_gives_up_layers_for_its_head() -> Result<(), PlacementError> {
        // Two equal nodes, 30 layers of 1 ms and a head of 8 ms: 19 + 11 layers make both stages 19 ms, where
        // 15 + 15 would leave the last at 23 ms.
        let m = shape(30);
        let head = |id, secs| NodeCapacity { head_seconds: secs, ..node(id, 1 << 40, 1e-3) };
        let stages = plan(&m, &[head("a", 8e-3), head("b", 8e-3)])?;
        let counts: Vec<usize> = stages.iter().map(|s| s.layer_end - s.layer_start).collect();
        assert_eq!(counts, [19, 11]);
        // Only the last node's head counts, and memory caps still hold: a node with room for 17 layers keeps 17.
        let small =
            NodeCapacity { memory_bytes: m.stage_fixed_bytes(true, false) + 17 * m.layer_cost(), ..head("a", 0.0) };
        let nodes = [small, head("b", 8e-3)];
        let capped = plan(&m, &nodes)?;
        check_invariants(&m, &nodes, &capped);
        let counts: Vec<usize> = capped.iter().map(|s| s.layer_end - s.layer_start).collect();
        assert_eq!(counts, [17, 13]);
        // A head slower than all the other layers together still leaves the last node a layer.
        let slow = plan(&m, &[head("a", 0.0), head("b", 0.0), head("c", 1.0)])?;
        let counts: Vec<usize> = slow.iter().map(|s| s.layer_end - s.layer_start).collect();
        assert_eq!(counts, [15, 14, 1]);
        // Without head times the split is the proportional one.
        let even = plan(&m, &[head("a", 0.0), head("b", 0.0)])?;
        assert_eq!(even.iter().map(|s| s.layer_end - s.layer_start).collect::<Vec<_>>(), [15, 15]);
        Ok(())
    }

    #[test]
    fn faster_node_gets_more_layers() {
        let m = shape(12);
        let nodes = [node("a", 1 << 30, 1.0), node("b", 1 << 30, 0.5)];
        let stages = plan(&m, &nodes).expect("fits");
        assert_eq!(stages.len(), 2);
        assert_eq!((stages[0].layer_end, stages[1].layer_end), (4, 12));
    }

    #[test]
    fn memory_caps_the_fast_node_and_the_rest_spills_over() {
        let m = shape(10);
        // "a" is fast but holds 2 layers besides the embeddings: 50 + 2 * 110 = 270.
        let nodes = [node("a", 270, 0.01), node("b", 1 << 30, 1.0)];
        let stages = plan(&m, &nodes).expect("fits");
        assert_eq!(stages[0].layer_end, 2);
        check_invariants(&m, &nodes, &stages);
    }

    #[test]
    fn not_ready_nodes_are_skipped_and_input_order_does_not_matter() {
        let m = shape(6);
        let mut draining = node("a", 1 << 30, 1.0);
        draining.state = NodeState::Draining;
        let mut cordoned = node("d", 1 << 30, 1.0);
        cordoned.state = NodeState::Cordoned;
        let nodes = [node("c", 1 << 30, 1.0), draining, node("b", 1 << 30, 1.0), cordoned];
        let stages = plan(&m, &nodes).expect("fits");
        let ids: Vec<&str> = stages.iter().map(|s| s.node_id.as_str()).collect();
        assert_eq!(ids, ["b", "c"]);
    }

    #[test]
    fn model_too_big_names_the_shortfall() {
        let m = shape(10);
        let nodes = [node("a", 500, 1.0), node("b", 500, 1.0)];
        let err = plan(&m, &nodes).expect_err("cannot fit");
        match &err {
            PlacementError::InsufficientMemory { fit, shortfall_bytes, .. } => {
                // (500 - 50) / 110 = 4 layers beside the embeddings, (500 - 70) / 110 = 3 beside the head.
                assert_eq!(*fit, 7);
                assert!(*shortfall_bytes > 0);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.to_string().contains("GiB more needed"), "{err}");
    }

    #[test]
    fn a_model_too_big_to_fit_resident_offloads_where_it_costs_least() -> Result<(), PlacementError> {
        let m = shape(10);
        // 500 bytes hold 4 layers beside the embeddings and 3 beside the head: 7 of 10 resident.
        let resident_only = [node("a", 500, 1.0), node("b", 500, 1.0)];
        assert!(plan(&m, &resident_only).is_err());
        // Both can offload at 4x the time: the three extra layers go where the slowest stage grows least.
        let both = [offloading("a", 500, 1.0, 4.0), offloading("b", 500, 1.0, 4.0)];
        let stages = plan(&m, &both)?;
        check_invariants(&m, &both, &stages);
        assert!(stages.iter().map(|s| s.offloaded_layers).sum::<usize>() > 0, "{stages:?}");
        // Only "b" can offload: it takes every layer "a" cannot hold.
        let only_b = [node("a", 500, 1.0), offloading("b", 500, 1.0, 4.0)];
        let stages = plan(&m, &only_b)?;
        check_invariants(&m, &only_b, &stages);
        assert_eq!((stages[0].layer_end, stages[0].offloaded_layers), (4, 0));
        assert!(stages[1].offloaded_layers > 0);
        // A model that fits resident offloads nothing, however cheap offload is.
        let roomy = [offloading("a", 1 << 30, 1.0, 1.0), offloading("b", 1 << 30, 1.0, 1.0)];
        assert!(plan(&m, &roomy)?.iter().all(|s| s.offloaded_layers == 0));
        // Not even the KV and slots fit: the error counts what offload could hold.
        let tiny = [offloading("a", 300, 1.0, 4.0), offloading("b", 300, 1.0, 4.0)];
        assert!(matches!(plan(&m, &tiny), Err(PlacementError::InsufficientMemory { .. })));
        Ok(())
    }

    #[test]
    fn slow_tiny_node_gets_nothing_and_extras_move_on() {
        let m = shape(4);
        // "a" cannot even hold the embeddings plus one layer; "b" and "c" take over.
        let nodes = [node("a", 100, 1.0), node("b", 1 << 30, 1.0), node("c", 1 << 30, 1.0)];
        let stages = plan(&m, &nodes).expect("fits");
        let ids: Vec<&str> = stages.iter().map(|s| s.node_id.as_str()).collect();
        assert_eq!(ids, ["b", "c"]);
        check_invariants(&m, &nodes, &stages);
    }

    #[test]
    fn errors_on_no_nodes_and_bad_speed() {
        let m = shape(4);
        assert!(matches!(plan(&m, &[]), Err(PlacementError::NoUsableNodes { .. })));
        assert!(matches!(plan(&m, &[node("a", 1 << 30, 0.0)]), Err(PlacementError::InvalidSpeed { .. })));
        assert!(matches!(plan(&shape(0), &[node("a", 1 << 30, 1.0)]), Err(PlacementError::EmptyModel)));
    }

    fn arb_nodes() -> impl Strategy<Value = Vec<NodeCapacity>> {
        prop::collection::vec((0u64..4000, 0.01f64..10.0, 0u8..5, 0f64..40.0), 1..8).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (mem, secs, st, offload))| {
                    // A third of the nodes cannot offload.
                    let offload = if offload < 13.0 { 0.0 } else { offload };
                    let mut c = offloading(&format!("n{:02}", (i * 7) % 11), mem, secs, offload);
                    c.state = if st == 0 { NodeState::Draining } else { NodeState::Ready };
                    c
                })
                .collect::<Vec<_>>()
        })
    }

    proptest! {
        #[test]
        fn ranges_are_contiguous_cover_every_layer_and_fit(n in 1usize..64, nodes in arb_nodes()) {
            let m = shape(n);
            let mut ids: Vec<_> = nodes.iter().map(|c| c.node_id.clone()).collect();
            ids.sort();
            ids.dedup();
            prop_assume!(ids.len() == nodes.len());
            match plan(&m, &nodes) {
                Ok(stages) => check_invariants(&m, &nodes, &stages),
                Err(PlacementError::InsufficientMemory { fit, .. }) => prop_assert!(fit < n),
                Err(PlacementError::NoUsableNodes { .. }) => {
                    prop_assert!(nodes.iter().all(|c| c.state != NodeState::Ready));
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        #[test]
        fn equal_nodes_differ_by_at_most_one_layer(n in 1usize..200, k in 1usize..12) {
            let m = shape(n);
            let nodes: Vec<_> = (0..k).map(|i| node(&format!("n{i:02}"), 1 << 40, 0.5)).collect();
            let stages = plan(&m, &nodes).map_err(|e| TestCaseError::fail(e.to_string()))?;
            check_invariants(&m, &nodes, &stages);
            prop_assert_eq!(stages.len(), n.min(k));
            let lens: Vec<usize> = stages.iter().map(|s| s.layer_end - s.layer_start).collect();
            let (lo, hi) = (lens.iter().min().copied().unwrap_or(0), lens.iter().max().copied().unwrap_or(0));
            prop_assert!(hi - lo <= 1, "{:?}", lens);
        }
    }

    #[test]
    fn a_joining_node_goes_where_the_fewest_layers_move() -> Result<(), PlacementError> {
        let big = 1 << 30;
        let three = [node("a", big, 1.0), node("b", big, 1.0), node("c", big, 1.0)];
        let current = plan(&shape(30), &three)?;
        let ranges = |s: &[StageAssignment]| -> Vec<(String, usize, usize)> {
            s.iter().map(|s| (s.node_id.to_string(), s.layer_start, s.layer_end)).collect()
        };
        assert_eq!(ranges(&current), [("a".into(), 0, 10), ("b".into(), 10, 20), ("c".into(), 20, 30)]);
        let four = [three[0].clone(), three[1].clone(), three[2].clone(), node("d", big, 1.0)];
        // From scratch d goes last (node id order) and 13 layers load; between b and c only 9 do.
        let fresh = plan(&shape(30), &four)?;
        assert_eq!(layers_to_load(&current, &fresh), 13);
        let next = plan_from(&shape(30), &four, &current)?;
        assert_eq!(
            ranges(&next),
            [("a".into(), 0, 8), ("b".into(), 8, 16), ("d".into(), 16, 23), ("c".into(), 23, 30)]
        );
        assert_eq!(layers_to_load(&current, &next), 9);
        // A departure keeps the survivors' order; a plan of nodes that are all gone is placed from scratch.
        let two = [three[0].clone(), three[2].clone()];
        assert_eq!(ranges(&plan_from(&shape(30), &two, &next)?), [("a".into(), 0, 15), ("c".into(), 15, 30)]);
        assert_eq!(plan_from(&shape(30), &four, &[])?, fresh);
        Ok(())
    }
}
