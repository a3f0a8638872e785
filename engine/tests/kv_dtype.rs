//! A KV cache stored as f16, bf16 or q8_0 against the f32 one on a tiny random model: byte sizes, logits within
//! each type's bound, greedy tokens, and the kv_dim a block type refuses.
//!
//! Bounds (max |logit - f32 KV logit| over a 24-token prompt and 24 greedy steps of `random:tiny`, whose logits
//! span about ±0.5; measured 7.9e-5 / 6.1e-4 / 1.6e-3): f16 ≤ 2e-4, bf16 ≤ 2e-3, q8_0 ≤ 4e-3. Greedy tokens
//! equal f32's for every type here (measured, and required). Attention alone: `backend::cpu::attention`'s tests.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, ensure};
use strata_engine::backend::Backend;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::sampling::argmax;
use strata_engine::{Error, KvDtype};

const PROMPT: usize = 24;
const STEPS: usize = 24;

/// Logits of the prompt's last position and of each greedy step after it, with the KV cache stored as `dtype`,
/// fed `forced` tokens when given (so every type sees the same inputs) or its own greedy picks.
fn run(model: &StageModel<CpuBackend>, dtype: KvDtype, forced: Option<&[u32]>) -> Result<(Vec<Vec<f32>>, Vec<u32>)> {
    let vocab = model.config().vocab_size as u32;
    let mut kv = model.new_kv_cache(8, 16, dtype)?;
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 37 + 5) % vocab).collect();
    let chunk = SeqChunk { seq_id: 1, start_pos: 0, len: PROMPT };
    let mut logits = vec![model.forward(&mut kv, &[chunk], StageInput::Tokens(&prompt), LogitRows::Last)?.data];
    let mut tokens = Vec::new();
    for step in 0..STEPS {
        let next = forced.map_or_else(|| argmax(&logits[step]), |f| f[step]);
        tokens.push(next);
        let chunk = SeqChunk { seq_id: 1, start_pos: PROMPT + step, len: 1 };
        logits.push(model.forward(&mut kv, &[chunk], StageInput::Tokens(&[next]), LogitRows::Last)?.data);
    }
    Ok((logits, tokens))
}

fn tiny() -> Result<StageModel<CpuBackend>> {
    let files = ModelFiles::open(Path::new("random:tiny"))?;
    let n = files.config().num_layers;
    Ok(StageModel::load(&files, 0..n, Arc::new(CpuBackend::new(2)?), &LoadOptions::default())?)
}

#[test]
fn logits_and_greedy_tokens_stay_within_each_types_bound_of_f32() -> Result<()> {
    let model = tiny()?;
    let (exact, greedy) = run(&model, KvDtype::F32, None)?;
    let span = exact.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    for (dtype, bound) in [(KvDtype::F32, 0.0), (KvDtype::F16, 2e-4), (KvDtype::Bf16, 2e-3), (KvDtype::Q8_0, 4e-3)] {
        let (logits, _) = run(&model, dtype, Some(&greedy))?;
        let worst = exact.iter().flatten().zip(logits.iter().flatten()).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{dtype}: max |logit diff| {worst} (logits within ±{span})");
        ensure!(worst <= bound, "{dtype}: logits differ from f32 KV by {worst} > {bound}");
        let (_, own) = run(&model, dtype, None)?;
        ensure!(own == greedy, "{dtype}: greedy tokens {own:?} differ from f32 KV's {greedy:?}");
    }
    Ok(())
}

#[test]
fn smaller_types_take_their_share_of_the_bytes() -> Result<()> {
    let model = tiny()?;
    let kv_dim = model.config().kv_dim();
    let f32_bytes = model.kv_bytes_per_token(KvDtype::F32)?;
    assert_eq!(f32_bytes, model.config().num_layers * 2 * kv_dim * 4);
    assert_eq!(model.kv_bytes_per_token(KvDtype::F16)? * 2, f32_bytes);
    assert_eq!(model.kv_bytes_per_token(KvDtype::Bf16)? * 2, f32_bytes);
    assert_eq!(model.kv_bytes_per_token(KvDtype::Q8_0)? * 128, f32_bytes * 34);
    // What the CPU backend allocates is what the sizing says.
    for dtype in KvDtype::ALL {
        let kv = model.new_kv_cache(3, 16, dtype)?;
        assert_eq!(kv.dtype(), dtype);
        let allocated: usize = kv.layers.iter().map(|l| l.bytes()).sum();
        assert_eq!(allocated, 3 * 16 * model.kv_bytes_per_token(dtype)?, "{dtype}");
    }
    Ok(())
}

#[test]
fn q8_0_refuses_rows_that_are_not_whole_blocks() -> Result<()> {
    let be = CpuBackend::new(1)?;
    let err = be.alloc_kv_layer(4, 16, 48, KvDtype::Q8_0).err();
    assert!(matches!(err, Some(Error::KvDim { dtype: KvDtype::Q8_0, kv_dim: 48, block: 32 })), "{err:?}");
    assert_eq!(
        err.map(|e| e.to_string()).unwrap_or_default(),
        "a q8_0 KV cache needs kv_dim (KV heads × head width) to be a multiple of 32, got 48"
    );
    assert!(be.alloc_kv_layer(4, 16, 48, KvDtype::F16).is_ok());
    Ok(())
}
