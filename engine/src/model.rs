//! A contiguous slice of a decoder: embeddings on the first stage, layers `[start, end)`, final norm and
//! `lm_head` on the last. One stage holding every layer is the whole model.

use std::ops::Range;
use std::sync::Arc;

use crate::backend::{AttnSeq, AttnShape, Backend};
use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::layout::{LayerTensor, ModelLayout, TensorId};
use crate::loader::ModelFiles;
use crate::offload::{OffloadBudget, OffloadPlan, plan_offload};
use crate::quant;
use crate::tensor::{DType, HostTensor};
use crate::{Error, KvDtype, Result};

/// New tokens of one sequence in a batch. Chunks are laid out in order; a chunk's rows follow the previous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqChunk {
    /// Sequence id (shared by every stage).
    pub seq_id: u64,
    /// Position of the first new token.
    pub start_pos: usize,
    /// Number of new tokens.
    pub len: usize,
}

/// What flows into a stage.
pub enum StageInput<'a, B: Backend> {
    /// Token ids (first stage).
    Tokens(&'a [u32]),
    /// Hidden states `[tokens, hidden]` from the previous stage.
    Hidden(B::Act),
}

/// Which rows the last stage turns into logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Only each sequence's last new token (generation).
    Last,
    /// Every token (scoring, tests).
    All,
}

/// Options for loading a stage.
#[derive(Default)]
pub struct LoadOptions<'a> {
    /// Store float weights in this type (quantized weights stay quantized).
    pub dtype: Option<DType>,
    /// Called after each tensor with (done, total).
    pub progress: Option<&'a (dyn Fn(usize, usize) + Sync)>,
    /// Memory budget; layers that do not fit are offloaded: on a GPU they stay in host memory and are streamed in
    /// per layer, on the CPU they page in from their file per layer (see [`crate::offload`]). `None`: every layer
    /// is resident.
    pub offload: Option<OffloadBudget>,
    /// Keep at most this many of the stage's layers resident and offload the rest (`--resident-layers`).
    pub resident_layers: Option<usize>,
    /// Quantize float matrices (every 2-D weight: the layers' seven, embeddings and head) into this block format
    /// as each is read, with llama.cpp's reference rounding ([`quant::quantize_tensor`]); only the stage's own
    /// slice is read, one tensor at a time. Matrices the file already stores quantized are kept as they are:
    /// requantizing would compound the rounding error. Takes precedence over `dtype` for matrices.
    pub quantize: Option<DType>,
}

impl LoadOptions<'_> {
    /// The type a matrix stored as `file` is held in (before the backend's own storage choice).
    fn matrix_dtype(&self, file: DType) -> DType {
        match (self.quantize, self.dtype) {
            _ if file.is_quantized() => file,
            (Some(q), _) => q,
            (None, Some(d)) => d,
            (None, None) => file,
        }
    }
}

/// Decides which of the stage's layers are offloaded, from tensor metadata only (nothing is read).
fn plan_layers<B: Backend>(
    files: &ModelFiles,
    range: &Range<usize>,
    backend: &B,
    opts: &LoadOptions<'_>,
) -> Result<OffloadPlan> {
    if opts.offload.is_none() && opts.resident_layers.is_none() {
        return Ok(OffloadPlan::all_resident(range.len()));
    }
    // What the loader does to each matrix: float ones are quantized or take `opts.dtype`, then the backend's
    // storage type.
    let storage = |dtype: DType| backend.storage_dtype(opts.matrix_dtype(dtype));
    let bytes = ModelLayout::new(files.config()).stage_bytes(files, range, &storage)?;
    plan_offload(&bytes.layers, bytes.fixed(), opts.offload, opts.resident_layers)
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    q: B::Mat,
    k: B::Mat,
    v: B::Mat,
    q_bias: Option<B::Vector>,
    k_bias: Option<B::Vector>,
    v_bias: Option<B::Vector>,
    q_norm: Option<B::Vector>,
    k_norm: Option<B::Vector>,
    o: B::Mat,
    mlp_norm: B::Vector,
    gate: B::Mat,
    up: B::Mat,
    down: B::Mat,
}

/// The weights of one stage on one backend.
pub struct StageModel<B: Backend> {
    config: ModelConfig,
    range: Range<usize>,
    backend: Arc<B>,
    embed: Option<Arc<B::Mat>>,
    layers: Vec<Layer<B>>,
    norm: Option<B::Vector>,
    lm_head: Option<Arc<B::Mat>>,
    inv_freq: Vec<f32>,
    weight_bytes: usize,
    offload: OffloadPlan,
}

impl<B: Backend> Layer<B> {
    fn matrices(&self) -> [&B::Mat; 7] {
        [&self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down]
    }
}

struct Loader<'a, 'b, B: Backend> {
    files: &'a ModelFiles,
    layout: ModelLayout<'a>,
    backend: &'a B,
    opts: &'a LoadOptions<'b>,
    done: usize,
    total: usize,
    bytes: usize,
}

impl<B: Backend> Loader<'_, '_, B> {
    fn tick(&mut self) {
        self.done += 1;
        if let Some(p) = self.opts.progress {
            p(self.done, self.total);
        }
    }

    fn matrix(&mut self, id: TensorId) -> Result<B::Mat> {
        self.matrix_on(id, false)
    }

    /// Loads a matrix; `offloaded` ones stay in host memory (see [`Backend::upload_matrix_offloaded`]).
    fn matrix_on(&mut self, id: TensorId, offloaded: bool) -> Result<B::Mat> {
        let name = id.hf_name();
        let mut t = self.files.tensor(&name)?;
        t.expect_shape(&name, &self.layout.shape(id))?;
        let to = self.opts.matrix_dtype(t.dtype);
        if to.is_quantized() && to != t.dtype {
            t = quant::quantize_tensor(&name, &t, to)?;
        } else if to != t.dtype {
            t = t.convert(to);
        }
        let m = if offloaded { self.backend.upload_matrix_offloaded(&t)? } else { self.backend.upload_matrix(&t)? };
        self.bytes += self.backend.matrix_bytes(&m);
        self.tick();
        Ok(m)
    }

    fn vector(&mut self, id: TensorId) -> Result<B::Vector> {
        let name = id.hf_name();
        let shape = self.layout.shape(id);
        let t: HostTensor = self.files.tensor(&name)?;
        t.expect_shape(&name, &shape)?;
        self.bytes += shape[0] * 4;
        self.tick();
        self.backend.upload_vector(&t.to_f32())
    }

    /// A layer's bias or per-head norm vector, when the architecture has it.
    fn optional(&mut self, id: TensorId) -> Result<Option<B::Vector>> {
        if self.layout.contains(id) { self.vector(id).map(Some) } else { Ok(None) }
    }
}

impl<B: Backend> StageModel<B> {
    /// Loads layers `range` (plus embeddings when it starts at 0, and the head when it ends at the last layer).
    /// Only the tensors of this slice are read.
    pub fn load(files: &ModelFiles, range: Range<usize>, backend: Arc<B>, opts: &LoadOptions<'_>) -> Result<Self> {
        let cfg = files.config().clone();
        if range.start >= range.end || range.end > cfg.num_layers {
            return Err(Error::LayerRange { start: range.start, end: range.end, layers: cfg.num_layers });
        }
        backend.check_model(&cfg)?;
        let (first, last) = (range.start == 0, range.end == cfg.num_layers);
        let offload = plan_layers(files, &range, &*backend, opts)?;
        let layout = ModelLayout::new(files.config());
        let per_layer: usize = range.clone().map(|i| layout.layer_tensors(i).count()).sum();
        let total = per_layer + usize::from(first) + 2 * usize::from(last);
        let mut l = Loader { files, layout, backend: &*backend, opts, done: 0, total, bytes: 0 };
        let embed = if first { Some(Arc::new(l.matrix(TensorId::Embed)?)) } else { None };
        let mut layers = Vec::with_capacity(range.len());
        for (offset, i) in range.clone().enumerate() {
            let off = offload.is_offloaded(offset);
            let t = |t: LayerTensor| TensorId::Layer(i, t);
            layers.push(Layer {
                attn_norm: l.vector(t(LayerTensor::AttnNorm))?,
                q: l.matrix_on(t(LayerTensor::Q), off)?,
                k: l.matrix_on(t(LayerTensor::K), off)?,
                v: l.matrix_on(t(LayerTensor::V), off)?,
                q_bias: l.optional(t(LayerTensor::QBias))?,
                k_bias: l.optional(t(LayerTensor::KBias))?,
                v_bias: l.optional(t(LayerTensor::VBias))?,
                q_norm: l.optional(t(LayerTensor::QNorm))?,
                k_norm: l.optional(t(LayerTensor::KNorm))?,
                o: l.matrix_on(t(LayerTensor::O), off)?,
                mlp_norm: l.vector(t(LayerTensor::MlpNorm))?,
                gate: l.matrix_on(t(LayerTensor::Gate), off)?,
                up: l.matrix_on(t(LayerTensor::Up), off)?,
                down: l.matrix_on(t(LayerTensor::Down), off)?,
            });
        }
        let (norm, lm_head) = if last {
            let norm = l.vector(TensorId::FinalNorm)?;
            let head = match (layout.head(files), &embed) {
                (TensorId::Embed, Some(e)) => {
                    l.tick();
                    e.clone()
                }
                (head, _) => Arc::new(l.matrix(head)?),
            };
            (Some(norm), Some(head))
        } else {
            (None, None)
        };
        let weight_bytes = l.bytes;
        Ok(StageModel {
            inv_freq: cfg.rope_inv_freq(),
            config: cfg,
            range,
            backend,
            embed,
            layers,
            norm,
            lm_head,
            weight_bytes,
            offload,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The layers this stage holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Whether this stage embeds tokens.
    pub fn is_first(&self) -> bool {
        self.embed.is_some()
    }

    /// Whether this stage produces logits.
    pub fn is_last(&self) -> bool {
        self.lm_head.is_some()
    }

    /// Whether every token's result has the same bits however the tokens are batched or split into chunks (see
    /// [`Backend::rows_independent`]): then continuing a prompt from cached KV blocks changes no token.
    pub fn batch_invariant(&self) -> bool {
        let be = &self.backend;
        self.layers.iter().all(|l| l.matrices().iter().all(|m| be.rows_independent(m)))
            && self.lm_head.as_ref().is_none_or(|m| be.rows_independent(m))
    }

    /// Bytes of weights held on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// How the stage's layers are split between device and host memory.
    pub fn offload_plan(&self) -> OffloadPlan {
        self.offload
    }

    /// The model layers kept in host memory and streamed to the device per layer (empty without offload).
    pub fn offloaded_layers(&self) -> Range<usize> {
        self.range.start + self.offload.resident..self.range.end
    }

    /// A KV cache for this stage's layers: `num_blocks` blocks of `block_size` tokens, stored as `kv_dtype`.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize, kv_dtype: KvDtype) -> Result<KvCache<B>> {
        KvCache::new(&*self.backend, self.layers.len(), num_blocks, block_size, self.config.kv_dim(), kv_dtype)
    }

    /// KV bytes per cached token for this stage (keys and values of every layer) stored as `kv_dtype`.
    pub fn kv_bytes_per_token(&self, kv_dtype: KvDtype) -> Result<usize> {
        Ok(self.layers.len() * ModelLayout::new(&self.config).kv_bytes_per_token_layer(kv_dtype)?)
    }

    /// Runs the stage on a batch. Returns hidden states `[tokens, hidden]`, or on the last stage logits for
    /// the rows `rows` selects. KV blocks are reserved for every chunk first (all or nothing).
    pub fn forward(
        &self,
        kv: &mut KvCache<B>,
        chunks: &[SeqChunk],
        input: StageInput<'_, B>,
        rows: LogitRows,
    ) -> Result<B::Act> {
        let tokens = chunks.iter().map(|c| c.len).sum();
        self.backend.scope_pass(tokens, || self.forward_inner(kv, chunks, input, rows))
    }

    /// The offloaded layer to prefetch while layer `index` runs: the next one, wrapping to the first offloaded
    /// layer (needed first by the next batch).
    fn next_offloaded(&self, index: usize) -> usize {
        if index + 1 < self.layers.len() && self.offload.is_offloaded(index + 1) {
            index + 1
        } else {
            self.offload.resident.min(self.layers.len().saturating_sub(1))
        }
    }

    fn forward_inner(
        &self,
        kv: &mut KvCache<B>,
        chunks: &[SeqChunk],
        input: StageInput<'_, B>,
        rows: LogitRows,
    ) -> Result<B::Act> {
        let be = &*self.backend;
        let cfg = &self.config;
        let n_tokens: usize = chunks.iter().map(|c| c.len).sum();
        if n_tokens == 0 {
            return Err(Error::InvalidRequest("empty batch".into()));
        }
        let mut x = match input {
            StageInput::Tokens(ids) => {
                let embed = self.embed.as_ref().ok_or_else(|| Error::Shape {
                    op: "forward",
                    reason: format!("stage {:?} does not start at layer 0 and cannot take token ids", self.range),
                })?;
                if ids.len() != n_tokens {
                    return Err(Error::Shape {
                        op: "forward",
                        reason: format!("{} ids for {n_tokens} tokens", ids.len()),
                    });
                }
                be.embed(embed, ids)?
            }
            StageInput::Hidden(h) => {
                if be.act_shape(&h) != (n_tokens, cfg.hidden_size) {
                    return Err(Error::Shape {
                        op: "forward",
                        reason: format!(
                            "hidden states {:?}, expected ({n_tokens}, {})",
                            be.act_shape(&h),
                            cfg.hidden_size
                        ),
                    });
                }
                h
            }
        };
        // Check capacity for the whole batch before touching any table.
        let mut needed = 0;
        for c in chunks {
            let held = kv.table(c.seq_id).map_or(0, |t| t.blocks.len());
            needed += kv.blocks_for(c.start_pos + c.len).saturating_sub(held);
        }
        if needed > kv.free_blocks() {
            return Err(Error::KvExhausted { needed, free: kv.free_blocks() });
        }
        for c in chunks {
            kv.reserve(c.seq_id, c.start_pos, c.len)?;
        }
        let mut positions = Vec::with_capacity(n_tokens);
        for c in chunks {
            positions.extend((c.start_pos..c.start_pos + c.len).map(|p| p as u32));
        }
        let tables: Vec<Vec<u32>> =
            chunks.iter().map(|c| kv.table(c.seq_id).map(|t| t.blocks.clone()).unwrap_or_default()).collect();
        let mut row = 0;
        let seqs: Vec<AttnSeq<'_>> = chunks
            .iter()
            .zip(&tables)
            .map(|(c, blocks)| {
                let s = AttnSeq { row, len: c.len, start_pos: c.start_pos, blocks };
                row += c.len;
                s
            })
            .collect();
        let shape = AttnShape {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size: kv.block_size(),
        };
        let eps = cfg.rms_norm_eps as f32;
        for (index, (layer, cache)) in self.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            if self.offload.offloaded > 0 {
                be.stage_layer(&layer.matrices(), &self.layers[self.next_offloaded(index)].matrices())?;
            }
            let h = be.rms_norm(&x, &layer.attn_norm, eps)?;
            let qkv = be.linear_many(
                &h,
                &[
                    (&layer.q, layer.q_bias.as_ref()),
                    (&layer.k, layer.k_bias.as_ref()),
                    (&layer.v, layer.v_bias.as_ref()),
                ],
            )?;
            let [mut q, mut k, v]: [B::Act; 3] =
                qkv.try_into().map_err(|_| Error::Shape { op: "linear_many", reason: "expected 3 outputs".into() })?;
            if let Some(w) = &layer.q_norm {
                q = be.rms_norm_heads(&q, w, eps)?;
            }
            if let Some(w) = &layer.k_norm {
                k = be.rms_norm_heads(&k, w, eps)?;
            }
            be.rope(&mut q, &positions, &self.inv_freq, cfg.head_dim)?;
            be.rope(&mut k, &positions, &self.inv_freq, cfg.head_dim)?;
            let attn = be.attention(&q, &k, &v, cache, &seqs, shape)?;
            be.add_assign(&mut x, &be.linear(&attn, &layer.o, None)?)?;
            let h = be.rms_norm(&x, &layer.mlp_norm, eps)?;
            let gu = be.linear_many(&h, &[(&layer.gate, None), (&layer.up, None)])?;
            let act = be.silu_mul(&gu[0], &gu[1])?;
            be.add_assign(&mut x, &be.linear(&act, &layer.down, None)?)?;
            if self.offload.is_offloaded(index) {
                be.release_layer(&layer.matrices())?;
            }
        }
        let (Some(norm), Some(head)) = (&self.norm, &self.lm_head) else {
            return Ok(x);
        };
        if rows == LogitRows::Last {
            let last: Vec<usize> = seqs.iter().map(|s| s.row + s.len - 1).collect();
            if last.len() != n_tokens {
                x = be.select_rows(&x, &last)?;
            }
        }
        be.linear(&be.rms_norm(&x, norm, eps)?, head, None)
    }
}
