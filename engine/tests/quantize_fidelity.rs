//! Quantizing at load against llama.cpp, on the real model. SmolLM2-135M (the Q4_1 test GGUF) is converted to a
//! Hugging Face directory in f16, as a float checkpoint; strata writes that as an F16 GGUF, and llama.cpp's
//! `llama-quantize --pure` quantizes the GGUF to each format. For Q8_0, Q4_0 and Q4_1:
//! - every tensor strata quantizes from the Hugging Face directory has exactly llama.cpp's bytes;
//! - a model loaded from the directory with `quantize` gives the same logits, bit for bit, and the same greedy
//!   tokens as the model loaded from llama.cpp's file;
//! - its logits stay within a stated bound of the f32 model's, teacher-forced along the f32 model's own greedy
//!   continuation of each prompt.
//!
//! Needs `llama-quantize` (`scripts/llama-cpp-build.sh llama-quantize`; scripts/test builds it) and the test model.

use std::sync::Arc;

use anyhow::Result;
use strata_engine::KvDtype;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::convert;
use strata_engine::layout::ModelLayout;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::quant;
use strata_engine::sampling::argmax;
use strata_engine::tensor::DType;

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Once upon a time, in a small village by the sea, there lived",
];
const NEW_TOKENS: usize = 32;

/// How far each format's logits may stray from f32's: the measured figures (docs/operations.md, "Quantize at
/// load") with some room for another CPU's kernels. 4-bit on a 135M model is coarse, Q4_0 most: the checkpoint
/// comes from a Q4_1 file, so Q4_1 lands near its original grid and Q4_0 pays for a second rounding.
struct Bound {
    dtype: DType,
    /// Largest |quantized − f32| over every logit of every position.
    max_abs: f32,
    /// Smallest mean over positions of the cosine similarity of a position's logit vector with f32's.
    mean_cosine: f32,
    /// Smallest share of positions whose top token is f32's.
    min_top1: f32,
}

const BOUNDS: [Bound; 3] = [
    Bound { dtype: DType::Q8_0, max_abs: 3.0, mean_cosine: 0.997, min_top1: 0.93 },
    Bound { dtype: DType::Q4_0, max_abs: 25.0, mean_cosine: 0.88, min_top1: 0.60 },
    Bound { dtype: DType::Q4_1, max_abs: 8.0, mean_cosine: 0.99, min_top1: 0.85 },
];

fn load(files: &ModelFiles, opts: &LoadOptions<'_>) -> Result<StageModel<CpuBackend>> {
    let n = files.config().num_layers;
    Ok(StageModel::load(files, 0..n, Arc::new(CpuBackend::new(2)?), opts)?)
}

/// Logits of every position of `ids`, one row per token.
fn logits(model: &StageModel<CpuBackend>, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
    let mut kv = model.new_kv_cache(ids.len().div_ceil(16), 16, KvDtype::F32)?;
    let chunk = SeqChunk { seq_id: 1, start_pos: 0, len: ids.len() };
    let out = model.forward(&mut kv, &[chunk], StageInput::Tokens(ids), LogitRows::All)?;
    Ok(out.data.chunks_exact(out.cols).map(<[f32]>::to_vec).collect())
}

/// `prompt` followed by `NEW_TOKENS` greedy tokens.
fn greedy(model: &StageModel<CpuBackend>, prompt: &[u32]) -> Result<Vec<u32>> {
    let mut kv = model.new_kv_cache((prompt.len() + NEW_TOKENS).div_ceil(16), 16, KvDtype::F32)?;
    let mut ids = prompt.to_vec();
    let mut chunk = SeqChunk { seq_id: 1, start_pos: 0, len: prompt.len() };
    for _ in 0..NEW_TOKENS {
        let input = &ids[chunk.start_pos..];
        let out = model.forward(&mut kv, &[chunk], StageInput::Tokens(input), LogitRows::Last)?;
        ids.push(argmax(&out.data) as u32);
        chunk = SeqChunk { seq_id: 1, start_pos: ids.len() - 1, len: 1 };
    }
    Ok(ids)
}

/// Tensors whose bytes differ from llama.cpp's, with how many of their bytes do.
fn byte_mismatches(hf: &ModelFiles, theirs: &ModelFiles, dtype: DType) -> Result<Vec<String>> {
    let mut bad = Vec::new();
    for id in ModelLayout::new(hf.config()).tensors() {
        let name = id.hf_name();
        let (src, want) = (hf.tensor(&name)?, theirs.tensor(&name)?);
        let ours = if src.shape.len() == 2 { quant::quantize_tensor(&name, &src, dtype)? } else { src };
        let (a, b) = (ours.bytes.as_slice(), want.bytes.as_slice());
        if ours.dtype != want.dtype || a != b {
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            bad.push(format!(
                "{name}: ours {} theirs {}, {differ} of {} bytes differ",
                ours.dtype,
                want.dtype,
                b.len()
            ));
        }
    }
    Ok(bad)
}

/// How one model's logits compare with another's over matching rows (positions).
struct Agreement {
    max_abs: f32,
    mean_cosine: f32,
    min_cosine: f32,
    top1: f32,
}

fn compare(a: &[Vec<f32>], b: &[Vec<f32>]) -> Agreement {
    let (mut max_abs, mut min_cos, mut sum_cos, mut same) = (0f32, 1f32, 0f32, 0usize);
    for (x, y) in a.iter().zip(b) {
        let dot: f64 = x.iter().zip(y).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum();
        let norm = |v: &[f32]| v.iter().map(|p| f64::from(*p).powi(2)).sum::<f64>().sqrt();
        let c = (dot / (norm(x) * norm(y))) as f32;
        min_cos = min_cos.min(c);
        sum_cos += c;
        max_abs = x.iter().zip(y).fold(max_abs, |m, (p, q)| m.max((p - q).abs()));
        same += usize::from(argmax(x) == argmax(y));
    }
    let n = a.len().max(1) as f32;
    Agreement { max_abs, mean_cosine: sum_cos / n, min_cosine: min_cos, top1: same as f32 / n }
}

#[test]
fn quantized_at_load_equals_llama_cpp_and_stays_near_f32() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (hf_dir, f16_gguf) = (dir.path().join("hf"), dir.path().join("f16.gguf"));
    convert::to_hf_dir(&ModelFiles::open(&strata_testkit::smollm2())?, &hf_dir, DType::F16)?;
    let hf = ModelFiles::open(&hf_dir)?;
    convert::to_gguf(&hf, &f16_gguf, DType::F16)?;
    // The tokenizer survives the trip through GGUF metadata.
    let tok = hf.tokenizer()?;
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| tok.encode(p)).collect::<Result<_, _>>()?;
    let tok_back = ModelFiles::open(&f16_gguf)?.tokenizer()?;
    for (p, ids) in PROMPTS.iter().zip(&prompts) {
        assert_eq!(&tok_back.encode(p)?, ids, "{p:?} encodes differently after HF -> GGUF");
    }

    let reference = load(&hf, &LoadOptions { dtype: Some(DType::F32), ..LoadOptions::default() })?;
    let continued: Vec<Vec<u32>> = prompts.iter().map(|p| greedy(&reference, p)).collect::<Result<_>>()?;
    let f32_logits: Vec<Vec<f32>> =
        continued.iter().map(|ids| logits(&reference, ids)).collect::<Result<Vec<_>>>()?.concat();
    drop(reference);

    for bound in &BOUNDS {
        let q = bound.dtype;
        let theirs_path = dir.path().join(format!("{q}.gguf"));
        // --pure: every matrix in the one type, as strata quantizes (by default llama.cpp keeps some higher).
        strata_testkit::llama_quantize(&f16_gguf, &theirs_path, &q.to_string().to_uppercase(), &["--pure"])?;
        let theirs = ModelFiles::open(&theirs_path)?;
        let bad = byte_mismatches(&hf, &theirs, q)?;
        assert!(bad.is_empty(), "{q}: {} tensors differ from llama.cpp's:\n{}", bad.len(), bad.join("\n"));

        let at_load = load(&hf, &LoadOptions { quantize: Some(q), ..LoadOptions::default() })?;
        let llama = load(&theirs, &LoadOptions::default())?;
        let mut ours_logits = Vec::new();
        for (prompt, ids) in prompts.iter().zip(&continued) {
            let ours = logits(&at_load, ids)?;
            assert!(ours == logits(&llama, ids)?, "{q}: logits differ from llama.cpp's file");
            assert_eq!(greedy(&at_load, prompt)?, greedy(&llama, prompt)?, "{q}: greedy tokens differ");
            ours_logits.extend(ours);
        }
        let Agreement { max_abs, mean_cosine, min_cosine, top1 } = compare(&ours_logits, &f32_logits);
        eprintln!(
            "{q}: {} positions vs f32: max |diff| {max_abs:.3}, cosine mean {mean_cosine:.4} min {min_cosine:.4}, \
             top-1 agreement {:.1}%",
            ours_logits.len(),
            top1 * 100.0
        );
        assert!(max_abs <= bound.max_abs, "{q}: max |diff| {max_abs} > {}", bound.max_abs);
        assert!(mean_cosine >= bound.mean_cosine, "{q}: mean cosine {mean_cosine} < {}", bound.mean_cosine);
        assert!(top1 >= bound.min_top1, "{q}: top-1 agreement {top1} < {}", bound.min_top1);
    }
    Ok(())
}
