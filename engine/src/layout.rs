//! The one description of a decoder's tensors: their Hugging Face and GGUF names, which ones an architecture
//! has, their shapes from the config, and the bytes a range of layers (or the embeddings, or the head) takes in a
//! given storage type. Loaders, the stage loader and its offload planner, conversion, the test-model writers and
//! the coordinator's placement all read the layout from here.
//!
//! Llama, Mistral, Qwen2 and Qwen3 share one layout. Qwen2 adds q/k/v biases, which the config's
//! `attention_bias` carries (on by default for Qwen2); Qwen3 adds a per-head RMSNorm weight for queries and keys
//! (`q_norm`, `k_norm`, `[head_dim]` each).

use std::ops::Range;

use crate::config::ModelConfig;
use crate::loader::ModelFiles;
use crate::tensor::DType;
use crate::{Error, KvDtype, Result};

/// A tensor of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    /// RMSNorm before attention.
    AttnNorm,
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Query bias (Qwen2).
    QBias,
    /// Key bias (Qwen2).
    KBias,
    /// Value bias (Qwen2).
    VBias,
    /// RMSNorm weight applied to each query head before RoPE (Qwen3), `[head_dim]`.
    QNorm,
    /// RMSNorm weight applied to each key head before RoPE (Qwen3), `[head_dim]`.
    KNorm,
    /// Attention output projection.
    O,
    /// RMSNorm before the MLP.
    MlpNorm,
    /// MLP gate projection.
    Gate,
    /// MLP up projection.
    Up,
    /// MLP down projection.
    Down,
}

impl LayerTensor {
    /// The seven matrices, in the order the forward pass runs them.
    pub const MATRICES: [LayerTensor; 7] = [Self::Q, Self::K, Self::V, Self::O, Self::Gate, Self::Up, Self::Down];
    /// The vectors (norms, biases, then the per-head norms), held as f32 on every backend.
    pub const VECTORS: [LayerTensor; 7] =
        [Self::AttnNorm, Self::MlpNorm, Self::QBias, Self::KBias, Self::VBias, Self::QNorm, Self::KNorm];

    /// Hugging Face and GGUF (llama.cpp) names, after `model.layers.{i}.` and `blk.{i}.`.
    fn leaves(self) -> (&'static str, &'static str) {
        match self {
            Self::AttnNorm => ("input_layernorm.weight", "attn_norm.weight"),
            Self::Q => ("self_attn.q_proj.weight", "attn_q.weight"),
            Self::K => ("self_attn.k_proj.weight", "attn_k.weight"),
            Self::V => ("self_attn.v_proj.weight", "attn_v.weight"),
            Self::QBias => ("self_attn.q_proj.bias", "attn_q.bias"),
            Self::KBias => ("self_attn.k_proj.bias", "attn_k.bias"),
            Self::VBias => ("self_attn.v_proj.bias", "attn_v.bias"),
            Self::QNorm => ("self_attn.q_norm.weight", "attn_q_norm.weight"),
            Self::KNorm => ("self_attn.k_norm.weight", "attn_k_norm.weight"),
            Self::O => ("self_attn.o_proj.weight", "attn_output.weight"),
            Self::MlpNorm => ("post_attention_layernorm.weight", "ffn_norm.weight"),
            Self::Gate => ("mlp.gate_proj.weight", "ffn_gate.weight"),
            Self::Up => ("mlp.up_proj.weight", "ffn_up.weight"),
            Self::Down => ("mlp.down_proj.weight", "ffn_down.weight"),
        }
    }

    fn from_hf_leaf(leaf: &str) -> Option<Self> {
        Self::MATRICES.into_iter().chain(Self::VECTORS).find(|t| t.leaves().0 == leaf)
    }

    fn is_bias(self) -> bool {
        matches!(self, Self::QBias | Self::KBias | Self::VBias)
    }

    /// Whether it is an RMSNorm weight (scales around 1) rather than a bias or matrix.
    pub fn is_norm(self) -> bool {
        matches!(self, Self::AttnNorm | Self::MlpNorm | Self::QNorm | Self::KNorm)
    }

    fn is_head_norm(self) -> bool {
        matches!(self, Self::QNorm | Self::KNorm)
    }
}

/// A tensor of the model, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorId {
    /// Token embeddings `[vocab, hidden]`.
    Embed,
    /// The final RMSNorm.
    FinalNorm,
    /// The output projection `[vocab, hidden]`, when not tied to the embeddings.
    LmHead,
    /// A tensor of layer `.0`.
    Layer(usize, LayerTensor),
}

impl TensorId {
    /// The Hugging Face name (the name every [`ModelFiles`] hands tensors out by).
    pub fn hf_name(self) -> String {
        match self {
            Self::Embed => "model.embed_tokens.weight".into(),
            Self::FinalNorm => "model.norm.weight".into(),
            Self::LmHead => "lm_head.weight".into(),
            Self::Layer(i, t) => format!("model.layers.{i}.{}", t.leaves().0),
        }
    }

    /// The name in a GGUF file (llama.cpp's naming).
    pub fn gguf_name(self) -> String {
        match self {
            Self::Embed => "token_embd.weight".into(),
            Self::FinalNorm => "output_norm.weight".into(),
            Self::LmHead => "output.weight".into(),
            Self::Layer(i, t) => format!("blk.{i}.{}", t.leaves().1),
        }
    }

    /// Parses a Hugging Face name.
    pub fn from_hf_name(name: &str) -> Option<Self> {
        match name {
            "model.embed_tokens.weight" => return Some(Self::Embed),
            "model.norm.weight" => return Some(Self::FinalNorm),
            "lm_head.weight" => return Some(Self::LmHead),
            _ => {}
        }
        let (layer, leaf) = name.strip_prefix("model.layers.")?.split_once('.')?;
        Some(Self::Layer(layer.parse().ok()?, LayerTensor::from_hf_leaf(leaf)?))
    }

    /// Whether it is a matrix (stored in the model's weight type) rather than a norm or bias vector.
    pub fn is_matrix(self) -> bool {
        match self {
            Self::Embed | Self::LmHead => true,
            Self::FinalNorm => false,
            Self::Layer(_, t) => LayerTensor::MATRICES.contains(&t),
        }
    }
}

/// Bytes of the tensors a stage holds, as its device stores them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageBytes {
    /// The matrices of each layer of the range (what offload can move to host memory).
    pub layers: Vec<usize>,
    /// The norms and biases of the range's layers (always resident).
    pub vectors: usize,
    /// The embeddings, when the range starts at layer 0.
    pub embed: usize,
    /// The final norm and head, when the range ends at the last layer (0 for a head tied to embeddings the
    /// stage already holds).
    pub head: usize,
}

impl StageBytes {
    /// Everything but the layers' matrices.
    pub fn fixed(&self) -> usize {
        self.vectors + self.embed + self.head
    }
}

/// The layout of one model.
#[derive(Debug, Clone, Copy)]
pub struct ModelLayout<'a> {
    cfg: &'a ModelConfig,
}

/// Bytes of an f32 element: norms and biases are held as f32 whatever the weights' type.
const F32_BYTES: usize = 4;

impl<'a> ModelLayout<'a> {
    /// The layout `cfg` describes.
    pub fn new(cfg: &'a ModelConfig) -> Self {
        ModelLayout { cfg }
    }

    /// Whether the model has this tensor (by its config alone; see [`Self::head`] for the files' say).
    pub fn contains(&self, id: TensorId) -> bool {
        match id {
            TensorId::Embed | TensorId::FinalNorm => true,
            TensorId::LmHead => !self.cfg.tie_word_embeddings,
            TensorId::Layer(i, t) => {
                i < self.cfg.num_layers
                    && (!t.is_bias() || self.cfg.attention_bias)
                    && (!t.is_head_norm() || self.cfg.architecture.has_qk_norm())
            }
        }
    }

    /// The tensor's shape, outermost first (Hugging Face order: a matrix is `[out, in]`).
    pub fn shape(&self, id: TensorId) -> Vec<usize> {
        let c = self.cfg;
        let (h, q, kv, i) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        match id {
            TensorId::Embed | TensorId::LmHead => vec![c.vocab_size, h],
            TensorId::FinalNorm => vec![h],
            TensorId::Layer(_, t) => match t {
                LayerTensor::AttnNorm | LayerTensor::MlpNorm => vec![h],
                LayerTensor::QBias => vec![q],
                LayerTensor::KBias | LayerTensor::VBias => vec![kv],
                LayerTensor::QNorm | LayerTensor::KNorm => vec![c.head_dim],
                LayerTensor::Q => vec![q, h],
                LayerTensor::K | LayerTensor::V => vec![kv, h],
                LayerTensor::O => vec![h, q],
                LayerTensor::Gate | LayerTensor::Up => vec![i, h],
                LayerTensor::Down => vec![h, i],
            },
        }
    }

    /// The tensors of layer `i` this architecture has, in load order.
    pub fn layer_tensors(&self, i: usize) -> impl Iterator<Item = TensorId> + '_ {
        const LOAD_ORDER: [LayerTensor; 14] = [
            LayerTensor::AttnNorm,
            LayerTensor::Q,
            LayerTensor::K,
            LayerTensor::V,
            LayerTensor::QBias,
            LayerTensor::KBias,
            LayerTensor::VBias,
            LayerTensor::QNorm,
            LayerTensor::KNorm,
            LayerTensor::O,
            LayerTensor::MlpNorm,
            LayerTensor::Gate,
            LayerTensor::Up,
            LayerTensor::Down,
        ];
        LOAD_ORDER.into_iter().map(move |t| TensorId::Layer(i, t)).filter(|&id| self.contains(id))
    }

    /// Every tensor of the model.
    pub fn tensors(&self) -> Vec<TensorId> {
        let mut all = vec![TensorId::Embed, TensorId::FinalNorm];
        if self.contains(TensorId::LmHead) {
            all.push(TensorId::LmHead);
        }
        for i in 0..self.cfg.num_layers {
            all.extend(self.layer_tensors(i));
        }
        all
    }

    /// Rows of a GGUF tensor that llama.cpp interleaved per head for its RoPE: the head count for the query and
    /// key projections, and their biases' elements, of an architecture whose converter permutes them (see
    /// [`Architecture::gguf_permutes_qk`]).
    ///
    /// [`Architecture::gguf_permutes_qk`]: crate::config::Architecture::gguf_permutes_qk
    pub fn gguf_permuted_heads(&self, id: TensorId) -> Option<usize> {
        if !self.cfg.architecture.gguf_permutes_qk() {
            return None;
        }
        match id {
            TensorId::Layer(_, LayerTensor::Q | LayerTensor::QBias) => Some(self.cfg.num_heads),
            TensorId::Layer(_, LayerTensor::K | LayerTensor::KBias) => Some(self.cfg.num_kv_heads),
            _ => None,
        }
    }

    /// The matrix the head multiplies by: `lm_head`, or the embeddings when tied or when the files lack it.
    pub fn head(&self, files: &ModelFiles) -> TensorId {
        if self.contains(TensorId::LmHead) && files.contains(&TensorId::LmHead.hf_name()) {
            TensorId::LmHead
        } else {
            TensorId::Embed
        }
    }

    /// Bytes of a tensor of `files` stored as `storage` maps its file type (from metadata; nothing is read).
    /// Quantized tensors count at their quantized size.
    pub fn tensor_bytes(&self, files: &ModelFiles, id: TensorId, storage: &dyn Fn(DType) -> DType) -> Result<usize> {
        let name = id.hf_name();
        let (dtype, shape) = files.tensor_meta(&name)?;
        let n: usize = shape.iter().product();
        let dtype = storage(dtype);
        dtype.bytes_for(n).ok_or_else(|| Error::Shape {
            op: "layout",
            reason: format!("tensor {name:?}: {n} elements are not whole blocks of {dtype}"),
        })
    }

    /// Bytes of layer `i`'s matrices.
    pub fn layer_matrix_bytes(&self, files: &ModelFiles, i: usize, storage: &dyn Fn(DType) -> DType) -> Result<usize> {
        LayerTensor::MATRICES.iter().map(|&t| self.tensor_bytes(files, TensorId::Layer(i, t), storage)).sum()
    }

    /// Bytes of one layer's norms and biases (f32).
    pub fn layer_vector_bytes(&self) -> usize {
        let elems: usize = LayerTensor::VECTORS
            .iter()
            .map(|&t| TensorId::Layer(0, t))
            .filter(|&id| self.contains(id))
            .map(|id| self.shape(id).iter().product::<usize>())
            .sum();
        elems * F32_BYTES
    }

    /// Bytes of the embeddings.
    pub fn embed_bytes(&self, files: &ModelFiles, storage: &dyn Fn(DType) -> DType) -> Result<usize> {
        self.tensor_bytes(files, TensorId::Embed, storage)
    }

    /// Bytes of the final norm and head; a head tied to the embeddings costs nothing more on a stage that
    /// `holds_embed`.
    pub fn head_bytes(&self, files: &ModelFiles, storage: &dyn Fn(DType) -> DType, holds_embed: bool) -> Result<usize> {
        let norm = self.cfg.hidden_size * F32_BYTES;
        let matrix = match self.head(files) {
            TensorId::Embed if holds_embed => 0,
            head => self.tensor_bytes(files, head, storage)?,
        };
        Ok(norm + matrix)
    }

    /// Bytes of everything a stage holding layers `range` loads.
    pub fn stage_bytes(
        &self,
        files: &ModelFiles,
        range: &Range<usize>,
        storage: &dyn Fn(DType) -> DType,
    ) -> Result<StageBytes> {
        let layers = range.clone().map(|i| self.layer_matrix_bytes(files, i, storage)).collect::<Result<Vec<_>>>()?;
        let first = range.start == 0;
        let embed = if first { self.embed_bytes(files, storage)? } else { 0 };
        let head = if range.end == self.cfg.num_layers { self.head_bytes(files, storage, first)? } else { 0 };
        Ok(StageBytes { layers, vectors: range.len() * self.layer_vector_bytes(), embed, head })
    }

    /// KV cache bytes one token takes in one layer (keys and values) stored as `dtype`.
    pub fn kv_bytes_per_token_layer(&self, dtype: KvDtype) -> Result<usize> {
        dtype.bytes_per_token_layer(self.cfg.kv_dim())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Architecture;
    use crate::testing::tiny_config;

    #[test]
    fn stage_bytes_follow_the_range_and_the_storage_type() -> Result<()> {
        // random:tiny: hidden 128, MLP 256, 4 layers, q 128, kv 64, vocab 512, untied head; bf16 matrices.
        let files = ModelFiles::open(Path::new("random:tiny:bf16"))?;
        let layout = ModelLayout::new(files.config());
        let layer_elems = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128;
        let first = layout.stage_bytes(&files, &(0..2), &|d| d)?;
        let expected =
            StageBytes { layers: vec![layer_elems * 2; 2], vectors: 2 * 2 * 128 * 4, embed: 512 * 128 * 2, head: 0 };
        assert_eq!(first, expected);
        let last = layout.stage_bytes(&files, &(2..4), &|_| DType::F32)?;
        let expected =
            StageBytes { layers: vec![layer_elems * 4; 2], vectors: 2048, embed: 0, head: (128 + 512 * 128) * 4 };
        assert_eq!(last, expected);
        assert_eq!(last.fixed(), 2048 + (128 + 512 * 128) * 4);
        // random:smollm2 ties its head: free beside the embeddings, the embeddings' size without them.
        let files = ModelFiles::open(Path::new("random:smollm2"))?;
        let layout = ModelLayout::new(files.config());
        let embed = 49152 * 576 * 4;
        assert_eq!(layout.stage_bytes(&files, &(0..30), &|d| d)?.head, 576 * 4);
        assert_eq!(layout.stage_bytes(&files, &(29..30), &|d| d)?.head, 576 * 4 + embed);
        assert_eq!(layout.head_bytes(&files, &|d| d, false)?, 576 * 4 + embed);
        Ok(())
    }

    #[test]
    fn names_round_trip_and_map_to_gguf() {
        let mut cfg = tiny_config();
        cfg.attention_bias = true;
        let layout = ModelLayout::new(&cfg);
        let all = layout.tensors();
        assert_eq!(all.len(), 3 + cfg.num_layers * 12);
        for id in all {
            assert_eq!(TensorId::from_hf_name(&id.hf_name()), Some(id));
        }
        let down = TensorId::from_hf_name("model.layers.12.mlp.down_proj.weight");
        assert_eq!(down.map(TensorId::gguf_name).as_deref(), Some("blk.12.ffn_down.weight"));
        assert_eq!(TensorId::Layer(0, LayerTensor::KBias).gguf_name(), "blk.0.attn_k.bias");
        assert!(TensorId::from_hf_name("model.layers.x.mlp.down_proj.weight").is_none());
        assert!(TensorId::from_hf_name("model.layers.0.mlp.nope").is_none());
    }

    #[test]
    fn architecture_decides_biases_and_tying() {
        let mut cfg = tiny_config();
        let plain = ModelLayout::new(&cfg);
        assert_eq!(plain.layer_tensors(0).count(), 9);
        assert!(plain.contains(TensorId::LmHead));
        assert!(!plain.contains(TensorId::Layer(cfg.num_layers, LayerTensor::Q)));
        assert_eq!(plain.layer_vector_bytes(), 2 * cfg.hidden_size * 4);
        cfg.attention_bias = true;
        cfg.tie_word_embeddings = true;
        let qwen = ModelLayout::new(&cfg);
        assert_eq!(qwen.layer_tensors(0).count(), 12);
        assert!(!qwen.contains(TensorId::LmHead));
        assert_eq!(qwen.layer_vector_bytes(), (2 * cfg.hidden_size + cfg.q_dim() + 2 * cfg.kv_dim()) * 4);
        assert_eq!(qwen.shape(TensorId::Layer(3, LayerTensor::O)), vec![cfg.hidden_size, cfg.q_dim()]);
        assert_eq!(qwen.kv_bytes_per_token_layer(KvDtype::F16).ok(), Some(2 * cfg.kv_dim() * 2));
        assert!(!qwen.contains(TensorId::Layer(0, LayerTensor::QNorm)), "only Qwen3 has per-head norms");
    }

    #[test]
    fn qwen3_layers_hold_their_head_norms_and_keep_hf_row_order_in_gguf() {
        // head_dim 24 != hidden 64 / 4 heads: the norms follow head_dim, the projections q_dim.
        let cfg = ModelConfig { architecture: Architecture::Qwen3, head_dim: 24, ..tiny_config() };
        let layout = ModelLayout::new(&cfg);
        let layer: Vec<TensorId> = layout.layer_tensors(2).collect();
        assert_eq!(layer.len(), 11);
        for t in [LayerTensor::QNorm, LayerTensor::KNorm] {
            assert!(layer.contains(&TensorId::Layer(2, t)));
            assert_eq!(layout.shape(TensorId::Layer(2, t)), vec![24]);
        }
        assert_eq!(layout.shape(TensorId::Layer(0, LayerTensor::Q)), vec![4 * 24, 64]);
        assert_eq!(layout.layer_vector_bytes(), (2 * 64 + 2 * 24) * 4);
        let q_norm = TensorId::Layer(5, LayerTensor::QNorm);
        assert_eq!(q_norm.hf_name(), "model.layers.5.self_attn.q_norm.weight");
        assert_eq!(q_norm.gguf_name(), "blk.5.attn_q_norm.weight");
        assert_eq!(
            TensorId::from_hf_name("model.layers.5.self_attn.k_norm.weight"),
            Some(TensorId::Layer(5, LayerTensor::KNorm))
        );
        assert!(!q_norm.is_matrix());
        // llama.cpp permutes Q/K rows for llama only.
        assert_eq!(layout.gguf_permuted_heads(TensorId::Layer(0, LayerTensor::Q)), None);
        let qwen2 = ModelConfig { architecture: Architecture::Qwen2, attention_bias: true, ..tiny_config() };
        assert_eq!(ModelLayout::new(&qwen2).gguf_permuted_heads(TensorId::Layer(0, LayerTensor::K)), None);
        let mistral = ModelConfig { architecture: Architecture::Mistral, ..tiny_config() };
        assert_eq!(ModelLayout::new(&mistral).gguf_permuted_heads(TensorId::Layer(0, LayerTensor::K)), Some(2));
    }
}
