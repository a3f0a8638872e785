//! Model hyper-parameters, read from a Hugging Face `config.json` or GGUF metadata.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The decoder families this engine runs; they share one forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// `LlamaForCausalLM` (also GGUF `llama`).
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM` (q/k/v projections carry a bias).
    Qwen2,
    /// `Qwen3ForCausalLM` (an RMSNorm on each query and key head before RoPE; no q/k/v bias by default).
    Qwen3,
}

impl Architecture {
    /// Every architecture, in the order error messages list them.
    pub const ALL: [Architecture; 4] =
        [Architecture::Llama, Architecture::Mistral, Architecture::Qwen2, Architecture::Qwen3];

    /// The Hugging Face class name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The Hugging Face `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }

    /// The GGUF `general.architecture` (llama.cpp's name). Mistral has none of its own: llama.cpp's converter
    /// writes Mistral models as `llama`.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama | Architecture::Mistral => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }

    /// Whether llama.cpp's converter interleaves the rows of each query and key head for its RoPE. It does so
    /// only for `llama` (rotating adjacent pairs); qwen2 and qwen3 run NEOX-style RoPE in llama.cpp, which
    /// rotates halves as Hugging Face does, so their GGUF rows keep Hugging Face's order.
    pub fn gguf_permutes_qk(self) -> bool {
        self.gguf_name() == "llama"
    }

    /// Whether a GGUF file of this architecture is read with q/k/v biases, given whether it holds them:
    /// llama.cpp's qwen2 always has them (its loader requires them); `llama` and qwen3 files when their model does
    /// (llama.cpp loads them if present; a `llama` file's q and k biases are interleaved per head like the rows).
    pub fn gguf_attention_bias(self, file_has_bias: bool) -> bool {
        match self {
            Architecture::Qwen2 => true,
            Architecture::Llama | Architecture::Mistral | Architecture::Qwen3 => file_has_bias,
        }
    }

    /// Whether each query and key head goes through its own RMSNorm before RoPE (`q_norm`, `k_norm`).
    pub fn has_qk_norm(self) -> bool {
        self == Architecture::Qwen3
    }

    /// Parses a Hugging Face class name.
    pub fn from_hf_name(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|a| a.hf_name() == name).ok_or_else(|| Error::UnsupportedArchitecture {
            name: name.to_string(),
            supported: Self::ALL.map(Self::hf_name).join(", "),
        })
    }

    /// Parses a GGUF `general.architecture`; `llama` maps to [`Architecture::Llama`].
    pub fn from_gguf_name(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|a| a.gguf_name() == name).ok_or_else(|| {
            let mut names: Vec<&str> = Self::ALL.map(Self::gguf_name).to_vec();
            names.dedup();
            Error::UnsupportedArchitecture {
                name: format!("gguf:{name}"),
                supported: format!("gguf:{}", names.join(", gguf:")),
            }
        })
    }
}

/// `rope_scaling` of type `llama3`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    /// Overall context extension factor.
    pub factor: f64,
    /// Wavelengths above `original_max / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max / high_freq_factor` are left alone.
    pub high_freq_factor: f64,
    /// Context length the model was trained with.
    pub original_max_position_embeddings: f64,
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Decoder family.
    pub architecture: Architecture,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Number of transformer layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional llama3 RoPE frequency scaling.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Per-frequency RoPE divisors (`head_dim / 2` of them): inverse frequency `j` is divided by entry `j`. This is
    /// how llama.cpp's GGUFs carry RoPE scaling (`rope_freqs.weight` for llama3, a constant for linear).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Whether `lm_head` reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry a bias.
    pub attention_bias: bool,
    /// Longest context the model supports. For a model whose attention looks back over a sliding window, at most
    /// the window: strata attends to every earlier position, which is the same as the window only inside it.
    pub max_position_embeddings: usize,
    /// Beginning-of-sequence token, when the model has one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens.
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    max_position_embeddings: Option<usize>,
    /// Absent and `null` differ: absent takes transformers' default window, `null` is full attention.
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    hidden_act: Option<String>,
}

/// A key that is present, `null` included (a plain `Option` reads `null` as absent).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

fn ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// How many positions a query of this model attends to (`usize::MAX`: all earlier ones), as transformers reads the
/// config: Mistral looks back over `sliding_window` positions (4,096 when the key is absent, every position when it is
/// `null`); Qwen2 and Qwen3 only with `use_sliding_window` (there on the upper layers, which does not matter here:
/// inside the window every layer attends to everything). Llama has no window.
fn sliding_window(raw: &HfConfig, architecture: Architecture) -> Result<usize> {
    const TRANSFORMERS_DEFAULT: usize = 4096;
    let applies = match architecture {
        Architecture::Mistral => true,
        Architecture::Qwen2 | Architecture::Qwen3 => raw.use_sliding_window == Some(true),
        Architecture::Llama => false,
    };
    match (&raw.sliding_window, applies) {
        (_, false) | (Some(serde_json::Value::Null), true) => Ok(usize::MAX),
        (None, true) => Ok(TRANSFORMERS_DEFAULT),
        (Some(v), true) => match v.as_u64() {
            Some(w) if w > 0 => Ok(usize::try_from(w).unwrap_or(usize::MAX)),
            _ => Err(Error::Config(format!("sliding_window {v} is not a positive integer or null"))),
        },
    }
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let raw: HfConfig = serde_json::from_str(text).map_err(|e| Error::Config(format!("config.json: {e}")))?;
        let arch_name = match (&raw.architectures, &raw.model_type) {
            (Some(a), _) if !a.is_empty() => a[0].clone(),
            (_, Some(t)) => Architecture::ALL
                .into_iter()
                .find(|a| a.model_type() == t)
                .map_or_else(|| t.clone(), |a| a.hf_name().to_string()),
            _ => return Err(Error::Config("config.json names no architecture".into())),
        };
        let architecture = Architecture::from_hf_name(&arch_name)?;
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(Error::Config(format!("hidden_act {act:?} is not supported (only silu)")));
        }
        let rope_scaling = match &raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("");
                match kind {
                    "llama3" => {
                        let num = |k: &str| {
                            v.get(k)
                                .and_then(|x| x.as_f64())
                                .ok_or_else(|| Error::Config(format!("rope_scaling.{k} missing")))
                        };
                        Some(Llama3RopeScaling {
                            factor: num("factor")?,
                            low_freq_factor: num("low_freq_factor")?,
                            high_freq_factor: num("high_freq_factor")?,
                            original_max_position_embeddings: num("original_max_position_embeddings")?,
                        })
                    }
                    "default" => None,
                    other => {
                        return Err(Error::Config(format!("rope_scaling type {other:?} is not supported")));
                    }
                }
            }
        };
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1));
        let cfg = ModelConfig {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(10000.0),
            rope_scaling,
            rope_freq_factors: None,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            // Qwen2 always has q/k/v biases (its config rarely says so); Qwen3 says `attention_bias` when it has them.
            attention_bias: raw.attention_bias.unwrap_or(architecture == Architecture::Qwen2),
            max_position_embeddings: raw
                .max_position_embeddings
                .unwrap_or(4096)
                .min(sliding_window(&raw, architecture)?),
            bos_token_id: ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: ids(&raw.eos_token_id),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the shape parameters are consistent.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.hidden_size == 0 || self.num_layers == 0 || self.num_heads == 0 || self.vocab_size == 0 {
            return bad("hidden_size, num_hidden_layers, num_attention_heads and vocab_size must be positive".into());
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even and positive", self.head_dim));
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.head_dim / 2 {
                return bad(format!(
                    "{} RoPE frequency factors for head_dim {} (expected {})",
                    f.len(),
                    self.head_dim,
                    self.head_dim / 2
                ));
            }
            if let Some(x) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                return bad(format!("RoPE frequency factor {x} is not a positive finite number"));
            }
        }
        // Every matrix widened to f32 must be addressable, so that no size computed from the config overflows.
        let q_dim = self.num_heads.checked_mul(self.head_dim);
        let widest = q_dim.map(|q| q.max(self.vocab_size).max(self.intermediate_size));
        if widest.and_then(|w| w.checked_mul(self.hidden_size)).and_then(|n| n.checked_mul(4)).is_none() {
            return bad(format!(
                "hidden_size {}, intermediate_size {}, vocab_size {} and {} heads of {} make matrices too large to address",
                self.hidden_size, self.intermediate_size, self.vocab_size, self.num_heads, self.head_dim
            ));
        }
        Ok(())
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// RoPE inverse frequencies (`head_dim / 2` of them), divided by [`ModelConfig::rope_divisors`].
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let divisors = self.rope_divisors();
        (0..self.head_dim / 2)
            .map(|j| (self.rope_base_inv_freq(j) / divisors.as_ref().map_or(1.0, |d| d[j])) as f32)
            .collect()
    }

    /// What each RoPE inverse frequency is divided by: llama3 scaling's factor for it (the values llama.cpp's
    /// converter writes into a GGUF's `rope_freqs.weight`) times `rope_freq_factors`; None for a model without
    /// scaling.
    pub fn rope_divisors(&self) -> Option<Vec<f64>> {
        if self.rope_scaling.is_none() && self.rope_freq_factors.is_none() {
            return None;
        }
        let divisors = (0..self.head_dim / 2).map(|j| {
            let llama3 = self.rope_scaling.as_ref().map_or(1.0, |s| {
                let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                let wavelen = 2.0 * std::f64::consts::PI / self.rope_base_inv_freq(j);
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    s.factor
                } else {
                    // Between the two, the frequency blends `base / factor` and `base` by `smooth`.
                    let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    1.0 / ((1.0 - smooth) / s.factor + smooth)
                }
            });
            llama3 * self.rope_freq_factors.as_ref().map_or(1.0, |f| f64::from(f[j]))
        });
        Some(divisors.collect())
    }

    fn rope_base_inv_freq(&self, j: usize) -> f64 {
        self.rope_theta.powf(-(2.0 * j as f64) / self.head_dim as f64)
    }

    /// Renders this config as a Hugging Face `config.json` value.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [self.architecture.hf_name()],
            "model_type": self.architecture.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            // Any window is already in `max_position_embeddings`; absent, transformers would assume one for Mistral.
            "sliding_window": null,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
        });
        if let Some(s) = &self.rope_scaling {
            v["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama_with_gqa_and_defaults() {
        let cfg = ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
            "eos_token_id":[1,2]}"#,
        )
        .expect("valid config");
        assert_eq!(cfg.head_dim, 16);
        assert_eq!(cfg.kv_dim(), 32);
        assert_eq!(cfg.eos_token_ids, vec![1, 2]);
        assert!(!cfg.attention_bias);
    }

    #[test]
    fn rejects_unknown_architecture_by_name() {
        let err = ModelConfig::from_hf_json(
            r#"{"architectures":["GPTNeoXForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100}"#,
        )
        .expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.contains("GPTNeoXForCausalLM"), "{msg}");
        for arch in Architecture::ALL {
            assert!(msg.contains(arch.hf_name()), "{msg} should list {}", arch.hf_name());
        }
    }

    #[test]
    fn gguf_names_map_to_architectures_and_others_are_refused() {
        assert_eq!(Architecture::from_gguf_name("llama").ok(), Some(Architecture::Llama));
        assert_eq!(Architecture::from_gguf_name("qwen2").ok(), Some(Architecture::Qwen2));
        assert_eq!(Architecture::from_gguf_name("qwen3").ok(), Some(Architecture::Qwen3));
        assert_eq!(Architecture::Mistral.gguf_name(), "llama", "llama.cpp writes Mistral models as llama");
        for other in ["mistral", "gemma2", ""] {
            let msg = Architecture::from_gguf_name(other).expect_err("must fail").to_string();
            assert!(msg.contains(&format!("\"gguf:{other}\"")), "{msg}");
            assert!(msg.contains("gguf:llama, gguf:qwen2, gguf:qwen3"), "{msg}");
        }
        assert!(Architecture::Llama.gguf_permutes_qk() && Architecture::Mistral.gguf_permutes_qk());
        assert!(!Architecture::Qwen2.gguf_permutes_qk() && !Architecture::Qwen3.gguf_permutes_qk());
    }

    #[test]
    fn parses_qwen3_with_explicit_head_dim_and_no_bias() {
        let text = r#"{"model_type":"qwen3","hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":100,"tie_word_embeddings":false}"#;
        let cfg = ModelConfig::from_hf_json(text).expect("valid config");
        assert_eq!(cfg.architecture, Architecture::Qwen3);
        assert!(cfg.architecture.has_qk_norm());
        assert_eq!((cfg.head_dim, cfg.q_dim(), cfg.kv_dim()), (16, 64, 32));
        assert!(!cfg.attention_bias, "Qwen3 has no q/k/v bias unless its config says so");
        let with_bias = text.replace("\"head_dim\"", "\"attention_bias\":true,\"head_dim\"");
        assert!(ModelConfig::from_hf_json(&with_bias).expect("valid config").attention_bias);
        let back = ModelConfig::from_hf_json(&cfg.to_hf_json().to_string()).expect("round trip");
        assert_eq!(back, cfg);
    }

    #[test]
    fn a_sliding_window_caps_the_context_where_transformers_applies_it() {
        let context = |arch: &str, extra: &str| {
            let text = format!(
                r#"{{"architectures":["{arch}"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
                "num_attention_heads":4,"vocab_size":100,"max_position_embeddings":32768{extra}}}"#
            );
            ModelConfig::from_hf_json(&text).map(|c| c.max_position_embeddings)
        };
        // Mistral 7B v0.1 looks back 4,096 positions; v0.2 and later say null.
        assert_eq!(context("MistralForCausalLM", r#","sliding_window":4096"#).ok(), Some(4096));
        assert_eq!(context("MistralForCausalLM", r#","sliding_window":null"#).ok(), Some(32768));
        assert_eq!(context("MistralForCausalLM", "").ok(), Some(4096), "transformers' default window");
        // Qwen configs name a window and switch it off.
        assert_eq!(
            context("Qwen2ForCausalLM", r#","sliding_window":131072,"use_sliding_window":false"#).ok(),
            Some(32768)
        );
        assert_eq!(context("Qwen3ForCausalLM", r#","sliding_window":1024,"use_sliding_window":true"#).ok(), Some(1024));
        assert_eq!(context("LlamaForCausalLM", r#","sliding_window":1024"#).ok(), Some(32768), "Llama has no window");
        for bad in [r#","sliding_window":0"#, r#","sliding_window":"4k""#, r#","sliding_window":-1"#] {
            let msg = context("MistralForCausalLM", bad).expect_err(bad).to_string();
            assert!(msg.contains("sliding_window"), "{msg}");
        }
        // A converted config keeps its (capped) context and reads back the same.
        let cfg = ModelConfig::from_hf_json(
            r#"{"architectures":["MistralForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"vocab_size":100,"max_position_embeddings":32768,"sliding_window":null}"#,
        )
        .expect("valid config");
        let back = ModelConfig::from_hf_json(&cfg.to_hf_json().to_string()).expect("round trip");
        assert_eq!(back, cfg);
    }

    #[test]
    fn rejects_heads_not_divisible() {
        let err = ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":3,"vocab_size":100}"#,
        )
        .expect_err("must fail");
        assert!(err.to_string().contains("num_key_value_heads"), "{err}");
    }

    #[test]
    fn rejects_dimensions_whose_matrices_overflow() {
        let config = |heads: u64, head_dim: u64, hidden: u64| {
            format!(
                r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{hidden},"intermediate_size":8,
                "num_hidden_layers":1,"num_attention_heads":{heads},"head_dim":{head_dim},"vocab_size":8}}"#
            )
        };
        // q_dim = heads * head_dim overflows; then q_dim fits but q_dim * hidden_size does not.
        for (heads, head_dim, hidden) in [(1 << 33, 1 << 32, 8), (1 << 20, 1 << 20, 1 << 30)] {
            let err = ModelConfig::from_hf_json(&config(heads, head_dim, hidden)).expect_err("must fail");
            assert!(err.to_string().contains("too large to address"), "{err}");
        }
        // The largest that fits: every matrix widened to f32 is just addressable.
        let hidden = (usize::MAX / 4 / 8) as u64;
        assert!(ModelConfig::from_hf_json(&config(2, 4, hidden)).is_ok());
        assert!(ModelConfig::from_hf_json(&config(2, 4, hidden + 1)).is_err());
    }

    #[test]
    fn llama3_scaling_keeps_high_freqs_and_divides_low_ones() {
        let mut cfg = ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":1,"num_attention_heads":1,"vocab_size":10,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192}}"#,
        )
        .expect("valid config");
        let scaled = cfg.rope_inv_freq();
        let s = cfg.rope_scaling.expect("llama3 scaling");
        cfg.rope_scaling = None;
        let plain = cfg.rope_inv_freq();
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() <= plain[last] * 1e-6);
        // Every frequency as Hugging Face's `_compute_llama3_parameters` writes it (a blend of the two in between;
        // strata divides by llama.cpp's factor instead, the same number by another route).
        let mut blended = 0;
        for (j, got) in scaled.iter().enumerate() {
            let base = cfg.rope_theta.powf(-(2.0 * j as f64) / cfg.head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / base;
            let want = if wavelen < s.original_max_position_embeddings / s.high_freq_factor {
                base
            } else if wavelen > s.original_max_position_embeddings / s.low_freq_factor {
                base / s.factor
            } else {
                blended += 1;
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * base / s.factor + smooth * base
            };
            assert!((f64::from(*got) - want).abs() <= want * 1e-6, "frequency {j}: {got} against {want}");
        }
        assert!(blended > 0, "no frequency falls between the two wavelengths");
    }
}
