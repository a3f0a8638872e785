//! Builders for tiny random-weight models, shared by tests across the workspace: Hugging Face directories
//! (safetensors) and GGUF files, from the same weights.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use half::{bf16, f16};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::config::ModelConfig;
use crate::layout::{LayerTensor, ModelLayout, TensorId};
use crate::quant;
use crate::tensor::DType;
use crate::{Error, Result};

/// A tiny model's shape and storage.
#[derive(Debug, Clone)]
pub struct TinySpec {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Storage type of matrices (f32, f16 or bf16 for safetensors; any for GGUF).
    pub dtype: DType,
    /// Seed for the weights.
    pub seed: u64,
}

/// Tensors by Hugging Face name: shape and f32 values.
pub type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Generates weights for `spec` (norms near 1, matrices ~N(0, 0.1)).
pub fn random_weights(spec: &TinySpec) -> Weights {
    let c = &spec.config;
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let mut w = Weights::new();
    let mut mat = |rng: &mut StdRng, name: String, rows: usize, cols: usize| {
        let v = (0..rows * cols).map(|_| rng.random_range(-0.17f32..0.17)).collect();
        w.insert(name, (vec![rows, cols], v));
    };
    let layout = ModelLayout::new(c);
    // Draw order (matrices, then vectors) fixes the weights a seed gives; tests across the workspace rely on it.
    let mut matrices = vec![TensorId::Embed];
    if layout.contains(TensorId::LmHead) {
        matrices.push(TensorId::LmHead);
    }
    for l in 0..c.num_layers {
        matrices.extend(LayerTensor::MATRICES.map(|t| TensorId::Layer(l, t)));
    }
    for id in matrices {
        let shape = layout.shape(id);
        mat(&mut rng, id.hf_name(), shape[0], shape[1]);
    }
    let mut vec_ = |id: TensorId, around: f32| {
        let n = layout.shape(id)[0];
        let v = (0..n).map(|_| around + rng.random_range(-0.1f32..0.1)).collect();
        w.insert(id.hf_name(), (vec![n], v));
    };
    for l in 0..c.num_layers {
        for t in LayerTensor::VECTORS {
            let id = TensorId::Layer(l, t);
            if layout.contains(id) {
                // Norms scale around 1, biases shift around 0.
                vec_(id, if matches!(t, LayerTensor::AttnNorm | LayerTensor::MlpNorm) { 1.0 } else { 0.0 });
            }
        }
    }
    vec_(TensorId::FinalNorm, 1.0);
    w
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// Writes a Hugging Face directory (`config.json`, `model.safetensors`); matrices in `spec.dtype`, vectors f32.
pub fn write_hf(dir: &Path, spec: &TinySpec, weights: &Weights) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, spec.config.to_hf_json().to_string()).map_err(io(&cfg))?;
    let mut bufs: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, (shape, v)) in weights {
        let (dt, bytes) = match (shape.len(), spec.dtype) {
            (2, DType::F16) => {
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                (safetensors::Dtype::F16, bytemuck::cast_slice(&h).to_vec())
            }
            (2, DType::BF16) => {
                let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
                (safetensors::Dtype::BF16, bytemuck::cast_slice(&h).to_vec())
            }
            _ => (safetensors::Dtype::F32, bytemuck::cast_slice(v).to_vec()),
        };
        bufs.push((name.clone(), dt, shape.clone(), bytes));
    }
    let views = bufs
        .iter()
        .map(|(n, dt, s, b)| {
            safetensors::tensor::TensorView::new(*dt, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Config(e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| Error::Safetensors { path: path.clone(), reason: e.to_string() })
}

/// llama.cpp's Q/K row permutation (Hugging Face halves → interleaved pairs).
fn permute_rows(v: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let d = rows / heads;
    let mut out = vec![0f32; v.len()];
    for h in 0..heads {
        for half in 0..2 {
            for k in 0..d / 2 {
                let (src, dst) = (h * d + half * d / 2 + k, h * d + 2 * k + half);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Overrides for [`write_gguf`], for building malformed files in tests.
#[derive(Debug, Clone, Default)]
pub struct GgufOverrides {
    /// Write this ggml type code for the first matrix instead of the real one.
    pub bogus_type_code: Option<u32>,
}

/// Writes a llama-architecture GGUF with a byte-level BPE tokenizer over single bytes.
pub fn write_gguf(path: &Path, spec: &TinySpec, weights: &Weights, ov: &GgufOverrides) -> Result<()> {
    let c = &spec.config;
    let mut kv: Vec<(String, Vec<u8>)> = Vec::new();
    let s = |x: &str| -> Vec<u8> {
        let mut b = (x.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(x.as_bytes());
        b
    };
    let u32v = |x: u32| -> Vec<u8> {
        let mut b = 4u32.to_le_bytes().to_vec();
        b.extend_from_slice(&x.to_le_bytes());
        b
    };
    let f32v = |x: f32| -> Vec<u8> {
        let mut b = 6u32.to_le_bytes().to_vec();
        b.extend_from_slice(&x.to_le_bytes());
        b
    };
    let strv = |x: &str| -> Vec<u8> {
        let mut b = 8u32.to_le_bytes().to_vec();
        b.extend(s(x));
        b
    };
    kv.push(("general.architecture".into(), strv("llama")));
    kv.push(("llama.block_count".into(), u32v(c.num_layers as u32)));
    kv.push(("llama.context_length".into(), u32v(c.max_position_embeddings as u32)));
    kv.push(("llama.embedding_length".into(), u32v(c.hidden_size as u32)));
    kv.push(("llama.feed_forward_length".into(), u32v(c.intermediate_size as u32)));
    kv.push(("llama.attention.head_count".into(), u32v(c.num_heads as u32)));
    kv.push(("llama.attention.head_count_kv".into(), u32v(c.num_kv_heads as u32)));
    kv.push(("llama.rope.freq_base".into(), f32v(c.rope_theta as f32)));
    kv.push(("llama.attention.layer_norm_rms_epsilon".into(), f32v(c.rms_norm_eps as f32)));
    kv.push(("llama.rope.dimension_count".into(), u32v(c.head_dim as u32)));
    kv.push(("tokenizer.ggml.model".into(), strv("gpt2")));
    kv.push(("tokenizer.ggml.pre".into(), strv("smollm")));
    // Vocabulary: byte-level symbols for the first 256 ids, then filler tokens; no merges.
    let byte_chars = crate::tokenizer::byte_level_alphabet();
    let tokens: Vec<String> = (0..c.vocab_size)
        .map(|id| byte_chars.get(id).map_or_else(|| format!("<tok{id}>"), |ch| ch.to_string()))
        .collect();
    let mut arr = 9u32.to_le_bytes().to_vec();
    arr.extend_from_slice(&8u32.to_le_bytes());
    arr.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    for t in &tokens {
        arr.extend(s(t));
    }
    kv.push(("tokenizer.ggml.tokens".into(), arr));
    let mut merges = 9u32.to_le_bytes().to_vec();
    merges.extend_from_slice(&8u32.to_le_bytes());
    merges.extend_from_slice(&0u64.to_le_bytes());
    kv.push(("tokenizer.ggml.merges".into(), merges));
    if let Some(e) = c.eos_token_ids.first() {
        kv.push(("tokenizer.ggml.eos_token_id".into(), u32v(*e)));
    }

    let mut infos = Vec::new();
    let mut data = Vec::new();
    let mut first_matrix = true;
    let layout = ModelLayout::new(c);
    for (name, (shape, v)) in weights {
        let id =
            TensorId::from_hf_name(name).ok_or_else(|| Error::MissingTensor(format!("{name} (not a layout name)")))?;
        let mut v = v.clone();
        if let Some(heads) = layout.gguf_permuted_heads(id) {
            v = permute_rows(&v, shape[0], shape[1], heads);
        }
        let dtype = if shape.len() == 2 { spec.dtype } else { DType::F32 };
        let bytes = match dtype {
            DType::F32 => bytemuck::cast_slice(&v).to_vec(),
            DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
            DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
            q => quant::quantize(q, &v),
        };
        let mut code = quant::ggml_type(dtype);
        if shape.len() == 2 && first_matrix {
            code = ov.bogus_type_code.unwrap_or(code);
            first_matrix = false;
        }
        while data.len() % 32 != 0 {
            data.push(0);
        }
        let mut info = s(&id.gguf_name());
        info.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            info.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        info.extend_from_slice(&code.to_le_bytes());
        info.extend_from_slice(&(data.len() as u64).to_le_bytes());
        infos.push(info);
        data.extend(bytes);
    }
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(infos.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in &kv {
        out.extend(s(k));
        out.extend_from_slice(v);
    }
    for i in &infos {
        out.extend_from_slice(i);
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    out.extend(data);
    let mut f = std::fs::File::create(path).map_err(io(path))?;
    f.write_all(&out).map_err(io(path))
}

/// A small Llama config for tests; adjust fields as needed.
pub fn tiny_config() -> ModelConfig {
    ModelConfig {
        architecture: crate::config::Architecture::Llama,
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 4,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 300,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        attention_bias: false,
        max_position_embeddings: 256,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}
