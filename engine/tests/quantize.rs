//! Quantizing at load (`LoadOptions::quantize`) against the same quantization written into a GGUF file by
//! `convert::to_gguf`: the same bytes, so the same logits bit for bit, on whole models and on split stages.

use std::sync::Arc;

use anyhow::Result;
use strata_engine::KvDtype;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::config::{Architecture, ModelConfig};
use strata_engine::convert;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::tensor::DType;
use strata_engine::testing::{GgufOverrides, TinySpec, random_weights, tiny_config, write_gguf, write_hf};

const FORMATS: [DType; 3] = [DType::Q8_0, DType::Q4_0, DType::Q4_1];

/// A tiny model whose every matrix has rows of whole 32-element blocks.
fn spec(dtype: DType, tied: bool) -> TinySpec {
    let config = ModelConfig { vocab_size: 320, tie_word_embeddings: tied, ..tiny_config() };
    TinySpec { config, dtype, seed: 21 }
}

/// Prefill logits of every prompt token through stages cut at `cuts`, each loaded with `opts`.
fn logits(files: &ModelFiles, cuts: &[usize], opts: &LoadOptions<'_>) -> Result<Vec<f32>> {
    let be = Arc::new(CpuBackend::new(2)?);
    let n = files.config().num_layers;
    let bounds: Vec<usize> = std::iter::once(0).chain(cuts.iter().copied()).chain(std::iter::once(n)).collect();
    let prompt = [3u32, 17, 250, 9, 44, 1, 300];
    let chunk = [SeqChunk { seq_id: 1, start_pos: 0, len: prompt.len() }];
    let mut input = StageInput::Tokens(&prompt);
    for w in bounds.windows(2) {
        let stage = StageModel::load(files, w[0]..w[1], be.clone(), opts)?;
        let mut kv = stage.new_kv_cache(4, 4, KvDtype::F32)?;
        input = StageInput::Hidden(stage.forward(&mut kv, &chunk, input, LogitRows::All)?);
    }
    match input {
        StageInput::Hidden(out) => Ok(out.data),
        StageInput::Tokens(_) => anyhow::bail!("no stage ran"),
    }
}

#[test]
fn quantized_at_load_equals_gguf_written_by_convert_bit_for_bit() -> Result<()> {
    for (source, tied) in [(DType::F32, false), (DType::BF16, true), (DType::F16, false)] {
        let spec = spec(source, tied);
        let dir = tempfile::tempdir()?;
        write_hf(&dir.path().join("hf"), &spec, &random_weights(&spec))?;
        let hf = ModelFiles::open(&dir.path().join("hf"))?;
        let f32_logits = logits(&hf, &[], &LoadOptions::default())?;
        for q in FORMATS {
            let path = dir.path().join(format!("{q}.gguf"));
            let report = convert::to_gguf(&hf, &path, q)?;
            assert!(report.kept_quantized.is_empty());
            let gguf = ModelFiles::open(&path)?;
            let from_file = logits(&gguf, &[], &LoadOptions::default())?;
            let at_load = LoadOptions { quantize: Some(q), ..LoadOptions::default() };
            assert_eq!(logits(&hf, &[], &at_load)?, from_file, "{source} -> {q}: whole model");
            // Each stage quantizes only its own slice, with the same result.
            assert_eq!(logits(&hf, &[1, 3], &at_load)?, from_file, "{source} -> {q}: three stages");
            // Quantization did happen: the logits moved, but not far (these weights span ±0.17).
            let worst = from_file.iter().zip(&f32_logits).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let limit = if q == DType::Q8_0 { 0.1 } else { 1.5 };
            assert!(worst > 0.0 && worst < limit, "{source} -> {q}: {worst} from f32");
        }
    }
    Ok(())
}

#[test]
fn quantized_files_are_kept_not_requantized() -> Result<()> {
    let spec = spec(DType::Q8_0, false);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("q8.gguf");
    write_gguf(&path, &spec, &random_weights(&spec), &GgufOverrides::default())?;
    let files = ModelFiles::open(&path)?;
    let plain = logits(&files, &[], &LoadOptions::default())?;
    let asked = LoadOptions { quantize: Some(DType::Q4_0), ..LoadOptions::default() };
    assert_eq!(logits(&files, &[2], &asked)?, plain, "Q8_0 matrices stay Q8_0");
    // Converting them to another block format copies them and says so; to the same format, silently.
    let report = convert::to_gguf(&files, &dir.path().join("q4.gguf"), DType::Q4_0)?;
    assert_eq!(report.kept_quantized.len(), 2 + 7 * spec.config.num_layers, "embeddings, head, 7 per layer");
    let copy = convert::to_gguf(&files, &dir.path().join("q8-copy.gguf"), DType::Q8_0)?;
    assert!(copy.kept_quantized.is_empty());
    assert_eq!(logits(&ModelFiles::open(&dir.path().join("q8-copy.gguf"))?, &[], &LoadOptions::default())?, plain);
    Ok(())
}

#[test]
fn float_gguf_round_trips_and_unsupported_models_are_refused() -> Result<()> {
    let spec = spec(DType::F32, true);
    let dir = tempfile::tempdir()?;
    write_hf(&dir.path().join("hf"), &spec, &random_weights(&spec))?;
    let hf = ModelFiles::open(&dir.path().join("hf"))?;
    let path = dir.path().join("f32.gguf");
    convert::to_gguf(&hf, &path, DType::F32)?;
    let gguf = ModelFiles::open(&path)?;
    assert_eq!(logits(&gguf, &[], &LoadOptions::default())?, logits(&hf, &[], &LoadOptions::default())?);
    // Rows of 48 are not whole blocks: refused with the tensor's name, not truncated.
    let odd = TinySpec { config: ModelConfig { intermediate_size: 48, ..spec.config.clone() }, ..spec.clone() };
    write_hf(&dir.path().join("odd"), &odd, &random_weights(&odd))?;
    let odd = ModelFiles::open(&dir.path().join("odd"))?;
    let opts = LoadOptions { quantize: Some(DType::Q8_0), ..LoadOptions::default() };
    let err = logits(&odd, &[], &opts).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("down_proj") && err.contains("multiple of 32"), "{err}");
    assert!(convert::to_gguf(&odd, &dir.path().join("odd.gguf"), DType::Q4_1).is_err());
    // q/k/v biases travel in a llama GGUF as llama.cpp's converter writes them (q and k interleaved per head).
    let biased = TinySpec { config: ModelConfig { attention_bias: true, ..spec.config.clone() }, ..spec.clone() };
    write_hf(&dir.path().join("biased"), &biased, &random_weights(&biased))?;
    let hf = ModelFiles::open(&dir.path().join("biased"))?;
    convert::to_gguf(&hf, &dir.path().join("b.gguf"), DType::F32)?;
    let gguf = ModelFiles::open(&dir.path().join("b.gguf"))?;
    assert!(gguf.config().attention_bias);
    assert_eq!(logits(&gguf, &[], &LoadOptions::default())?, logits(&hf, &[], &LoadOptions::default())?);
    Ok(())
}

#[test]
fn qwen_models_convert_to_their_own_gguf_architecture() -> Result<()> {
    let qwen2 =
        ModelConfig { architecture: Architecture::Qwen2, attention_bias: true, ..spec(DType::F32, true).config };
    let qwen3 = ModelConfig { architecture: Architecture::Qwen3, head_dim: 32, ..spec(DType::F32, false).config };
    for config in [qwen2, qwen3] {
        let spec = TinySpec { config, dtype: DType::F32, seed: 5 };
        let dir = tempfile::tempdir()?;
        write_hf(&dir.path().join("hf"), &spec, &random_weights(&spec))?;
        let hf = ModelFiles::open(&dir.path().join("hf"))?;
        let path = dir.path().join("m.gguf");
        convert::to_gguf(&hf, &path, DType::F32)?;
        let gguf = ModelFiles::open(&path)?;
        assert_eq!(gguf.config().architecture, spec.config.architecture);
        assert_eq!(gguf.config().attention_bias, spec.config.attention_bias);
        assert_eq!(logits(&gguf, &[2], &LoadOptions::default())?, logits(&hf, &[], &LoadOptions::default())?);
    }
    Ok(())
}
