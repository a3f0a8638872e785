//! `strata plan`: what-if placement. Sizes the model as the coordinator does and runs the coordinator's own
//! placement over nodes given on the command line, so operators see how a model would split (or by how much it
//! does not fit) before they start anything.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use strata_coordinator::placement::{self, ModelShape, NodeCapacity, SizeOptions, context_limits};
use strata_engine::loader::ModelFiles;
use strata_engine::{FloatDtype, KvDtype, QuantDtype, parse_bytes};
use strata_membership::NodeState;
use strata_proto::NodeId;

/// Flags of `strata plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Model: a Hugging Face directory or a .gguf file (only its metadata is read).
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    /// The nodes, in pipeline order: each MEMORY[@SECONDS_PER_LAYER[/OFFLOADED_SECONDS_PER_LAYER[/HEAD_SECONDS]]],
    /// comma-separated, e.g. `4Gi,4Gi,2Gi` or `4Gi@0.002,2Gi@0.004/0.02/0.01` (memory as a stage worker's
    /// --memory-limit; speeds as its record's layer_seconds, offload_layer_seconds and head_seconds: equal when
    /// left out, a node without an offloaded speed does not offload, and without a head time the last stage
    /// gets its proportional share).
    #[arg(long)]
    nodes: String,
    /// The coordinator's --max-model-len (default: the model's context).
    #[arg(long, env = "STRATA_MAX_MODEL_LEN")]
    max_model_len: Option<usize>,
    /// The coordinator's --min-kv-tokens (default: --max-model-len).
    #[arg(long, env = "STRATA_MIN_KV_TOKENS")]
    min_kv_tokens: Option<u64>,
    /// The coordinator's --max-batch-tokens.
    #[arg(long, env = "STRATA_MAX_BATCH_TOKENS", default_value_t = 512)]
    max_batch_tokens: usize,
    /// The workers' --dtype: the type float weights are stored in (default: as in the file).
    #[arg(long, env = "STRATA_DTYPE")]
    dtype: Option<FloatDtype>,
    /// The coordinator's --quantize: float weights quantized at load (q8_0, q4_0 or q4_1).
    #[arg(long, env = "STRATA_QUANTIZE", conflicts_with = "dtype")]
    quantize: Option<QuantDtype>,
    /// The coordinator's --kv-dtype: KV cache element type (f32, f16, bf16 or q8_0).
    #[arg(long, env = "STRATA_KV_DTYPE", default_value = "f32")]
    kv_dtype: KvDtype,
    /// Output: a table, or one JSON object.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Table,
    Json,
}

/// One stage of the what-if plan.
#[derive(Debug, Serialize)]
struct StageReport {
    node: String,
    memory_bytes: u64,
    layer_start: usize,
    layer_end: usize,
    offloaded_layers: usize,
    weight_bytes: u64,
    overhead_bytes: u64,
    kv_tokens: u64,
}

/// The whole answer.
#[derive(Debug, Serialize)]
struct PlanReport {
    model: String,
    num_layers: usize,
    max_model_len: usize,
    min_kv_tokens: u64,
    fits: bool,
    error: Option<String>,
    stages: Vec<StageReport>,
}

/// Runs `strata plan`; exits non-zero when the model does not fit.
pub fn run(a: PlanArgs) -> Result<()> {
    let report = what_if(&a)?;
    match a.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Table => print_table(&report),
    }
    if let Some(e) = &report.error {
        bail!("{e}");
    }
    Ok(())
}

fn what_if(a: &PlanArgs) -> Result<PlanReport> {
    let files = ModelFiles::open(&a.model).with_context(|| format!("opening model {}", a.model.display()))?;
    let (max_model_len, min_kv_tokens) =
        context_limits(a.max_model_len, a.min_kv_tokens, files.config().max_position_embeddings)?;
    let opts = SizeOptions {
        min_kv_tokens,
        max_batch_tokens: a.max_batch_tokens,
        weights: a.quantize.map(QuantDtype::to_engine).or(a.dtype.map(FloatDtype::to_engine)),
        kv_dtype: a.kv_dtype,
    };
    let shape = ModelShape::from_model_path(&a.model, &opts)?;
    let nodes = parse_nodes(&a.nodes)?;
    let mut report = PlanReport {
        model: a.model.display().to_string(),
        num_layers: shape.num_layers,
        max_model_len,
        min_kv_tokens,
        fits: false,
        error: None,
        stages: Vec::new(),
    };
    match placement::plan(&shape, &nodes) {
        Ok(stages) => {
            report.fits = true;
            let last_index = stages.len().saturating_sub(1);
            for (i, s) in stages.iter().enumerate() {
                let node = nodes.iter().find(|n| n.node_id == s.node_id).context("a stage on an unknown node")?;
                let (first, last) = (i == 0, i == last_index);
                let layers = (s.layer_end - s.layer_start) as u64;
                // Placement's own fixed cost, split into the weights it holds (embeddings, head) and the rest.
                let fixed = shape.stage_fixed_bytes(first, last);
                let end_weights = if first { shape.embed_bytes } else { 0 } + if last { shape.head_bytes } else { 0 };
                let weights = layers * shape.layer_bytes + end_weights;
                let overhead = fixed.saturating_sub(end_weights);
                // Offloaded layers hold no weights in memory but pass through two slots of a layer's size.
                let resident = layers - s.offloaded_layers as u64;
                let slots = if s.offloaded_layers > 0 { 2 * shape.layer_bytes } else { 0 };
                let free = node.memory_bytes.saturating_sub(resident * shape.layer_bytes + slots + fixed);
                let per_token = (layers * shape.kv_bytes_per_token_layer).max(1);
                report.stages.push(StageReport {
                    node: s.node_id.to_string(),
                    memory_bytes: node.memory_bytes,
                    layer_start: s.layer_start,
                    layer_end: s.layer_end,
                    offloaded_layers: s.offloaded_layers,
                    weight_bytes: weights,
                    overhead_bytes: overhead,
                    kv_tokens: free / per_token,
                });
            }
        }
        Err(e) => report.error = Some(e.to_string()),
    }
    Ok(report)
}

/// `MEMORY[@SECONDS[/OFFLOADED_SECONDS[/HEAD_SECONDS]]],...` as node capacities named `n0`, `n1`, … (placement orders nodes by id, so the names keep
/// the order given; ten or more nodes are zero-padded to keep it).
fn parse_nodes(spec: &str) -> Result<Vec<NodeCapacity>> {
    let items: Vec<&str> = spec.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if items.is_empty() {
        bail!("--nodes needs at least one MEMORY[@SECONDS_PER_LAYER]");
    }
    let width = items.len().saturating_sub(1).to_string().len();
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let seconds = |s: &str| s.trim().parse::<f64>().with_context(|| format!("node {item:?}: seconds"));
            let (mem, secs, offload, head) = match item.split_once('@') {
                Some((m, speeds)) => {
                    let parts: Vec<&str> = speeds.split('/').collect();
                    let at = |i: usize| parts.get(i).map_or(Ok(0.0), |s| seconds(s));
                    if parts.len() > 3 {
                        bail!("node {item:?}: at most SECONDS/OFFLOADED_SECONDS/HEAD_SECONDS after '@'");
                    }
                    (m, seconds(parts[0])?, at(1)?, at(2)?)
                }
                None => (*item, 1e-3, 0.0, 0.0),
            };
            let memory_bytes = parse_bytes(mem).with_context(|| format!("node {item:?}"))?;
            Ok(NodeCapacity {
                node_id: NodeId::new(format!("n{i:0width$}")),
                address: String::new(),
                memory_bytes,
                seconds_per_layer: secs,
                offload_seconds_per_layer: offload,
                head_seconds: head,
                state: NodeState::Ready,
            })
        })
        .collect()
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn print_table(r: &PlanReport) {
    println!(
        "model {} ({} layers), max model len {}, KV for {} tokens per stage",
        r.model, r.num_layers, r.max_model_len, r.min_kv_tokens
    );
    if let Some(e) = &r.error {
        println!("{e}");
        return;
    }
    println!(
        "{:<6} {:>11} {:>9} {:>9} {:>11} {:>11} {:>10}",
        "node", "memory", "layers", "offloaded", "weights", "overhead", "KV tokens"
    );
    for s in &r.stages {
        println!(
            "{:<6} {:>11} {:>9} {:>9} {:>11} {:>11} {:>10}",
            s.node,
            gib(s.memory_bytes),
            format!("{}..{}", s.layer_start, s.layer_end),
            s.offloaded_layers,
            gib(s.weight_bytes),
            gib(s.overhead_bytes),
            s.kv_tokens
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_keep_their_order_and_speeds() -> Result<()> {
        let nodes = parse_nodes("4Gi, 2Gi@0.5")?;
        assert_eq!(nodes.iter().map(|n| n.node_id.to_string()).collect::<Vec<_>>(), ["n0", "n1"]);
        assert_eq!((nodes[0].memory_bytes, nodes[1].memory_bytes), (4 << 30, 2 << 30));
        assert_eq!(nodes[1].seconds_per_layer, 0.5);
        assert_eq!((nodes[0].offload_seconds_per_layer, nodes[1].offload_seconds_per_layer), (0.0, 0.0));
        let offloading = parse_nodes("1Gi@0.5/2.5")?;
        assert_eq!((offloading[0].seconds_per_layer, offloading[0].offload_seconds_per_layer), (0.5, 2.5));
        assert!(parse_nodes("1Gi@0.5/").is_err());
        let head = parse_nodes("1Gi@0.5/0/0.25")?;
        assert_eq!((head[0].offload_seconds_per_layer, head[0].head_seconds), (0.0, 0.25));
        assert_eq!(offloading[0].head_seconds, 0.0);
        assert!(parse_nodes("1Gi@1/2/3/4").is_err());
        let many = parse_nodes(&["1Gi"; 11].join(","))?;
        assert_eq!((many[2].node_id.to_string(), many[10].node_id.to_string()), ("n02".into(), "n10".into()));
        assert!(parse_nodes("").is_err() && parse_nodes("4Qi").is_err() && parse_nodes("4Gi@fast").is_err());
        Ok(())
    }

    #[test]
    fn a_model_that_fits_nowhere_alone_splits_and_one_that_does_not_fit_says_by_how_much() -> Result<()> {
        let args = |nodes: &str| PlanArgs {
            model: "random:smollm2".into(),
            nodes: nodes.into(),
            max_model_len: Some(1024),
            min_kv_tokens: None,
            max_batch_tokens: 64,
            dtype: None,
            quantize: None,
            kv_dtype: KvDtype::F32,
            format: Format::Json,
        };
        // random:smollm2 is f32: ~650 MB of weights.
        let split = what_if(&args("300Mi,300Mi,300Mi"))?;
        assert!(split.fits && split.stages.len() == 3, "{split:?}");
        assert_eq!((split.stages[0].layer_start, split.stages[2].layer_end), (0, 30));
        for s in &split.stages {
            assert!(s.weight_bytes + s.overhead_bytes <= s.memory_bytes && s.kv_tokens >= 1024, "{s:?}");
        }
        // Quantized at load to q8_0 (~8.5 bits instead of 32) it fits one node.
        let q8 = what_if(&PlanArgs { quantize: Some(QuantDtype::Q8_0), ..args("300Mi") })?;
        assert!(q8.fits && q8.stages.len() == 1, "{q8:?}");
        // A q8_0 KV cache holds ~3.8x the tokens of f32 in the same room.
        let f32_kv = what_if(&args("400Mi,400Mi"))?;
        let q8_kv = what_if(&PlanArgs { kv_dtype: KvDtype::Q8_0, ..args("400Mi,400Mi") })?;
        assert!(q8_kv.stages[0].kv_tokens > 3 * f32_kv.stages[0].kv_tokens, "{f32_kv:?} vs {q8_kv:?}");
        let short = what_if(&args("300Mi,300Mi"))?;
        assert!(!short.fits && short.error.as_deref().is_some_and(|e| e.contains("GiB more needed")), "{short:?}");
        // Nodes that can offload take it, keeping their last layers paged in from the file.
        let offloading = what_if(&args("300Mi@0.001/0.004,300Mi@0.001/0.004"))?;
        assert!(offloading.fits && offloading.stages.len() == 2, "{offloading:?}");
        for s in &offloading.stages {
            let layers = s.layer_end - s.layer_start;
            assert!(s.offloaded_layers > 0 && s.offloaded_layers < layers && s.kv_tokens >= 1024, "{s:?}");
        }
        Ok(())
    }
}
