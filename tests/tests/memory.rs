//! The mission case: a model no single worker can hold, served by several, each within its memory limit.
//!
//! A random-weight Llama-shaped f16 model of ~300 MB is served by real `stage-worker` processes limited to
//! 180 MiB each (`--memory-limit`), so the plan must split it; their greedy tokens equal the single-process
//! engine's, `strata plan` agrees with the plan the coordinator writes, and every worker's peak resident memory
//! (`VmHWM`: weights, mapped pages included, KV cache, workspace) stays within its limit through serving and a
//! plan change (a fourth worker joins and layers move). With less memory than the whole model, two workers
//! serve it too, keeping the layers they cannot hold paged in from the model file (CPU offload).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use strata_engine::config::ModelConfig;
use strata_engine::stage_memory::ProcessMemory;
use strata_engine::tensor::DType;
use strata_engine::testing::{TinySpec, random_weights, tiny_config, write_hf};
use strata_proto::pb;
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_testkit::workspace_bin;
use strata_tests::processes::ProcessCluster;
use strata_tests::{generate, ids_request, reference};

const LIMIT_MIB: u64 = 180;
const PROMPTS: [&[u32]; 2] = [&[1, 2, 3, 4, 5], &[400, 17, 9]];
const TOKENS: usize = 12;

/// 12 layers of hidden 1024, MLP 2816, GQA 16/4, vocab 8192, f16: 12 × 22.5 MB + 2 × 16.8 MB ≈ 304 MB.
fn llama_300mb() -> ModelConfig {
    ModelConfig {
        hidden_size: 1024,
        intermediate_size: 2816,
        num_layers: 12,
        num_heads: 16,
        num_kv_heads: 4,
        head_dim: 64,
        vocab_size: 8192,
        max_position_embeddings: 1024,
        ..tiny_config()
    }
}

/// Peak resident bytes (`VmHWM`) of process `pid`.
fn peak_rss(pid: u32) -> Result<u64> {
    Ok(ProcessMemory::of(pid).with_context(|| format!("no memory figures for process {pid}"))?.peak)
}

/// Checks every worker's peak resident memory against its limit of `limit_mib` MiB, and prints the peaks.
fn workers_within(cluster: &ProcessCluster, limit_mib: u64) -> Result<()> {
    let mut report = Vec::new();
    for (id, process) in &cluster.workers {
        let peak = peak_rss(process.id())?;
        report.push(format!("{id}: {:.1} MiB", peak as f64 / f64::from(1 << 20)));
        ensure!(peak <= limit_mib << 20, "{id} peaked at {peak} bytes, over its {limit_mib} MiB limit");
    }
    eprintln!("peak resident memory per worker (limit {limit_mib} MiB): {}", report.join(", "));
    Ok(())
}

/// Every worker that kept its role in the pipeline (first, middle or last stage) with fewer layers than it had holds
/// more KV tokens than it did: fewer layers need less memory for weights (22.5 MB a layer here) and for each token,
/// and a worker frees its old stage (weights, KV cache and the arena they were copied into) before it measures what
/// the new one leaves. (With as many layers, the measured peaks differ by a fraction of a MiB either way.) A join
/// usually leaves such a worker; where it leaves none, there is nothing to compare.
fn reloads_measured_afresh(before: &pb::ClusterStatusResponse, after: &pb::ClusterStatusResponse) -> Result<()> {
    let layers = llama_300mb().num_layers as u32;
    let role = |s: &pb::StageInfo| (s.layer_start == 0, s.layer_end == layers);
    let mut compared = Vec::new();
    for old in &before.stages {
        let Some(new) = after.stages.iter().find(|s| s.node_id == old.node_id) else { continue };
        if role(new) != role(old) || new.layer_end - new.layer_start >= old.layer_end - old.layer_start {
            continue;
        }
        let (was, is) = (node_of(before, old)?.kv_capacity_tokens, node_of(after, new)?.kv_capacity_tokens);
        let change = format!(
            "{}: layers {}..{} holding {was} KV tokens, then {}..{} holding {is}",
            old.node_id, old.layer_start, old.layer_end, new.layer_start, new.layer_end
        );
        ensure!(is > was, "a reload counted what the replaced stage held: {change}");
        compared.push(change);
    }
    if compared.is_empty() {
        eprintln!("no worker kept its role with fewer layers: {:?}", after.stages);
    } else {
        eprintln!("reloaded stages with fewer layers: {}", compared.join("; "));
    }
    Ok(())
}

/// The node record of the worker serving `stage`.
fn node_of<'a>(status: &'a pb::ClusterStatusResponse, stage: &pb::StageInfo) -> Result<&'a pb::NodeInfo> {
    status.nodes.iter().find(|n| n.node_id == stage.node_id).context("stage without a node")
}

async fn greedy_tokens(url: &str) -> Result<Vec<Vec<u32>>> {
    let mut client = CoordinatorClient::connect(url.to_owned()).await?;
    let mut all = Vec::new();
    for prompt in PROMPTS {
        let out = generate(&mut client, ids_request(prompt, TOKENS as u32)).await?;
        all.push(out.token_ids);
    }
    Ok(all)
}

/// `strata plan` over the nodes as the coordinator saw them (memory and measured speed, in node-id order).
fn what_if(model: &Path, s: &pb::ClusterStatusResponse) -> Result<Vec<(u64, u64)>> {
    let mut nodes: Vec<&pb::NodeInfo> = s.nodes.iter().filter(|n| n.state == pb::NodeState::Ready as i32).collect();
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    let spec: Vec<String> = nodes
        .iter()
        .map(|n| format!("{}@{}/{}/{}", n.memory_bytes, n.layer_seconds, n.offload_layer_seconds, n.head_seconds))
        .collect();
    let out = Command::new(workspace_bin("strata")?)
        .args(["plan", "--format", "json", "--max-model-len", "512", "--max-batch-tokens", "64", "--nodes"])
        .arg(spec.join(","))
        .arg("--model")
        .arg(model)
        .output()?;
    ensure!(out.status.success(), "strata plan: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let stages = report["stages"].as_array().context("no stages")?;
    stages
        .iter()
        .map(|st| Ok((st["layer_start"].as_u64().context("start")?, st["layer_end"].as_u64().context("end")?)))
        .collect()
}

fn served_ranges(s: &pb::ClusterStatusResponse) -> Vec<(u64, u64)> {
    s.stages.iter().map(|st| (u64::from(st.layer_start), u64::from(st.layer_end))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_no_worker_can_hold_is_split_and_every_worker_stays_within_its_limit() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let spec = TinySpec { config: llama_300mb(), dtype: DType::F16, seed: 11 };
    write_hf(dir.path(), &spec, &random_weights(&spec))?;
    let model = dir.path();
    let size: u64 = std::fs::metadata(model.join("model.safetensors"))?.len();
    ensure!(size > 3 * (LIMIT_MIB << 20) / 2, "the model ({size} bytes) must not fit one worker");
    let expected: Vec<Vec<u32>> =
        PROMPTS.iter().map(|p| reference(model, 2, p, TOKENS)).collect::<Result<_>>().context("reference run")?;

    let limit = format!("{LIMIT_MIB}Mi");
    let worker_flags = ["--memory-limit", limit.as_str()];
    let mut cluster = ProcessCluster::start(model, 0, 0).await?;
    for id in ["w0", "w1", "w2"] {
        cluster.add_worker_with(id, &worker_flags)?;
    }
    let flags = ["--min-stages=3", "--max-model-len", "512", "--min-kv-tokens", "512", "--max-batch-tokens", "64"];
    cluster.add_coordinator(&flags)?;
    let served = cluster.wait_for_stages(3).await.with_context(|| cluster.logs())?;
    let url = cluster.coordinators[0].url.clone();

    // The plan is the one `strata plan` computes for the same nodes.
    ensure!(what_if(model, &served)? == served_ranges(&served), "strata plan disagrees with {:?}", served.stages);
    let got = greedy_tokens(&url).await.with_context(|| cluster.logs())?;
    ensure!(got == expected, "3 limited stages gave {got:?}, one unlimited process {expected:?}");
    // Each stage's KV cache was sized from what its limit leaves, and holds the tokens the plan asks for.
    let now = strata_tests::processes::status(&url).await?;
    for stage in &now.stages {
        let node = node_of(&now, stage)?;
        ensure!(node.kv_capacity_tokens >= 512, "{} holds {} KV tokens", node.node_id, node.kv_capacity_tokens);
    }

    // A fourth worker joins: layers move, each worker frees its old layers before loading new ones.
    cluster.add_worker_with("w3", &worker_flags)?;
    let joined = cluster.wait_for_stages(4).await.with_context(|| cluster.logs())?;
    ensure!(joined.plan_epoch > served.plan_epoch);
    let got = greedy_tokens(&url).await.with_context(|| cluster.logs())?;
    ensure!(got == expected, "after the join: {got:?}, expected {expected:?}");
    // (A join keeps the pipeline's order, which a what-if from scratch does not know.)
    let after = strata_tests::processes::status(&url).await?;
    reloads_measured_afresh(&now, &after).with_context(|| cluster.logs())?;

    workers_within(&cluster, LIMIT_MIB)
}

/// Less memory than the model: two workers of 150 MiB (314 MB together, the model alone is 304 MB and each stage
/// also holds its runtime, KV cache and activations). Placement gives each more layers than it can keep, the
/// workers page the rest in from the mapped file for every batch, and tokens and limits hold all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_bigger_than_all_the_workers_memory_is_served_with_offloaded_layers() -> Result<()> {
    const OFFLOAD_LIMIT_MIB: u64 = 150;
    let dir = tempfile::tempdir()?;
    let spec = TinySpec { config: llama_300mb(), dtype: DType::F16, seed: 11 };
    write_hf(dir.path(), &spec, &random_weights(&spec))?;
    let model = dir.path();
    let expected: Vec<Vec<u32>> =
        PROMPTS.iter().map(|p| reference(model, 2, p, TOKENS)).collect::<Result<_>>().context("reference run")?;

    let limit = format!("{OFFLOAD_LIMIT_MIB}Mi");
    let mut cluster = ProcessCluster::start(model, 0, 0).await?;
    for id in ["w0", "w1"] {
        cluster.add_worker_with(id, &["--memory-limit", limit.as_str()])?;
    }
    let flags = ["--min-stages=2", "--max-model-len", "512", "--min-kv-tokens", "512", "--max-batch-tokens", "64"];
    cluster.add_coordinator(&flags)?;
    let served = cluster.wait_for_stages(2).await.with_context(|| cluster.logs())?;
    let url = cluster.coordinators[0].url.clone();
    ensure!(what_if(model, &served)? == served_ranges(&served), "strata plan disagrees with {:?}", served.stages);

    let got = greedy_tokens(&url).await.with_context(|| cluster.logs())?;
    ensure!(got == expected, "2 offloading stages gave {got:?}, one unlimited process {expected:?}");
    let now = strata_tests::processes::status(&url).await?;
    let (mut report, mut offloaded) = (Vec::new(), 0);
    for stage in &now.stages {
        let node = node_of(&now, stage)?;
        let layers = stage.layer_end - stage.layer_start;
        report.push(format!(
            "{}: layers {}..{}, {} offloaded, {:.1} / {:.1} ms per resident / offloaded layer",
            node.node_id,
            stage.layer_start,
            stage.layer_end,
            node.offloaded_layers,
            node.layer_seconds * 1e3,
            node.offload_layer_seconds * 1e3
        ));
        ensure!(
            node.offloaded_layers < layers,
            "{} offloads {} of its {layers} layers: none resident",
            node.node_id,
            node.offloaded_layers
        );
        ensure!(node.offload_layer_seconds > 0.0, "{} measured no offloaded speed", node.node_id);
        ensure!(node.kv_capacity_tokens >= 512, "{} holds {} KV tokens", node.node_id, node.kv_capacity_tokens);
        offloaded += node.offloaded_layers;
    }
    eprintln!("{}", report.join("\n"));
    // Which stage offloads depends on the speeds the workers measured: on a busy machine placement may give one
    // worker only what it keeps resident and the other the rest, a valid plan. The model cannot fit, so some do.
    ensure!(offloaded > 0, "no stage offloads a layer of a model bigger than their memory: {report:?}");
    workers_within(&cluster, OFFLOAD_LIMIT_MIB)
}
