//! Builders for tiny random-weight models, shared by tests across the workspace: Hugging Face directories
//! (safetensors) and GGUF files, from the same weights; and an allocator that bounds what a reader allocates.

pub mod alloc;

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::config::ModelConfig;
use crate::gguf_writer::{self, TensorEntry};
use crate::layout::{LayerTensor, ModelLayout, TensorId};
use crate::loader::gguf::{Value, gguf_row_order};
use crate::quant;
use crate::tensor::{Bytes, DType, HostTensor};
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
                vec_(id, if t.is_norm() { 1.0 } else { 0.0 });
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

/// Overrides for [`write_gguf`], for building malformed files in tests.
#[derive(Debug, Clone, Default)]
pub struct GgufOverrides {
    /// Write this ggml type code for the first matrix instead of the real one.
    pub bogus_type_code: Option<u32>,
}

/// Writes a GGUF of the config's llama.cpp architecture with a byte-level BPE tokenizer over single bytes.
pub fn write_gguf(path: &Path, spec: &TinySpec, weights: &Weights, ov: &GgufOverrides) -> Result<()> {
    let c = &spec.config;
    let mut md = crate::convert::gguf_metadata(c);
    md.extend(crate::convert::byte_vocabulary(c.vocab_size));
    // A second stop id is written as the end-of-turn token, as chat models' GGUFs carry it.
    for (key, id) in ["eos_token_id", "eot_token_id"].iter().zip(&c.eos_token_ids) {
        md.push((format!("tokenizer.ggml.{key}"), Value::U64((*id).into())));
    }
    let layout = ModelLayout::new(c);
    let mut ids = Vec::with_capacity(weights.len());
    let mut entries = Vec::with_capacity(weights.len());
    for (name, (shape, _)) in weights {
        let id =
            TensorId::from_hf_name(name).ok_or_else(|| Error::MissingTensor(format!("{name} (not a layout name)")))?;
        let dtype = if shape.len() == 2 { spec.dtype } else { DType::F32 };
        let mut e = TensorEntry::new(id.gguf_name(), shape.clone(), dtype);
        if shape.len() == 2 && entries.iter().all(|e: &TensorEntry| e.shape.len() != 2) {
            e.ggml_type = ov.bogus_type_code.unwrap_or(e.ggml_type);
        }
        ids.push((id, name));
        entries.push(e);
    }
    // RoPE scaling as llama.cpp's converter writes it for Llama.
    let rope_bytes = crate::convert::rope_freqs_tensor(c).map(|(entry, bytes)| {
        entries.push(entry);
        bytes
    });
    gguf_writer::write(path, &md, &entries, |i| {
        if let Some(bytes) = rope_bytes.as_ref().filter(|_| i == ids.len()) {
            return Ok(Bytes::owned(bytes));
        }
        let ((id, name), e) = (ids[i], &entries[i]);
        let (shape, v) = &weights[name];
        let t = HostTensor::from_f32(shape.clone(), v);
        let mut t =
            if e.dtype.is_quantized() { quant::quantize_tensor(name, &t, e.dtype)? } else { t.convert(e.dtype) };
        if let Some(heads) = layout.gguf_permuted_heads(id) {
            t = t.permute_rows(&gguf_row_order(shape[0], heads));
        }
        Ok(t.bytes)
    })
}

/// The block formats the CUDA backend has kernels for (`strata_kernels::QUANT` and `EMBEDDING`), the one list the
/// tests share: `backend::cuda::quant`'s unit tests check that each has every kernel and every other format is
/// refused, `engine/tests/kernel_layouts.rs` checks their layout code, `engine/tests/cuda.rs` runs them on a GPU.
pub const CUDA_FORMATS: [DType; 10] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

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
        rope_freq_factors: None,
        tie_word_embeddings: false,
        attention_bias: false,
        max_position_embeddings: 256,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}
