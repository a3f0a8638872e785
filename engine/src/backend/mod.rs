//! The compute interface the model is written against. The CPU backend is the reference; a CUDA backend
//! implements the same trait, so model code never changes per device.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::config::ModelConfig;
use crate::tensor::{DType, HostTensor};
use crate::{KvDtype, Result};

/// Where one sequence's new tokens sit in a batch and in its KV cache.
#[derive(Debug, Clone)]
pub struct AttnSeq<'a> {
    /// First row of this sequence's tokens in the batch's activations.
    pub row: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Position of the first new token (tokens already cached before it).
    pub start_pos: usize,
    /// KV blocks holding positions `0..start_pos+len`, in order.
    pub blocks: &'a [u32],
}

/// Shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl AttnShape {
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The factor on every query-key dot product: 1/√(head width).
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// A compute device: owns weight, activation and KV storage and runs the ops of a decoder layer.
/// Activations are `[rows, cols]` with one row per token.
pub trait Backend: Send + Sync + 'static {
    /// Activations (hidden states, logits) on the device.
    type Act: Send;
    /// A weight matrix `[out, in]` on the device, in its storage type (possibly quantized).
    type Mat: Send + Sync;
    /// A small f32 vector (norm weight, bias) on the device.
    type Vector: Send + Sync;
    /// Paged key/value storage for one layer.
    type KvLayer: Send;

    /// Human-readable device name.
    fn name(&self) -> String;
    /// Runs `f` in the backend's execution context (the CPU backend's thread pool), so the ops inside do not
    /// each hand work across threads.
    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
    /// As [`Backend::scope`], for one forward pass over `tokens` tokens: the CPU backend keeps its other threads
    /// busy between the pass's parallel regions where that repays it (a prompt's always, a decode step's as timed).
    fn scope_pass<R: Send>(&self, tokens: usize, f: impl FnOnce() -> R + Send) -> R {
        let _ = tokens;
        self.scope(f)
    }
    /// Rejects a model this backend cannot run (e.g. a head width its kernels lack), before anything loads.
    fn check_model(&self, cfg: &ModelConfig) -> Result<()> {
        let _ = cfg;
        Ok(())
    }
    /// Uploads a weight matrix (2-D host tensor), keeping its storage type.
    fn upload_matrix(&self, t: &HostTensor) -> Result<Self::Mat>;
    /// Uploads an f32 vector.
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Vector>;
    /// Bytes a matrix occupies on the device.
    fn matrix_bytes(&self, m: &Self::Mat) -> usize;
    /// Whether a token's product with `m` has the same bits however many tokens are computed with it, so that
    /// reusing cached KV (prefix caching) or batching differently cannot change a token. Off unless a backend
    /// knows its kernels are row-independent (cuBLAS, for one, picks algorithms by shape).
    fn rows_independent(&self, m: &Self::Mat) -> bool {
        let _ = m;
        false
    }
    /// The type a weight stored as `dtype` is kept in on this device (a backend may convert float weights to
    /// its activation type); used to size a stage before loading it.
    fn storage_dtype(&self, dtype: DType) -> DType {
        dtype
    }
    /// Bytes of the device's own memory, for a backend whose weights and KV cache live there (`None`: they
    /// live in host memory, which the caller measures itself).
    fn device_memory_capacity(&self) -> Option<usize> {
        None
    }
    /// The KV cache type used when none is asked for (sizes follow from it through
    /// [`KvDtype::bytes_per_token_layer`]).
    fn default_kv_dtype(&self) -> KvDtype {
        KvDtype::F32
    }
    /// Uploads a weight matrix that stays in host memory and is copied to the device only while a layer that
    /// uses it runs (weight offload, see [`Backend::stage_layer`]). Backends whose weights already live in host
    /// memory upload it like any other.
    fn upload_matrix_offloaded(&self, t: &HostTensor) -> Result<Self::Mat> {
        self.upload_matrix(t)
    }
    /// Called before the ops of each layer when a stage has offloaded layers: makes the offloaded matrices in
    /// `layer` usable by the ops that follow, and may start copying those of `next` (the next offloaded layer)
    /// in the background. Resident matrices in either list are ignored.
    fn stage_layer(&self, layer: &[&Self::Mat], next: &[&Self::Mat]) -> Result<()> {
        let _ = (layer, next);
        Ok(())
    }
    /// Called after the ops of each offloaded layer: the backend may let the memory of `layer`'s matrices go
    /// until [`Backend::stage_layer`] asks for them again (the CPU backend drops their mapped pages).
    fn release_layer(&self, layer: &[&Self::Mat]) -> Result<()> {
        let _ = layer;
        Ok(())
    }
    /// Restarts [`Backend::allocation_peak`] at what is allocated now.
    fn reset_allocation_peak(&self) -> Result<()> {
        Ok(())
    }
    /// The most bytes of device memory this backend has had allocated since [`Backend::reset_allocation_peak`],
    /// where the device keeps count (`None`: host backends, whose caller measures the process, or a driver that
    /// does not say).
    fn allocation_peak(&self) -> Result<Option<usize>> {
        Ok(None)
    }
    /// Makes a KV layer's memory resident (host backends allocate it lazily; device memory already is).
    fn prefault_kv_layer(&self, layer: &mut Self::KvLayer) {
        let _ = layer;
    }
    /// Allocates KV storage for one layer: `num_blocks × block_size` slots of `kv_dim` keys and values, stored
    /// as `dtype` ([`crate::Error::KvDtypeUnsupported`] when this backend cannot store it, [`crate::Error::KvDim`]
    /// when its blocks do not tile `kv_dim`).
    fn alloc_kv_layer(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        dtype: KvDtype,
    ) -> Result<Self::KvLayer>;
    /// Copies host f32 data (`rows × cols`) into an activation.
    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Act>;
    /// Copies an activation back to the host as f32, row-major.
    fn act_to_host(&self, a: &Self::Act) -> Result<Vec<f32>>;
    /// `(rows, cols)` of an activation.
    fn act_shape(&self, a: &Self::Act) -> (usize, usize);
    /// Gathers embedding rows for `ids`.
    fn embed(&self, table: &Self::Mat, ids: &[u32]) -> Result<Self::Act>;
    /// RMSNorm of each row, scaled by `w`.
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32) -> Result<Self::Act>;
    /// RMSNorm of each head of each row: every `w.len()`-wide slice of a row (its width must divide the row's)
    /// is normalised on its own and scaled by `w` (Qwen3's `q_norm`/`k_norm`).
    fn rms_norm_heads(&self, x: &Self::Act, w: &Self::Vector, eps: f32) -> Result<Self::Act>;
    /// `x · wᵀ (+ bias)`.
    fn linear(&self, x: &Self::Act, w: &Self::Mat, bias: Option<&Self::Vector>) -> Result<Self::Act>;
    /// `x · wᵢᵀ (+ biasᵢ)` for several matrices sharing one input (q/k/v, gate/up); backends may fuse them.
    fn linear_many(&self, x: &Self::Act, ws: &[(&Self::Mat, Option<&Self::Vector>)]) -> Result<Vec<Self::Act>> {
        ws.iter().map(|(w, b)| self.linear(x, w, *b)).collect()
    }
    /// Rotary embedding (Hugging Face rotate-half layout) on each head of each row, in place.
    fn rope(&self, x: &mut Self::Act, positions: &[u32], inv_freq: &[f32], head_dim: usize) -> Result<()>;
    /// Writes the new keys/values into the cache, then runs causal GQA attention for every sequence.
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        cache: &mut Self::KvLayer,
        seqs: &[AttnSeq<'_>],
        shape: AttnShape,
    ) -> Result<Self::Act>;
    /// `silu(gate) * up`, element-wise.
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> Result<Self::Act>;
    /// `x += y`, element-wise.
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    /// A new activation holding the given rows of `x`.
    fn select_rows(&self, x: &Self::Act, rows: &[usize]) -> Result<Self::Act>;
}
