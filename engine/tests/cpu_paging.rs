//! CPU weight offload pages layers in from the model file and out again: a stage whose layers are all offloaded
//! holds no more than about two of them in its resident set while it runs, and computes the same logits. Its own
//! test binary, because it reads this process's resident size (`VmRSS`), which other tests would disturb.

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use strata_engine::KvDtype;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::config::ModelConfig;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::stage_memory::ProcessMemory;
use strata_engine::tensor::DType;
use strata_engine::testing::{TinySpec, random_weights, tiny_config, write_hf};

fn rss() -> Result<u64> {
    Ok(ProcessMemory::of_self().context("no /proc/self/status")?.resident)
}

fn run(model: &StageModel<CpuBackend>) -> Result<Vec<f32>> {
    let mut kv = model.new_kv_cache(4, 16, KvDtype::F32)?;
    let ids = [3u32, 1, 4, 1, 5, 9, 2, 6];
    let chunk = SeqChunk { seq_id: 1, start_pos: 0, len: ids.len() };
    Ok(model.forward(&mut kv, &[chunk], StageInput::Tokens(&ids), LogitRows::Last)?.data)
}

#[test]
fn offloaded_layers_page_in_and_out_of_the_mapped_file() -> Result<()> {
    // 6 layers of hidden 512, MLP 2048, f32: 16 MiB each, 96 MiB in all; embeddings and head 1 MiB each.
    let config = ModelConfig {
        hidden_size: 512,
        intermediate_size: 2048,
        num_layers: 6,
        num_heads: 8,
        num_kv_heads: 8,
        head_dim: 64,
        vocab_size: 512,
        ..tiny_config()
    };
    let layer = 4 * (4 * 512 * 512 + 3 * 512 * 2048) as u64;
    let spec = TinySpec { config, dtype: DType::F32, seed: 7 };
    let dir = tempfile::tempdir()?;
    write_hf(dir.path(), &spec, &random_weights(&spec))?;
    let files = ModelFiles::open(dir.path())?;
    let be = Arc::new(CpuBackend::new(2)?);

    let opts = LoadOptions { resident_layers: Some(0), ..LoadOptions::default() };
    let paged = StageModel::load(&files, 0..6, be.clone(), &opts)?;
    ensure!(paged.offloaded_layers() == (0..6));
    let before = rss()?;
    let offloaded_logits = run(&paged)?;
    let grown = rss()?.saturating_sub(before);
    // At most the layer being computed, the next one read ahead, and activations: well under three layers,
    // where keeping them would add all six.
    ensure!(grown < 3 * layer, "resident set grew by {grown} bytes running 6 offloaded layers of {layer} bytes");

    // Measured from before the load: resident weights are copied into huge pages at load where the system has
    // them, else mapped and faulted in by the first run.
    let before = rss()?;
    let resident = StageModel::load(&files, 0..6, be, &LoadOptions::default())?;
    ensure!(run(&resident)? == offloaded_logits, "offloading changed the logits");
    let grown = rss()?.saturating_sub(before);
    ensure!(grown > 5 * layer, "a resident stage's pages should stay: grew by {grown} bytes only");
    Ok(())
}
