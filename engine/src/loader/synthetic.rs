//! Models whose weights are generated on demand from a seed (`--model random:<preset>`): the shape of a real
//! model without its files. Benchmarks use it to measure a 7B layout without first writing 13 GB of random
//! safetensors; generation runs in parallel and writes the storage type directly.

use std::sync::Arc;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::config::{Architecture, ModelConfig};
use crate::layout::{ModelLayout, TensorId};
use crate::tensor::{Bytes, DType, HostTensor};
use crate::{Error, Result};

/// Prefix of a synthetic model's path.
pub const PREFIX: &str = "random:";

/// Elements generated per parallel task (keeps tasks coarse enough to amortise scheduling).
const CHUNK: usize = 1 << 16;

/// A model made of seeded random weights.
#[derive(Debug, Clone)]
pub struct SyntheticSource {
    config: ModelConfig,
    dtype: DType,
    seed: u64,
}

/// The layouts `random:<preset>` knows, by name.
pub fn preset(name: &str) -> Option<ModelConfig> {
    let base = ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 4096,
        intermediate_size: 11008,
        num_layers: 32,
        num_heads: 32,
        num_kv_heads: 32,
        head_dim: 128,
        vocab_size: 32000,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        rope_freq_factors: None,
        tie_word_embeddings: false,
        attention_bias: false,
        max_position_embeddings: 4096,
        bos_token_id: None,
        eos_token_ids: vec![],
    };
    Some(match name {
        // Llama-2-7B's shape.
        "7b" => base,
        // TinyLlama-1.1B's shape (GQA 32/4): ~2.2 GB in f16, the memory benchmark's model.
        "tinyllama" => ModelConfig {
            hidden_size: 2048,
            intermediate_size: 5632,
            num_layers: 22,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 64,
            max_position_embeddings: 2048,
            ..base
        },
        // SmolLM2-135M's shape.
        "smollm2" => ModelConfig {
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            vocab_size: 49152,
            tie_word_embeddings: true,
            rope_theta: 100000.0,
            max_position_embeddings: 8192,
            ..base
        },
        // Small enough for unit tests, with a head width the GPU attention kernels support.
        "tiny" => ModelConfig {
            hidden_size: 128,
            intermediate_size: 256,
            num_layers: 4,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 64,
            vocab_size: 512,
            max_position_embeddings: 512,
            ..base
        },
        _ => return None,
    })
}

impl SyntheticSource {
    /// Parses `random:<preset>[:<dtype>]` (presets: `7b`, `tinyllama`, `smollm2`, `tiny`; dtype `f32` unless given).
    pub fn open(spec: &str) -> Result<Self> {
        let rest = spec.strip_prefix(PREFIX).unwrap_or(spec);
        let (name, dtype) = match rest.split_once(':') {
            Some((name, d)) => {
                let dtype = DType::parse(d).ok_or_else(|| Error::Config(format!("{spec:?}: unknown dtype {d:?}")))?;
                (name, dtype)
            }
            None => (rest, DType::F32),
        };
        Self::new(name, dtype, 0)
    }

    /// The preset `name` with matrices generated as `dtype` from `seed`.
    pub fn new(name: &str, dtype: DType, seed: u64) -> Result<Self> {
        let spec = format!("{PREFIX}{name}");
        let config = preset(name).ok_or_else(|| {
            Error::Config(format!(
                "unknown synthetic model {spec:?} (known: random:7b, random:tinyllama, random:smollm2, random:tiny)"
            ))
        })?;
        if dtype.is_quantized() {
            return Err(Error::Config(format!("synthetic models are generated as f32, f16 or bf16, not {dtype}")));
        }
        Ok(SyntheticSource { config, dtype, seed })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Shape and storage type of a tensor, if the model has it: matrices in the model's type, vectors f32.
    pub fn meta(&self, name: &str) -> Option<(DType, Vec<usize>)> {
        let layout = ModelLayout::new(&self.config);
        let id = TensorId::from_hf_name(name).filter(|&id| layout.contains(id))?;
        Some((if id.is_matrix() { self.dtype } else { DType::F32 }, layout.shape(id)))
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.meta(name).is_some()
    }

    /// Generates a tensor: norms uniform in 1 ± 0.1, matrices uniform in ±0.02 (about a trained model's scale,
    /// so activations stay finite through many layers). The same name and seed always give the same values.
    pub fn tensor(&self, name: &str) -> Result<HostTensor> {
        let (dtype, shape) = self.meta(name).ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        let (center, scale) = if shape.len() == 1 { (1.0, 0.1) } else { (0.0, 0.02) };
        let n: usize = shape.iter().product();
        let bytes = generate(dtype, n, self.seed ^ fnv1a(name.as_bytes()), center, scale);
        HostTensor::new(name, dtype, shape, bytes)
    }
}

/// 64-bit FNV-1a, to derive a per-tensor seed from its name.
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// splitmix64: a fast, well-mixed generator; one stream per chunk so chunks are independent of scheduling.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn generate(dtype: DType, n: usize, seed: u64, center: f32, scale: f32) -> Bytes {
    let elem = dtype.block_bytes();
    let len = n * elem;
    let mut words = vec![0u32; len.div_ceil(4)];
    let bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..len];
    bytes.par_chunks_mut(CHUNK * elem).enumerate().for_each(|(ci, chunk)| {
        let mut state = seed ^ (ci as u64).wrapping_mul(0xd6e8_feb8_6659_fd93);
        for out in chunk.chunks_exact_mut(elem) {
            // 24 random bits -> uniform in [-1, 1).
            let u = (splitmix(&mut state) >> 40) as f32 / (1u32 << 23) as f32 - 1.0;
            let x = center + scale * u;
            match dtype {
                DType::F16 => out.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
                DType::BF16 => out.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
                _ => out.copy_from_slice(&x.to_le_bytes()),
            }
        }
    });
    Bytes::Owned { words: Arc::new(words), len }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_every_tensor_of_their_layout() -> Result<()> {
        let s = SyntheticSource::open("random:tiny:bf16")?;
        let c = s.config().clone();
        assert_eq!(c.head_dim, 64);
        let t = s.tensor("model.layers.3.mlp.down_proj.weight")?;
        assert_eq!((t.dtype, t.shape.clone()), (DType::BF16, vec![c.hidden_size, c.intermediate_size]));
        assert!(s.contains("lm_head.weight"));
        assert!(!s.contains("model.layers.4.mlp.down_proj.weight"));
        assert!(s.tensor("model.layers.0.nope").is_err());
        assert!(SyntheticSource::open("random:13b").is_err());
        assert!(SyntheticSource::open("random:tiny:q8_0").is_err());
        assert!(SyntheticSource::open("random:tiny:f64").is_err());
        let big = preset("7b").map(|c| (c.hidden_size, c.num_layers));
        assert_eq!(big, Some((4096, 32)));
        Ok(())
    }

    #[test]
    fn values_are_deterministic_and_in_range() -> Result<()> {
        let s = SyntheticSource::new("tiny", DType::F32, 1)?;
        let a = s.tensor("model.embed_tokens.weight")?.to_f32();
        let b = s.tensor("model.embed_tokens.weight")?.to_f32();
        assert_eq!(a, b);
        assert!(a.iter().all(|x| x.abs() <= 0.02));
        let spread = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(spread > 0.015, "values should fill the range, max |x| = {spread}");
        let norm = s.tensor("model.norm.weight")?.to_f32();
        assert!(norm.iter().all(|x| (0.9..=1.1).contains(x)));
        let other = SyntheticSource::new("tiny", DType::F32, 2)?.tensor("model.embed_tokens.weight")?;
        assert_ne!(a, other.to_f32(), "the seed changes the weights");
        Ok(())
    }
}
