//! Logits of the tiny fixture models against the numpy reference in `tests/reference/make_fixtures.py`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use strata_engine::KvDtype;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn rows(v: &serde_json::Value, key: &str) -> Result<Vec<Vec<f32>>> {
    let arr = v[key].as_array().with_context(|| format!("{key} missing"))?;
    Ok(arr
        .iter()
        .map(|r| {
            r.as_array().map(|r| r.iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect()).unwrap_or_default()
        })
        .collect())
}

fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()).unwrap_or_default()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn check(name: &str, backend: Arc<CpuBackend>) -> Result<()> {
    let dir = fixtures().join(name);
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json"))?)?;
    let files = ModelFiles::open(&dir)?;
    let n = files.config().num_layers;
    let model = StageModel::load(&files, 0..n, backend, &LoadOptions::default())?;
    let mut kv = model.new_kv_cache(8, 4, KvDtype::F32)?;
    let prompt = ids(&expected, "prompt_ids");
    let want = rows(&expected, "logits")?;
    let chunk = SeqChunk { seq_id: 1, start_pos: 0, len: prompt.len() };
    let got = model.forward(&mut kv, &[chunk], StageInput::Tokens(&prompt), LogitRows::All)?;
    let vocab = got.cols;
    for (t, w) in want.iter().enumerate() {
        let d = max_diff(&got.data[t * vocab..(t + 1) * vocab], w);
        assert!(d < 1e-4, "{name}: prefill position {t} differs by {d}");
    }
    let decode_ids = ids(&expected, "decode_ids");
    let decode_want = rows(&expected, "decode_logits")?;
    for (i, (&id, w)) in decode_ids.iter().zip(&decode_want).enumerate() {
        let chunk = SeqChunk { seq_id: 1, start_pos: prompt.len() + i, len: 1 };
        let got = model.forward(&mut kv, &[chunk], StageInput::Tokens(&[id]), LogitRows::Last)?;
        let d = max_diff(&got.data, w);
        assert!(d < 1e-4, "{name}: decode step {i} differs by {d}");
    }
    Ok(())
}

#[test]
fn fixtures_match_numpy_reference() -> Result<()> {
    let names = [
        "tiny-llama-mha-tied",
        "tiny-llama-gqa-untied",
        "tiny-qwen2-bias",
        "tiny-llama3-rope-scaling",
        "tiny-mistral-headdim",
        "tiny-llama-bf16",
        "tiny-llama-f16",
        "tiny-qwen3",
    ];
    let simd = Arc::new(CpuBackend::new(2)?);
    let scalar = Arc::new(CpuBackend::scalar(2)?);
    for name in names {
        check(name, simd.clone()).with_context(|| format!("{name} (simd)"))?;
        check(name, scalar.clone()).with_context(|| format!("{name} (scalar)"))?;
    }
    Ok(())
}
