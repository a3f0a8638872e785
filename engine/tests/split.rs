//! Running layers `[0,k)` then `[k,n)` gives exactly the logits of `[0,n)`; GGUF and safetensors agree.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use strata_engine::KvDtype;
use strata_engine::backend::cpu::{CpuBackend, CpuTensor};
use strata_engine::config::{Architecture, Llama3RopeScaling, ModelConfig};
use strata_engine::generate::Engine;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::tensor::DType;
use strata_engine::testing::{GgufOverrides, TinySpec, random_weights, tiny_config, write_gguf, write_hf};

/// Prefill two sequences of different lengths, then three batched decode steps; returns every logits tensor.
fn run(stages: &[StageModel<CpuBackend>]) -> Result<Vec<CpuTensor>> {
    let mut caches = stages.iter().map(|s| s.new_kv_cache(16, 4, KvDtype::F32)).collect::<Result<Vec<_>, _>>()?;
    let mut outputs = Vec::new();
    let mut steps: Vec<(Vec<SeqChunk>, Vec<u32>)> = vec![(
        vec![SeqChunk { seq_id: 10, start_pos: 0, len: 7 }, SeqChunk { seq_id: 11, start_pos: 0, len: 3 }],
        vec![5, 17, 2, 99, 42, 7, 8, 250, 3, 1],
    )];
    for i in 0..3 {
        steps.push((
            vec![SeqChunk { seq_id: 10, start_pos: 7 + i, len: 1 }, SeqChunk { seq_id: 11, start_pos: 3 + i, len: 1 }],
            vec![11 + i as u32, 200 - i as u32],
        ));
    }
    for (chunks, ids) in &steps {
        let mut hidden = None;
        for (stage, kv) in stages.iter().zip(caches.iter_mut()) {
            let input = match hidden.take() {
                None => StageInput::Tokens(ids),
                Some(h) => StageInput::Hidden(h),
            };
            hidden = Some(stage.forward(kv, chunks, input, LogitRows::All)?);
        }
        outputs.push(hidden.expect("at least one stage"));
    }
    Ok(outputs)
}

fn load(files: &ModelFiles, cuts: &[usize], be: &Arc<CpuBackend>) -> Result<Vec<StageModel<CpuBackend>>> {
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(files.config().num_layers);
    Ok(bounds
        .windows(2)
        .map(|w| StageModel::load(files, w[0]..w[1], be.clone(), &LoadOptions::default()))
        .collect::<Result<_, _>>()?)
}

/// Qwen3: per-head q/k norms, a head width (24) that is not hidden / heads (64 / 4), untied head.
fn qwen3_config() -> ModelConfig {
    ModelConfig { architecture: Architecture::Qwen3, head_dim: 24, ..tiny_config() }
}

fn specs() -> Vec<(&'static str, TinySpec)> {
    let base = tiny_config();
    let mha = ModelConfig { num_kv_heads: 4, tie_word_embeddings: true, ..base.clone() };
    let qwen = ModelConfig { architecture: Architecture::Qwen2, attention_bias: true, ..base.clone() };
    let qwen3 = qwen3_config();
    let scaled = ModelConfig {
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32.0,
        }),
        ..base.clone()
    };
    vec![
        ("mha-tied", TinySpec { config: mha, dtype: DType::F32, seed: 1 }),
        ("gqa-untied", TinySpec { config: base.clone(), dtype: DType::F32, seed: 2 }),
        ("qwen2-bias", TinySpec { config: qwen, dtype: DType::F32, seed: 3 }),
        ("qwen3-qk-norm", TinySpec { config: qwen3, dtype: DType::F32, seed: 7 }),
        ("llama3-rope", TinySpec { config: scaled, dtype: DType::F32, seed: 4 }),
        ("bf16", TinySpec { config: base.clone(), dtype: DType::BF16, seed: 5 }),
        ("f16", TinySpec { config: base, dtype: DType::F16, seed: 6 }),
    ]
}

#[test]
fn split_stages_equal_one_stage_bit_for_bit() -> Result<()> {
    let be = Arc::new(CpuBackend::new(2)?);
    for (name, spec) in specs() {
        let dir = tempfile::tempdir()?;
        write_hf(dir.path(), &spec, &random_weights(&spec))?;
        let files = ModelFiles::open(dir.path())?;
        let whole = run(&load(&files, &[], &be)?)?;
        for cuts in [vec![1], vec![2], vec![1, 3], vec![1, 2, 3]] {
            let split = run(&load(&files, &cuts, &be)?)?;
            assert_eq!(whole, split, "{name}: cuts {cuts:?} changed the logits");
        }
    }
    Ok(())
}

/// Steps taken in the engine's backend context (as a stage's executor and the benchmarks take them) run on the
/// CPU pool's threads and give the logits of steps handed into the pool one by one.
#[test]
fn steps_in_the_backend_context_run_on_the_pool_and_change_nothing() -> Result<()> {
    let spec = TinySpec { config: tiny_config(), dtype: DType::F32, seed: 9 };
    let dir = tempfile::tempdir()?;
    write_hf(dir.path(), &spec, &random_weights(&spec))?;
    let files = ModelFiles::open(dir.path())?;
    let mut outputs = Vec::new();
    for scoped in [false, true] {
        let model = load(&files, &[], &Arc::new(CpuBackend::new(2)?))?.remove(0);
        let mut engine = Engine::new(model, None, 64)?;
        let steps = |e: &mut Engine<CpuBackend>| -> Result<(Vec<Vec<f32>>, Option<String>)> {
            let mut logits = e.step(&[SeqChunk { seq_id: 0, start_pos: 0, len: 5 }], &[3, 1, 4, 1, 5])?;
            for (i, next) in [9, 2, 6].into_iter().enumerate() {
                logits.extend(e.step(&[SeqChunk { seq_id: 0, start_pos: 5 + i, len: 1 }], &[next])?);
            }
            Ok((logits, std::thread::current().name().map(str::to_owned)))
        };
        let (logits, thread) = if scoped { engine.scoped(steps)? } else { steps(&mut engine)? };
        assert_eq!(thread.as_deref().is_some_and(|t| t.starts_with("strata-cpu-")), scoped, "ran on {thread:?}");
        outputs.push(logits);
    }
    assert_eq!(outputs[0], outputs[1], "the backend context changed the logits");
    Ok(())
}

#[test]
fn gguf_matches_safetensors() -> Result<()> {
    let be = Arc::new(CpuBackend::new(2)?);
    let cfg = ModelConfig { vocab_size: 320, ..tiny_config() };
    // f16/bf16 dots accumulate in a different order than f32 ones, hence the small tolerance.
    for (dtype, tol) in [
        (DType::F32, 0.0f32),
        (DType::F16, 1e-4),
        (DType::BF16, 1e-4),
        (DType::Q8_0, 0.1),
        (DType::Q4_0, 0.3),
        (DType::Q4_1, 0.3),
    ] {
        let spec = TinySpec { config: cfg.clone(), dtype, seed: 9 };
        let weights = random_weights(&spec);
        let dir = tempfile::tempdir()?;
        let gguf = dir.path().join("m.gguf");
        write_gguf(&gguf, &spec, &weights, &GgufOverrides::default())?;
        // The safetensors side holds exactly what the GGUF stores (dequantized), in f32.
        let g = ModelFiles::open(&gguf)?;
        let mut deq = weights.clone();
        for (name, (_, v)) in deq.iter_mut() {
            *v = g.tensor(name)?.to_f32();
        }
        let hf_spec = TinySpec { dtype: DType::F32, ..spec.clone() };
        write_hf(&dir.path().join("hf"), &hf_spec, &deq)?;
        let a = run(&load(&g, &[], &be)?)?;
        let b = run(&load(&ModelFiles::open(&dir.path().join("hf"))?, &[], &be)?)?;
        for (x, y) in a.iter().zip(&b) {
            let d = x.data.iter().zip(&y.data).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max);
            assert!(d <= tol, "{dtype}: GGUF and safetensors logits differ by {d} (tolerance {tol})");
        }
        if dtype == DType::F32 {
            // Unpermuting Q/K must reproduce the original weights exactly.
            assert_eq!(deq, weights);
        }
    }
    Ok(())
}

/// Llama 3.1's RoPE scaling reaches a GGUF as llama.cpp's converter writes it (`rope_freqs.weight`) and comes back
/// as the same frequencies: the GGUF gives the safetensors' logits, up to the divisors' rounding to f32; written
/// without the tensor it would give other ones.
#[test]
fn llama3_rope_scaling_survives_gguf() -> Result<()> {
    let be = Arc::new(CpuBackend::new(2)?);
    let (_, spec) = specs().into_iter().find(|(name, _)| *name == "llama3-rope").context("the llama3-rope spec")?;
    let weights = random_weights(&spec);
    let dir = tempfile::tempdir()?;
    write_hf(&dir.path().join("hf"), &spec, &weights)?;
    let hf = run(&load(&ModelFiles::open(&dir.path().join("hf"))?, &[], &be)?)?;
    let max_diff = |gguf: &Path| -> Result<f32> {
        let g = run(&load(&ModelFiles::open(gguf)?, &[], &be)?)?;
        Ok(g.iter()
            .zip(&hf)
            .flat_map(|(x, y)| x.data.iter().zip(&y.data).map(|(p, q)| (p - q).abs()))
            .fold(0.0, f32::max))
    };
    let scaled = dir.path().join("scaled.gguf");
    write_gguf(&scaled, &spec, &weights, &GgufOverrides::default())?;
    let d = max_diff(&scaled)?;
    assert!(d <= 1e-4, "the GGUF's logits differ from the safetensors' by {d}");
    let plain_spec = TinySpec { config: ModelConfig { rope_scaling: None, ..spec.config.clone() }, ..spec.clone() };
    let plain = dir.path().join("plain.gguf");
    write_gguf(&plain, &plain_spec, &weights, &GgufOverrides::default())?;
    let d = max_diff(&plain)?;
    assert!(d > 1e-3, "without rope_freqs.weight the logits moved by only {d}");
    Ok(())
}

#[test]
fn qwen_gguf_round_trips_and_matches_safetensors() -> Result<()> {
    let be = Arc::new(CpuBackend::new(2)?);
    let qwen2 = ModelConfig { architecture: Architecture::Qwen2, attention_bias: true, ..tiny_config() };
    for config in [qwen2, qwen3_config()] {
        let arch = config.architecture;
        let spec = TinySpec { config, dtype: DType::F32, seed: 11 };
        let weights = random_weights(&spec);
        let dir = tempfile::tempdir()?;
        let gguf = dir.path().join("m.gguf");
        write_gguf(&gguf, &spec, &weights, &GgufOverrides::default())?;
        write_hf(&dir.path().join("hf"), &spec, &weights)?;
        let g = ModelFiles::open(&gguf)?;
        assert_eq!(g.config().architecture, arch);
        for (name, (_, v)) in &weights {
            assert_eq!(&g.tensor(name)?.to_f32(), v, "{arch:?}: {name} read back changed");
        }
        let a = run(&load(&g, &[], &be)?)?;
        let b = run(&load(&ModelFiles::open(&dir.path().join("hf"))?, &[], &be)?)?;
        assert_eq!(a, b, "{arch:?}: GGUF and safetensors logits differ");
    }
    Ok(())
}

#[test]
fn gguf_unknown_tensor_type_is_a_clear_error() -> Result<()> {
    let spec = TinySpec { config: tiny_config(), dtype: DType::F32, seed: 1 };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bad.gguf");
    // 9 is ggml's Q8_1 (an activation format), which strata does not read.
    write_gguf(&path, &spec, &random_weights(&spec), &GgufOverrides { bogus_type_code: Some(9) })?;
    let err = ModelFiles::open(&path).err().expect("must fail");
    assert!(err.to_string().contains("unsupported type Q8_1"), "{err}");
    Ok(())
}

#[test]
fn gguf_rows_that_are_not_whole_k_quant_super_blocks_are_a_clear_error() -> Result<()> {
    let spec = TinySpec { config: tiny_config(), dtype: DType::F32, seed: 1 };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("narrow.gguf");
    // 12 is ggml's Q4_K: the tiny model's 64-wide rows are a quarter of its 256-element super-block.
    write_gguf(&path, &spec, &random_weights(&spec), &GgufOverrides { bogus_type_code: Some(12) })?;
    let err = ModelFiles::open(&path).err().expect("must fail");
    assert!(err.to_string().contains("rows of 64 are not whole q4_k blocks of 256"), "{err}");
    Ok(())
}
