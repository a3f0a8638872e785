//! Offload planning through model loading, on the CPU backend (which keeps offloaded layers where they are):
//! the plan comes from tensor metadata and the device sizes the backend reports, and outputs do not change.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, ensure};
use strata_engine::KvDtype;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::offload::{OffloadBudget, OffloadPlan};

fn logits(model: &StageModel<CpuBackend>) -> Result<Vec<f32>> {
    let mut kv = model.new_kv_cache(8, 16, KvDtype::F32)?;
    let ids = [1u32, 5, 9, 200, 3];
    let chunk = SeqChunk { seq_id: 1, start_pos: 0, len: ids.len() };
    let mut out = model.forward(&mut kv, &[chunk], StageInput::Tokens(&ids), LogitRows::All)?.data;
    let step = SeqChunk { seq_id: 1, start_pos: ids.len(), len: 1 };
    out.extend(model.forward(&mut kv, &[step], StageInput::Tokens(&[7]), LogitRows::All)?.data);
    Ok(out)
}

#[test]
fn a_tight_budget_offloads_the_last_layers_and_changes_no_output() -> Result<()> {
    let files = ModelFiles::open(Path::new("random:tiny"))?;
    let be = Arc::new(CpuBackend::new(1)?);
    let full = StageModel::load(&files, 0..4, be.clone(), &LoadOptions::default())?;
    ensure!(full.offloaded_layers().is_empty());
    // f32: 589,824 bytes per layer; 529,408 of embeddings, head and norms. 2.5 MB: one resident + two slots.
    let budget = OffloadBudget { limit_bytes: 2_500_000, reserve_bytes: 0 };
    let opts = LoadOptions { offload: Some(budget), ..LoadOptions::default() };
    let tight = StageModel::load(&files, 0..4, be.clone(), &opts)?;
    ensure!(
        tight.offload_plan() == OffloadPlan { resident: 1, offloaded: 3, staging_bytes: 2 * 589_824 },
        "{:?}",
        tight.offload_plan()
    );
    ensure!(tight.offloaded_layers() == (1..4));
    ensure!(logits(&tight)? == logits(&full)?);
    // A later stage counts only its own layers and the head; the reserve for KV and workspace comes off the top.
    // Two layers (1.18 MB) fit beside the head in 2.5 MB less 600 kB; less 1.2 MB they do not, and two staging
    // slots cost as much as the two layers, so there is no plan.
    let reserve = |r| LoadOptions {
        offload: Some(OffloadBudget { limit_bytes: 2_500_000, reserve_bytes: r }),
        ..LoadOptions::default()
    };
    let late = StageModel::load(&files, 2..4, be.clone(), &reserve(600_000))?;
    ensure!(late.offloaded_layers().is_empty(), "{:?}", late.offload_plan());
    let err = StageModel::load(&files, 2..4, be.clone(), &reserve(1_200_000)).err().map(|e| e.to_string());
    ensure!(err.as_deref().is_some_and(|e| e.contains("two staging slots")), "{err:?}");
    let too_small = LoadOptions { offload: Some(OffloadBudget { limit_bytes: 400_000, reserve_bytes: 0 }), ..opts };
    ensure!(StageModel::load(&files, 0..4, be, &too_small).is_err());
    Ok(())
}

#[test]
fn resident_layers_offload_the_rest_and_change_no_output() -> Result<()> {
    // Synthetic weights are owned, so the offloaded ones go through a spill file first.
    let files = ModelFiles::open(Path::new("random:tiny"))?;
    let be = Arc::new(CpuBackend::new(1)?);
    let full = StageModel::load(&files, 0..4, be.clone(), &LoadOptions::default())?;
    for resident in [0, 2] {
        let opts = LoadOptions { resident_layers: Some(resident), ..LoadOptions::default() };
        let paged = StageModel::load(&files, 0..4, be.clone(), &opts)?;
        ensure!(paged.offloaded_layers() == (resident..4), "{:?}", paged.offload_plan());
        ensure!(logits(&paged)? == logits(&full)?, "resident {resident}");
    }
    Ok(())
}
