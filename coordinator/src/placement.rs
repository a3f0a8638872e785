//! Placement: a pure function from the model's shape and the nodes' capacities to contiguous layer ranges.
//!
//! Usable nodes (READY, in `node_id` order) get layers so that the slowest stage is as fast as it can be: a stage
//! takes `(layers + extra) × seconds_per_layer`, where the last stage's extra is the LM head's decode work in
//! layer equivalents (a 49k-token head is worth 8 SmolLM2 layers; ignoring it made the last stage the pipeline's
//! bottleneck). Each node is capped by what fits in its memory: weights of the layers, a KV reservation per
//! layer, plus the embeddings on the first stage and the head on the last. A node that gets no layer gets no stage.

use std::path::Path;

use strata_engine::loader::ModelFiles;
use strata_proto::NodeId;

use crate::membership::NodeState;

/// What placement needs to know about the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    /// Number of transformer layers.
    pub num_layers: usize,
    /// Weight bytes of one layer (the largest, if they differ).
    pub layer_bytes: u64,
    /// Bytes held only by the first stage (token embeddings).
    pub embed_bytes: u64,
    /// Bytes held only by the last stage (final norm and LM head).
    pub head_bytes: u64,
    /// Matrix weights of one layer (multiply-adds per token), to weigh the head's work against a layer's.
    pub layer_params: u64,
    /// Matrix weights of the LM head (multiply-adds per sampled token).
    pub head_params: u64,
    /// KV cache bytes one token takes in one layer.
    pub kv_bytes_per_token_layer: u64,
    /// Tokens of KV cache every stage must be able to hold.
    pub kv_reserve_tokens: u64,
}

impl ModelShape {
    /// Sizes a model from its files: real tensor byte sizes (quantized types included), f32 KV cache.
    pub fn from_model_path(path: &Path, kv_reserve_tokens: u64) -> crate::Result<Self> {
        let files = ModelFiles::open(path)?;
        let cfg = files.config().clone();
        let bytes = |name: &str| -> crate::Result<u64> { Ok(files.tensor(name)?.bytes.len() as u64) };
        let mut layer_bytes = 0u64;
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let mut sum = 0u64;
            for t in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] {
                sum += bytes(&format!("{p}.{t}.weight"))?;
            }
            for t in ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] {
                sum += bytes(&format!("{p}.{t}.weight"))?;
            }
            // Norms and biases are held as f32 vectors.
            let vectors = 2 * cfg.hidden_size + if cfg.attention_bias { cfg.q_dim() + 2 * cfg.kv_dim() } else { 0 };
            sum += 4 * vectors as u64;
            layer_bytes = layer_bytes.max(sum);
        }
        let embed_bytes = bytes("model.embed_tokens.weight")?;
        let untied = !cfg.tie_word_embeddings && files.contains("lm_head.weight");
        let head_bytes = 4 * cfg.hidden_size as u64 + if untied { bytes("lm_head.weight")? } else { embed_bytes };
        let (hidden, q, kv) = (cfg.hidden_size as u64, cfg.q_dim() as u64, cfg.kv_dim() as u64);
        let layer_params = hidden * (2 * q + 2 * kv) + 3 * hidden * cfg.intermediate_size as u64;
        Ok(ModelShape {
            num_layers: cfg.num_layers,
            layer_bytes,
            embed_bytes,
            head_bytes,
            layer_params,
            head_params: cfg.vocab_size as u64 * hidden,
            kv_bytes_per_token_layer: 2 * cfg.kv_dim() as u64 * 4,
            kv_reserve_tokens,
        })
    }

    /// The LM head's decode work in layers (it runs for every sampled token, on the last stage).
    pub fn head_layers(&self) -> f64 {
        if self.layer_params == 0 { 0.0 } else { self.head_params as f64 / self.layer_params as f64 }
    }

    /// Memory one layer costs on a node: weights plus its KV reservation.
    pub fn layer_cost(&self) -> u64 {
        self.layer_bytes.saturating_add(self.kv_bytes_per_token_layer.saturating_mul(self.kv_reserve_tokens))
    }
}

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
        "the model does not fit: {num_layers} layers needed, {fit} fit on {nodes} node(s); short by about {shortfall_bytes} bytes ({layer_cost} bytes per layer incl. KV reservation)"
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

/// Computes contiguous stages over the usable nodes, or says why the model does not fit.
pub fn plan(model: &ModelShape, nodes: &[NodeCapacity]) -> Result<Vec<StageAssignment>, PlacementError> {
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
    let (usable, counts) = place(model, usable)?;
    let mut start = 0;
    let mut stages = Vec::with_capacity(usable.len());
    for (node, count) in usable.iter().zip(counts) {
        if count == 0 {
            continue;
        }
        stages.push(StageAssignment {
            node_id: node.node_id.clone(),
            address: node.address.clone(),
            layer_start: start,
            layer_end: start + count,
        });
        start += count;
    }
    Ok(stages)
}

/// Layer counts for `usable`. The first and last nodes carry extras: an empty first node is dropped (the
/// embeddings move on); an empty last node is either dropped (the head moves on) or made to take one layer,
/// whichever leaves the faster bottleneck (on a tie, dropped: fewer hops). Every drop removes a node, so this
/// terminates.
fn place<'a>(
    model: &ModelShape,
    mut usable: Vec<&'a NodeCapacity>,
) -> Result<(Vec<&'a NodeCapacity>, Vec<usize>), PlacementError> {
    let n = model.num_layers;
    let k = usable.len();
    let caps: Vec<usize> = usable
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let first = if i == 0 { model.embed_bytes } else { 0 };
            let last = if i == k - 1 { model.head_bytes } else { 0 };
            layers_fitting(c.memory_bytes, first.saturating_add(last), model.layer_cost()).min(n)
        })
        .collect();
    let fit: usize = caps.iter().sum();
    if fit < n {
        let missing = (n - fit) as u64;
        return Err(PlacementError::InsufficientMemory {
            num_layers: n,
            fit,
            nodes: k,
            shortfall_bytes: missing.saturating_mul(model.layer_cost()),
            layer_cost: model.layer_cost(),
        });
    }
    let secs: Vec<f64> = usable.iter().map(|c| c.seconds_per_layer).collect();
    let counts = apportion(n, &secs, model.head_layers(), &caps, 0);
    if k > 1 && counts[0] == 0 {
        usable.remove(0);
        return place(model, usable);
    }
    if k > 1 && counts[k - 1] == 0 {
        let kept = (caps[k - 1] > 0)
            .then(|| apportion(n, &secs, model.head_layers(), &caps, 1))
            .filter(|c| c[0] > 0 && c.iter().sum::<usize>() == n);
        let dropped = place(model, usable[..k - 1].to_vec());
        return match (kept, dropped) {
            (Some(c), Ok((nodes, d))) => {
                let d_secs: Vec<f64> = nodes.iter().map(|c| c.seconds_per_layer).collect();
                if bottleneck(&c, &secs, model.head_layers()) < bottleneck(&d, &d_secs, model.head_layers()) {
                    Ok((usable, c))
                } else {
                    Ok((nodes, d))
                }
            }
            (Some(c), Err(_)) => Ok((usable, c)),
            (None, dropped) => dropped,
        };
    }
    Ok((usable, counts))
}

/// How long a stage takes with `layers`, the last one also running the head.
fn stage_time(i: usize, layers: usize, secs: &[f64], head: f64) -> f64 {
    (layers as f64 + if i + 1 == secs.len() { head } else { 0.0 }) * secs[i]
}

/// The slowest stage's time.
fn bottleneck(counts: &[usize], secs: &[f64], head: f64) -> f64 {
    counts.iter().enumerate().filter(|(_, c)| **c > 0).map(|(i, &c)| stage_time(i, c, secs, head)).fold(0.0, f64::max)
}

fn layers_fitting(memory: u64, extras: u64, layer_cost: u64) -> usize {
    let room = memory.saturating_sub(extras);
    if memory < extras {
        return 0;
    }
    if layer_cost == 0 {
        return usize::MAX;
    }
    usize::try_from(room / layer_cost).unwrap_or(usize::MAX)
}

/// Splits `n` layers so the slowest stage finishes soonest: layer by layer, each goes to the node whose stage
/// would then take least time ([`stage_time`]), within `caps`; the last node starts with `seed_last` layers. Ties
/// go to the earlier node, so equal nodes differ by at most one layer.
fn apportion(n: usize, secs: &[f64], head: f64, caps: &[usize], seed_last: usize) -> Vec<usize> {
    let k = secs.len();
    let mut counts = vec![0usize; k];
    counts[k - 1] = seed_last.min(caps[k - 1]).min(n);
    for _ in counts[k - 1]..n {
        let next = (0..k).filter(|&i| counts[i] < caps[i]).min_by(|&a, &b| {
            let (ta, tb) = (stage_time(a, counts[a] + 1, secs, head), stage_time(b, counts[b] + 1, secs, head));
            ta.total_cmp(&tb).then(a.cmp(&b))
        });
        match next {
            Some(i) => counts[i] += 1,
            None => break,
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn shape(n: usize) -> ModelShape {
        ModelShape {
            num_layers: n,
            layer_bytes: 100,
            embed_bytes: 50,
            head_bytes: 70,
            layer_params: 10,
            head_params: 0,
            kv_bytes_per_token_layer: 1,
            kv_reserve_tokens: 10,
        }
    }

    fn node(id: &str, memory: u64, secs: f64) -> NodeCapacity {
        NodeCapacity {
            node_id: NodeId::new(id),
            address: format!("{id}:1"),
            memory_bytes: memory,
            seconds_per_layer: secs,
            state: NodeState::Ready,
        }
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
            let extras = if s.layer_start == 0 { m.embed_bytes } else { 0 }
                + if s.layer_end == m.num_layers { m.head_bytes } else { 0 };
            let used = extras + (s.layer_end - s.layer_start) as u64 * m.layer_cost();
            assert!(used <= node.memory_bytes, "{s:?} needs {used} > {}", node.memory_bytes);
        }
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
    fn the_last_stage_gives_up_layers_for_the_head() {
        // SmolLM2-135M: the head (49152 x 576) is worth 8 layers of decode work.
        let m = ModelShape { num_layers: 30, layer_params: 3_538_944, head_params: 28_311_552, ..shape(30) };
        assert!((m.head_layers() - 8.0).abs() < 1e-9);
        let nodes = [node("a", 1 << 30, 1.0), node("b", 1 << 30, 1.0)];
        let stages = plan(&m, &nodes).expect("fits");
        assert_eq!((stages[0].layer_end, stages[1].layer_end), (19, 30), "19 layers | 11 layers + head");
        // Three nodes: 38 layer-equivalents, about 12.7 each.
        let nodes = [node("a", 1 << 30, 1.0), node("b", 1 << 30, 1.0), node("c", 1 << 30, 1.0)];
        let lens: Vec<usize> = plan(&m, &nodes).expect("fits").iter().map(|s| s.layer_end - s.layer_start).collect();
        assert_eq!(lens, vec![13, 13, 4]);
        // A head heavier than a whole share: the last stage keeps one layer and the head rather than hand the
        // head to a node with a full share (30 + 100); a third node would not lower the bottleneck (101), and
        // fewer stages mean fewer hops.
        let m = ModelShape { head_params: 100 * 3_538_944, ..m };
        let lens: Vec<usize> = plan(&m, &nodes).expect("fits").iter().map(|s| s.layer_end - s.layer_start).collect();
        assert_eq!(lens, vec![29, 1]);
        // But a last node far slower than the others is dropped: the head moves to a fast node.
        let nodes = [node("a", 1 << 30, 1.0), node("b", 1 << 30, 1.0), node("c", 1 << 30, 50.0)];
        let m = ModelShape { head_params: 8 * 3_538_944, ..m };
        let lens: Vec<usize> = plan(&m, &nodes).expect("fits").iter().map(|s| s.layer_end - s.layer_start).collect();
        assert_eq!(lens, vec![19, 11]);
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
        assert!(err.to_string().contains("short by"), "{err}");
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
        prop::collection::vec((0u64..4000, 0.01f64..10.0, 0u8..5), 1..8).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (mem, secs, st))| {
                    let mut c = node(&format!("n{:02}", (i * 7) % 11), mem, secs);
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
}
