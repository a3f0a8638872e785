//! What a model costs a stage: weight bytes per layer (from the engine's layout, quantized types included), the
//! embeddings and head, the KV cache a token takes, and what every stage holds besides (its runtime, the
//! activations of the largest micro-batch and hidden states in transit). Placement and `strata plan` both size
//! from here, so what-if answers are what the coordinator does.
//!
//! Stage workers measure their own use after loading (`stage-worker`'s `memory` module); the estimate here only
//! has to be at least that, so that a plan placement accepts is one every stage can load.

use std::path::Path;

use strata_engine::KvDtype;
use strata_engine::layout::ModelLayout;
use strata_engine::loader::ModelFiles;
use strata_engine::stage_memory::{logits_bytes, stage_overhead_bytes};
use strata_engine::tensor::DType;

/// How a model is to be served, as far as its size goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeOptions {
    /// Tokens of KV cache every stage must hold.
    pub min_kv_tokens: u64,
    /// Most tokens in one micro-batch.
    pub max_batch_tokens: usize,
    /// Type the stages store their KV cache in.
    pub kv_dtype: KvDtype,
    /// Type float weight matrices are stored in (`None`: as in the file; quantized tensors stay as they are).
    pub weights: Option<DType>,
}

impl Default for SizeOptions {
    fn default() -> Self {
        SizeOptions { min_kv_tokens: 2048, max_batch_tokens: 512, kv_dtype: KvDtype::F32, weights: None }
    }
}

/// What placement needs to know about the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    /// Number of transformer layers.
    pub num_layers: usize,
    /// Weight bytes of one layer (the largest, if they differ).
    pub layer_bytes: u64,
    /// Bytes held only by the first stage (token embeddings).
    pub embed_bytes: u64,
    /// Bytes held only by the last stage (final norm and LM head).
    pub head_bytes: u64,
    /// KV cache bytes one token takes in one layer.
    pub kv_bytes_per_token_layer: u64,
    /// Tokens of KV cache every stage must be able to hold.
    pub kv_reserve_tokens: u64,
    /// Bytes every stage holds besides weights and KV cache: runtime, activations, hidden states in transit.
    pub stage_overhead_bytes: u64,
    /// Bytes the last stage holds for logits: a row of the vocabulary per sequence of a micro-batch.
    pub logits_bytes: u64,
}

impl ModelShape {
    /// Sizes a model from its files' metadata (no tensor data is read).
    pub fn from_model_path(path: &Path, opts: &SizeOptions) -> crate::Result<Self> {
        let files = ModelFiles::open(path)?;
        let cfg = files.config();
        let layout = ModelLayout::new(cfg);
        let as_stored = |dtype: DType| match opts.weights {
            Some(w) if !dtype.is_quantized() => w,
            _ => dtype,
        };
        let mut layer_bytes = 0;
        for i in 0..cfg.num_layers {
            layer_bytes =
                layer_bytes.max(layout.layer_matrix_bytes(&files, i, &as_stored)? + layout.layer_vector_bytes());
        }
        // The last stage may not hold the embeddings, so a tied head counts in full.
        let head_bytes = layout.head_bytes(&files, &as_stored, false)?;
        Ok(ModelShape {
            num_layers: cfg.num_layers,
            layer_bytes: layer_bytes as u64,
            embed_bytes: layout.embed_bytes(&files, &as_stored)? as u64,
            head_bytes: head_bytes as u64,
            kv_bytes_per_token_layer: layout.kv_bytes_per_token_layer(opts.kv_dtype)? as u64,
            kv_reserve_tokens: opts.min_kv_tokens,
            stage_overhead_bytes: stage_overhead_bytes(cfg, opts.max_batch_tokens),
            logits_bytes: logits_bytes(cfg, opts.max_batch_tokens),
        })
    }

    /// Memory a stage costs besides its layers: the overhead every stage has, the embeddings on the `first`, the
    /// head and logits on the `last`.
    pub fn stage_fixed_bytes(&self, first: bool, last: bool) -> u64 {
        let embed = if first { self.embed_bytes } else { 0 };
        let head = if last { self.head_bytes.saturating_add(self.logits_bytes) } else { 0 };
        self.stage_overhead_bytes.saturating_add(embed).saturating_add(head)
    }

    /// Memory one layer costs on a node: weights plus its KV reservation.
    pub fn layer_cost(&self) -> u64 {
        self.layer_bytes.saturating_add(self.kv_bytes_per_token_layer.saturating_mul(self.kv_reserve_tokens))
    }
}

/// The longest sequence served and the KV tokens every stage must hold, from `--max-model-len` (default: the
/// model's context of `model_context` tokens) and `--min-kv-tokens` (default: that length).
pub fn context_limits(
    max_model_len: Option<usize>,
    min_kv_tokens: Option<u64>,
    model_context: usize,
) -> crate::Result<(usize, u64)> {
    let len = match max_model_len {
        Some(0) => return Err(crate::Error::Config("max_model_len must be at least 1".into())),
        Some(n) if n > model_context => {
            return Err(crate::Error::Config(format!(
                "max_model_len {n} is longer than the model's context of {model_context} tokens"
            )));
        }
        Some(n) => n,
        None => model_context,
    };
    Ok((len, min_kv_tokens.unwrap_or(len as u64)))
}
