//! Builders for tiny random-weight models, shared by tests across the workspace: Hugging Face directories
//! (safetensors) and GGUF files, from the same weights.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use half::{bf16, f16};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::config::ModelConfig;
use crate::tensor::{DType, QK};
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
    let (h, q, kv, i) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    mat(&mut rng, "model.embed_tokens.weight".into(), c.vocab_size, h);
    if !c.tie_word_embeddings {
        mat(&mut rng, "lm_head.weight".into(), c.vocab_size, h);
    }
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        mat(&mut rng, format!("{p}.self_attn.q_proj.weight"), q, h);
        mat(&mut rng, format!("{p}.self_attn.k_proj.weight"), kv, h);
        mat(&mut rng, format!("{p}.self_attn.v_proj.weight"), kv, h);
        mat(&mut rng, format!("{p}.self_attn.o_proj.weight"), h, q);
        mat(&mut rng, format!("{p}.mlp.gate_proj.weight"), i, h);
        mat(&mut rng, format!("{p}.mlp.up_proj.weight"), i, h);
        mat(&mut rng, format!("{p}.mlp.down_proj.weight"), h, i);
    }
    let mut vec_ = |name: String, n: usize, around: f32| {
        let v = (0..n).map(|_| around + rng.random_range(-0.1f32..0.1)).collect();
        w.insert(name, (vec![n], v));
    };
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        vec_(format!("{p}.input_layernorm.weight"), h, 1.0);
        vec_(format!("{p}.post_attention_layernorm.weight"), h, 1.0);
        if c.attention_bias {
            vec_(format!("{p}.self_attn.q_proj.bias"), q, 0.0);
            vec_(format!("{p}.self_attn.k_proj.bias"), kv, 0.0);
            vec_(format!("{p}.self_attn.v_proj.bias"), kv, 0.0);
        }
    }
    vec_("model.norm.weight".into(), h, 1.0);
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

/// Quantizes a row-major matrix into GGML blocks of `dtype` (Q8_0, Q4_0 or Q4_1), the way llama.cpp does.
pub fn quantize(dtype: DType, v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in v.chunks_exact(QK) {
        match dtype {
            DType::Q8_0 => {
                let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = amax / 127.0;
                let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|x| ((x * id).round() as i8) as u8));
            }
            DType::Q4_0 => {
                let max = b.iter().fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |x: f32| ((x * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
            DType::Q4_1 => {
                let (min, max) = b.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |x: f32| (((x - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
            other => panic!("quantize: {other} is not a block type"),
        }
    }
    out
}

fn ggml_code(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 8,
        DType::BF16 => 30,
    }
}

fn gguf_name(hf: &str) -> String {
    hf.replace("model.embed_tokens", "token_embd")
        .replace("model.norm", "output_norm")
        .replace("lm_head", "output")
        .replace("model.layers.", "blk.")
        .replace("input_layernorm", "attn_norm")
        .replace("post_attention_layernorm", "ffn_norm")
        .replace("self_attn.q_proj", "attn_q")
        .replace("self_attn.k_proj", "attn_k")
        .replace("self_attn.v_proj", "attn_v")
        .replace("self_attn.o_proj", "attn_output")
        .replace("mlp.gate_proj", "ffn_gate")
        .replace("mlp.up_proj", "ffn_up")
        .replace("mlp.down_proj", "ffn_down")
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
    for (name, (shape, v)) in weights {
        let mut v = v.clone();
        if name.ends_with("q_proj.weight") {
            v = permute_rows(&v, shape[0], shape[1], c.num_heads);
        } else if name.ends_with("k_proj.weight") {
            v = permute_rows(&v, shape[0], shape[1], c.num_kv_heads);
        }
        let dtype = if shape.len() == 2 { spec.dtype } else { DType::F32 };
        let bytes = match dtype {
            DType::F32 => bytemuck::cast_slice(&v).to_vec(),
            DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
            DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
            q => quantize(q, &v),
        };
        let mut code = ggml_code(dtype);
        if shape.len() == 2 && first_matrix {
            code = ov.bogus_type_code.unwrap_or(code);
            first_matrix = false;
        }
        while data.len() % 32 != 0 {
            data.push(0);
        }
        let mut info = s(&gguf_name(name));
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
