//! Logits of the tiny fixture models against the numpy reference in `tests/reference/make_fixtures.py`, loaded
//! from their safetensors and, for the qwen ones and a llama with q/k/v biases, from the GGUF copies
//! `tests/reference/make_gguf_fixtures.py` writes with llama.cpp's `gguf` package.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use strata_engine::KvDtype;
use strata_engine::backend::cpu::{CpuBackend, CpuTensor};
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

/// The fixture's expected logits and prompt, from `expected.json` in its directory.
fn expected(name: &str) -> Result<serde_json::Value> {
    let path = fixtures().join(name).join("expected.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| path.display().to_string())?)?)
}

/// Prefill of the prompt, then the greedy decode steps, through `stages`; logits of every step.
fn run(stages: &[StageModel<CpuBackend>], expected: &serde_json::Value) -> Result<Vec<CpuTensor>> {
    let mut caches = stages.iter().map(|s| s.new_kv_cache(8, 4, KvDtype::F32)).collect::<Result<Vec<_>, _>>()?;
    let prompt = ids(expected, "prompt_ids");
    let mut steps = vec![(SeqChunk { seq_id: 1, start_pos: 0, len: prompt.len() }, prompt.clone(), LogitRows::All)];
    for (i, id) in ids(expected, "decode_ids").into_iter().enumerate() {
        steps.push((SeqChunk { seq_id: 1, start_pos: prompt.len() + i, len: 1 }, vec![id], LogitRows::Last));
    }
    let mut out = Vec::new();
    for (chunk, tokens, rows) in &steps {
        let mut hidden = None;
        for (stage, kv) in stages.iter().zip(caches.iter_mut()) {
            let input = match hidden.take() {
                None => StageInput::Tokens(tokens),
                Some(h) => StageInput::Hidden(h),
            };
            hidden = Some(stage.forward(kv, &[*chunk], input, *rows)?);
        }
        out.push(hidden.context("no stages")?);
    }
    Ok(out)
}

/// Loads `model` (a fixture directory or a GGUF file) as one stage and checks its logits against fixture `name`.
fn check(name: &str, model: &Path, backend: Arc<CpuBackend>) -> Result<()> {
    let expected = expected(name)?;
    let files = ModelFiles::open(model)?;
    let n = files.config().num_layers;
    let stage = StageModel::load(&files, 0..n, backend, &LoadOptions::default())?;
    let got = run(&[stage], &expected)?;
    let want = rows(&expected, "logits")?;
    let vocab = got[0].cols;
    for (t, w) in want.iter().enumerate() {
        let d = max_diff(&got[0].data[t * vocab..(t + 1) * vocab], w);
        assert!(d < 1e-4, "{name}: prefill position {t} differs by {d}");
    }
    let decode_want = rows(&expected, "decode_logits")?;
    assert_eq!(got.len(), decode_want.len() + 1, "{name}: one output per decode step");
    for (i, (g, w)) in got[1..].iter().zip(&decode_want).enumerate() {
        let d = max_diff(&g.data, w);
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
        "tiny-llama-bias",
    ];
    let simd = Arc::new(CpuBackend::new(2)?);
    let scalar = Arc::new(CpuBackend::scalar(2)?);
    for name in names {
        let dir = fixtures().join(name);
        check(name, &dir, simd.clone()).with_context(|| format!("{name} (simd)"))?;
        check(name, &dir, scalar.clone()).with_context(|| format!("{name} (scalar)"))?;
    }
    Ok(())
}

/// The GGUF copies written by llama.cpp's own `gguf` package: strata must read their architecture, names and
/// (unpermuted) row order as llama.cpp's converter wrote them, and give the numpy logits.
const GGUF_FIXTURES: [&str; 3] = ["tiny-qwen2-bias", "tiny-qwen3", "tiny-llama-bias"];

fn gguf_fixture(name: &str) -> PathBuf {
    fixtures().join("gguf").join(format!("{name}.gguf"))
}

#[test]
fn gguf_fixtures_match_numpy_reference() -> Result<()> {
    let be = Arc::new(CpuBackend::new(2)?);
    for name in GGUF_FIXTURES {
        let gguf = ModelFiles::open(&gguf_fixture(name))?;
        let hf = ModelFiles::open(&fixtures().join(name))?;
        let (g, h) = (gguf.config(), hf.config());
        // What the metadata must say for the tensors to load; eps and theta are f32 in GGUF, so not compared.
        let shape = |c: &strata_engine::config::ModelConfig| {
            (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.attention_bias)
        };
        assert_eq!(shape(g), shape(h), "{name}: GGUF config");
        assert_eq!(g.tie_word_embeddings, h.tie_word_embeddings, "{name}: tied head");
        check(name, &gguf_fixture(name), be.clone()).with_context(|| format!("{name} (gguf)"))?;
    }
    Ok(())
}

#[test]
fn gguf_fixtures_split_into_stages_equal_one_stage_bit_for_bit() -> Result<()> {
    let be = Arc::new(CpuBackend::new(2)?);
    for name in GGUF_FIXTURES {
        let expected = expected(name)?;
        let files = ModelFiles::open(&gguf_fixture(name))?;
        let n = files.config().num_layers;
        let load = |r: std::ops::Range<usize>| StageModel::load(&files, r, be.clone(), &LoadOptions::default());
        let whole = run(&[load(0..n)?], &expected)?;
        let split = run(&[load(0..1)?, load(1..n)?], &expected)?;
        assert_eq!(whole, split, "{name}: two stages differ from one");
    }
    Ok(())
}
