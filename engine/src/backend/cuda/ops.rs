//! The backend's ops as kernel launches. Argument lists follow the ABI table in `kernels/src/lib.rs`; every
//! launch goes through [`CudaBackend::launch`], whose callers state why their arguments match.

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use strata_kernels::{PREFILL_QUERY_TILE, decode_heads_per_cta};

use super::attn_plan::{self, AttnMode, AttnPlan};
use super::quant::{self, Route};
use super::{CudaAct, CudaBackend, CudaKvLayer, CudaMatrix, CudaVector, Store, dev_err, lock};
use crate::backend::{AttnSeq, AttnShape};
use crate::tensor::DType;
use crate::{Error, Result};

/// Block size of the 1-D grid-stride kernels and the elements one block covers per step (8 per thread).
const STRIDE_BLOCK: u32 = 256;
const STRIDE_ELEMS: usize = 2048;

/// Device index arrays of one attention call.
pub struct AttnIndices {
    slots: CudaSlice<i32>,
    /// `cu_seqlens` (prefill) or `block_tables` (decode).
    first: CudaSlice<i32>,
    /// `context_lens` (decode only).
    second: Option<CudaSlice<i32>>,
}

pub(super) fn same_shape(op: &'static str, a: &CudaAct, b: &CudaAct) -> Result<()> {
    if (a.rows, a.cols) == (b.rows, b.cols) {
        Ok(())
    } else {
        Err(Error::Shape { op, reason: format!("{}x{} vs {}x{}", a.rows, a.cols, b.rows, b.cols) })
    }
}

/// `v` as little-endian bytes of the activation type.
pub(super) fn host_to_act_bytes(act: DType, v: &[f32]) -> Vec<u8> {
    match act {
        DType::F16 => v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
        _ => bytemuck::cast_slice(v).to_vec(),
    }
}

fn int(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::Shape { op: what, reason: format!("{v} does not fit a 32-bit kernel argument") })
}

fn stride_grid(n: usize) -> usize {
    n.div_ceil(STRIDE_ELEMS).clamp(1, 65535)
}

/// Runs `y = x · wᵀ` for a row-major `x [m, k]`, `w [n, k]` and `y [m, n]` of type `T` with cuBLAS (column-major):
/// `yᵀ = w · xᵀ`, i.e. `gemm(T, N)` with `w` as the `k × n` operand.
fn gemm_typed<T>(
    blas: &CudaBlas,
    (one, zero): (T, T),
    x: &CudaView<'_, u8>,
    w: &CudaView<'_, u8>,
    y: &mut CudaSlice<u8>,
    (m, n, k): (usize, usize, usize),
) -> Result<()>
where
    CudaBlas: Gemm<T>,
{
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: int("linear", n)?,
        n: int("linear", m)?,
        k: int("linear", k)?,
        alpha: one,
        lda: int("linear", k)?,
        ldb: int("linear", k)?,
        beta: zero,
        ldc: int("linear", n)?,
    };
    let size = |what: &str| Error::Device(format!("linear: {what} buffer is smaller than its shape"));
    // SAFETY: reinterprets byte buffers as the element type cuBLAS reads; transmute checks that each buffer
    // holds at least the requested number of `T`, which is exactly the operand's shape.
    let (a, b) = unsafe { (w.transmute::<T>(n * k).ok_or_else(|| size("weight"))?, x.transmute::<T>(m * k)) };
    let b = b.ok_or_else(|| size("input"))?;
    // SAFETY: as above, for the output.
    let mut c = unsafe { y.transmute_mut::<T>(m * n) }.ok_or_else(|| size("output"))?;
    // SAFETY: the config describes exactly the three buffers above (sizes checked), all on the compute stream.
    unsafe { blas.gemm(cfg, &a, &b, &mut c) }.map_err(dev_err("cuBLAS gemm"))
}

impl CudaBackend {
    /// Launches kernel `name` on the compute stream with the arguments `push` adds. Empty grids are skipped.
    ///
    /// # Safety
    /// `push` must add exactly the arguments of `name`'s signature (kernels/src/lib.rs), with buffers large
    /// enough for the sizes passed; the kernel then stays within them.
    unsafe fn launch<'a>(
        &'a self,
        name: &str,
        grid: (usize, usize, usize),
        block: u32,
        push: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        if grid.0 > i32::MAX as usize || grid.1 > 65535 || grid.2 > 65535 {
            return Err(Error::Shape { op: "launch", reason: format!("{name}: grid {grid:?} exceeds CUDA's limits") });
        }
        let func = self.kernels.get(name)?;
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = self.compute.launch_builder(func);
        push(&mut args);
        // SAFETY: the caller guarantees the argument list matches the kernel (this function's contract).
        unsafe { args.launch(cfg) }.map(|_| ()).map_err(|e| Error::Device(format!("launching {name}: {e}")))
    }

    /// A fresh activation buffer; every caller writes all of it before it is read.
    pub(super) fn alloc_act(&self, rows: usize, cols: usize) -> Result<CudaAct> {
        let buf = self.uninit(rows * cols * self.act.block_bytes())?;
        Ok(CudaAct { buf, rows, cols })
    }

    fn uninit(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: cudarc marks uninitialised device memory unsafe; u8 has no invalid values and every caller
        // overwrites the buffer (kernel output or copy) before reading it.
        unsafe { self.compute.alloc::<u8>(bytes.max(1)) }.map_err(dev_err("allocating device memory"))
    }

    fn cast(&self, from: DType, to: DType, input: &CudaSlice<u8>, out: &mut CudaSlice<u8>, n: usize) -> Result<()> {
        let n64 = n as i64;
        // SAFETY: cast_<s>_<d>(in, out, n i64); `input` holds n elements of `from`, `out` n of `to`.
        unsafe {
            self.launch(&format!("cast_{from}_{to}"), (stride_grid(n), 1, 1), STRIDE_BLOCK, |b| {
                b.arg(input).arg(out).arg(&n64);
            })
        }
    }

    /// Host f32 rows in, through a pinned buffer, converted to the activation type on the device.
    pub(super) fn upload_act(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaAct> {
        let n = rows * cols;
        if n == 0 {
            return self.alloc_act(rows, cols);
        }
        let mut io = lock(&self.io, "pinned I/O")?;
        let mut pb = self.pinned_buf(&mut io.up, n * 4, true)?;
        // The previous copy out of this buffer must be finished before it is overwritten.
        pb.done.synchronize().map_err(dev_err("waiting for an activation copy"))?;
        pb.buf.as_mut_slice().map_err(dev_err("writing pinned memory"))?.copy_from_slice(bytemuck::cast_slice(data));
        let mut f32_buf = self.uninit(n * 4)?;
        self.compute.memcpy_htod(&pb.buf, &mut f32_buf).map_err(dev_err("copying activations in"))?;
        pb.done.record(&self.compute).map_err(dev_err("recording an event"))?;
        io.up.push(pb);
        drop(io);
        if self.act == DType::F32 {
            return Ok(CudaAct { buf: f32_buf, rows, cols });
        }
        let mut out = self.alloc_act(rows, cols)?;
        self.cast(DType::F32, self.act, &f32_buf, &mut out.buf, n)?;
        Ok(out)
    }

    /// Activation rows out as host f32, converted on the device and copied through a pinned buffer.
    pub(super) fn download_act(&self, a: &CudaAct) -> Result<Vec<f32>> {
        let n = a.rows * a.cols;
        if n == 0 {
            return Ok(Vec::new());
        }
        let converted;
        let src = if self.act == DType::F32 {
            &a.buf
        } else {
            let mut f = self.uninit(n * 4)?;
            self.cast(self.act, DType::F32, &a.buf, &mut f, n)?;
            converted = f;
            &converted
        };
        let mut io = lock(&self.io, "pinned I/O")?;
        let mut pb = self.pinned_buf(&mut io.down, n * 4, false)?;
        self.compute.memcpy_dtoh(src, &mut pb.buf).map_err(dev_err("copying activations out"))?;
        // Event tracking is off, so the pinned buffer's own event is not recorded: wait on the stream.
        self.compute.synchronize().map_err(dev_err("waiting for activations"))?;
        let bytes = pb.buf.as_slice().map_err(dev_err("reading pinned memory"))?;
        let out = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        io.down.push(pb);
        Ok(out)
    }

    /// Rows `ids` of an embedding table (dense or quantized), in the activation type.
    pub(super) fn gather(&self, table: &CudaMatrix, ids: impl Iterator<Item = usize>) -> Result<CudaAct> {
        let ids: Vec<i32> = ids.map(|i| int("embed", i)).collect::<Result<_>>()?;
        let mut out = self.alloc_act(ids.len(), table.cols)?;
        let dev_ids = self.compute.clone_htod(&ids).map_err(dev_err("uploading token ids"))?;
        let name =
            quant::kernel_name("embedding", table.dtype, self.act).unwrap_or_else(|| format!("embedding_{}", self.act));
        let (n, dim, vocab) = (int("embed", ids.len())?, int("embed", table.cols)?, int("embed", table.rows)?);
        self.with_weight(table, |w| {
            // SAFETY: embedding_<q?>_<t>(ids i32, table, out, n_tokens, dim, vocab); `w` is the [vocab, dim]
            // table, ids were checked against vocab, `out` holds n_tokens × dim.
            unsafe {
                self.launch(&name, (ids.len(), 1, 1), 128, |b| {
                    b.arg(&dev_ids).arg(w).arg(&mut out.buf).arg(&n).arg(&dim).arg(&vocab);
                })
            }
        })?;
        Ok(out)
    }

    pub(super) fn select_rows_impl(&self, x: &CudaAct, rows: &[usize]) -> Result<CudaAct> {
        let ids: Vec<i32> = rows.iter().map(|&r| int("select_rows", r)).collect::<Result<_>>()?;
        let mut out = self.alloc_act(rows.len(), x.cols)?;
        let dev_ids = self.compute.clone_htod(&ids).map_err(dev_err("uploading row ids"))?;
        let (n, dim, vocab) =
            (int("select_rows", rows.len())?, int("select_rows", x.cols)?, int("select_rows", x.rows)?);
        // SAFETY: embedding_<t>(ids, table, out, n_tokens, dim, vocab) gathers rows of `x` (the table,
        // [x.rows, cols]); rows were checked against x.rows and `out` holds rows.len() × cols.
        unsafe {
            self.launch(&format!("embedding_{}", self.act), (rows.len(), 1, 1), 128, |b| {
                b.arg(&dev_ids).arg(&x.buf).arg(&mut out.buf).arg(&n).arg(&dim).arg(&vocab);
            })?;
        }
        Ok(out)
    }

    pub(super) fn rms_norm_impl(&self, x: &CudaAct, w: &CudaVector, eps: f32) -> Result<CudaAct> {
        let mut y = self.alloc_act(x.rows, x.cols)?;
        let (rows, dim) = (int("rms_norm", x.rows)?, int("rms_norm", x.cols)?);
        // SAFETY: rmsnorm_<t>(x, w, y, n_rows, dim, eps); x and y hold rows × dim, w holds dim (checked).
        unsafe {
            self.launch(&format!("rmsnorm_{}", self.act), (x.rows, 1, 1), 256, |b| {
                b.arg(&x.buf).arg(&w.buf).arg(&mut y.buf).arg(&rows).arg(&dim).arg(&eps);
            })?;
        }
        Ok(y)
    }

    /// RMSNorm of each `w.len`-wide head: a row-major `[rows, heads × head_dim]` activation is, byte for byte,
    /// `[rows × heads, head_dim]`, so the row kernel runs over heads as rows.
    pub(super) fn rms_norm_heads_impl(&self, x: &CudaAct, w: &CudaVector, eps: f32) -> Result<CudaAct> {
        let mut y = self.alloc_act(x.rows, x.cols)?;
        let heads = x.rows * (x.cols / w.len);
        let (rows, dim) = (int("rms_norm_heads", heads)?, int("rms_norm_heads", w.len)?);
        // SAFETY: rmsnorm_<t>(x, w, y, n_rows, dim, eps) with n_rows × dim = x.rows × x.cols elements, which x and
        // y hold; w holds dim (the caller checked that dim divides x.cols).
        unsafe {
            self.launch(&format!("rmsnorm_{}", self.act), (heads, 1, 1), 256, |b| {
                b.arg(&x.buf).arg(&w.buf).arg(&mut y.buf).arg(&rows).arg(&dim).arg(&eps);
            })?;
        }
        Ok(y)
    }

    pub(super) fn silu_mul_impl(&self, gate: &CudaAct, up: &CudaAct) -> Result<CudaAct> {
        let mut out = self.alloc_act(gate.rows, gate.cols)?;
        let n = gate.rows * gate.cols;
        let n64 = n as i64;
        // SAFETY: silu_mul_<t>(gate, up, out, n i64); all three hold n elements (same shape checked).
        unsafe {
            self.launch(&format!("silu_mul_{}", self.act), (stride_grid(n), 1, 1), STRIDE_BLOCK, |b| {
                b.arg(&gate.buf).arg(&up.buf).arg(&mut out.buf).arg(&n64);
            })?;
        }
        Ok(out)
    }

    pub(super) fn add_impl(&self, x: &mut CudaAct, y: &CudaAct) -> Result<()> {
        let n = x.rows * x.cols;
        let n64 = n as i64;
        // SAFETY: add_<t>(a, b, out, n i64) with out = a = x, which the kernel allows; both hold n elements.
        unsafe {
            self.launch(&format!("add_{}", self.act), (stride_grid(n), 1, 1), STRIDE_BLOCK, |b| {
                b.arg(&x.buf).arg(&y.buf).arg(&x.buf).arg(&n64);
            })
        }
    }

    pub(super) fn rope_impl(
        &self,
        x: &mut CudaAct,
        positions: &[u32],
        inv_freq: &[f32],
        head_dim: usize,
    ) -> Result<()> {
        let pos: Vec<i32> = positions.iter().map(|&p| int("rope", p as usize)).collect::<Result<_>>()?;
        let mut index = lock(&self.index, "index cache")?;
        if index.positions.as_ref().is_none_or(|(p, _)| *p != pos) {
            let dev = self.compute.clone_htod(&pos).map_err(dev_err("uploading positions"))?;
            index.positions = Some((pos, dev));
        }
        if index.inv_freq.as_ref().is_none_or(|(f, _)| f != inv_freq) {
            let dev = self.compute.clone_htod(inv_freq).map_err(dev_err("uploading RoPE frequencies"))?;
            index.inv_freq = Some((inv_freq.to_vec(), dev));
        }
        let (Some((_, dev_pos)), Some((_, dev_freq))) = (&index.positions, &index.inv_freq) else {
            return Err(Error::Device("rope: index cache is empty after upload".into()));
        };
        let (n_tokens, heads, hd, stride) =
            (int("rope", x.rows)?, int("rope", x.cols / head_dim)?, int("rope", head_dim)?, int("rope", x.cols)?);
        let no_k = 0i32;
        // SAFETY: rope_<t>(q, k, pos, inv_freq, n_tokens, n_heads, n_kv_heads, head_dim, q_stride, k_stride)
        // rotates `x` as q with n_kv_heads = 0, so k (the same pointer) is never touched; pos holds n_tokens and
        // inv_freq head_dim / 2 values (checked by the caller).
        unsafe {
            self.launch(&format!("rope_{}", self.act), (x.rows, 1, 1), 256, |b| {
                b.arg(&x.buf).arg(&x.buf).arg(dev_pos).arg(dev_freq);
                b.arg(&n_tokens).arg(&heads).arg(&no_k).arg(&hd).arg(&stride).arg(&stride);
            })
        }
    }

    /// Runs `f` on the device bytes of `w`, staging an offloaded matrix first if no slot holds it.
    fn with_weight<R>(&self, w: &CudaMatrix, f: impl FnOnce(&CudaView<'_, u8>) -> Result<R>) -> Result<R> {
        match &w.store {
            Store::Device(buf) => f(&buf.as_view()),
            Store::Host(h) => {
                let mut staging = lock(&self.staging, "staging")?;
                if staging.view(h.id).is_none() {
                    staging.stage(&[h], &[])?;
                }
                let view = staging.view(h.id).ok_or_else(|| Error::Device("offloaded weight was not staged".into()))?;
                f(&view)
            }
        }
    }

    pub(super) fn linear_impl(&self, x: &CudaAct, w: &CudaMatrix, bias: Option<&CudaVector>) -> Result<CudaAct> {
        if x.cols != w.cols {
            return Err(Error::Shape {
                op: "linear",
                reason: format!("input width {} for a {}x{} weight", x.cols, w.rows, w.cols),
            });
        }
        if let Some(b) = bias
            && b.len != w.rows
        {
            return Err(Error::Shape { op: "linear", reason: format!("bias of {} for {} outputs", b.len, w.rows) });
        }
        let (m, n, k) = (x.rows, w.rows, w.cols);
        let mut y = self.alloc_act(m, n)?;
        self.with_weight(w, |wv| {
            if !w.dtype.is_quantized() {
                if w.dtype != self.act {
                    return Err(Error::Device(format!(
                        "a {} weight cannot multiply {} activations",
                        w.dtype, self.act
                    )));
                }
                return self.gemm(&x.buf.as_view(), wv, &mut y.buf, (m, n, k));
            }
            let (mi, ni, ki) = (int("linear", m)?, int("linear", n)?, int("linear", k)?);
            let l = quant::matmul_launch(w.dtype, self.act, (m, n, k), self.sm_count)
                .ok_or_else(|| Error::Device(format!("linear: {} is not a block format", w.dtype)))?;
            if l.route != Route::DequantizeThenCublas {
                // SAFETY: gemv_<q>_<t> / gemm_<q>_<t>(w, x, y, m, n, k), gemv only for 1 <= m <= 8 (the route);
                // w is [n, k] in whole blocks (checked at upload), x holds m × k and y m × n, all 16-byte aligned
                // (fresh allocations or 256-aligned staging offsets).
                return unsafe {
                    self.launch(&l.name, l.grid, l.block, |b| {
                        b.arg(wv).arg(&x.buf).arg(&mut y.buf).arg(&mi).arg(&ni).arg(&ki);
                    })
                };
            }
            let mut dense = self.uninit(n * k * self.act.block_bytes())?;
            // SAFETY: dequantize_<q>_<t>(w, out, n, k) writes the dense [n, k] weight into `dense`.
            unsafe {
                self.launch(&l.name, l.grid, l.block, |b| {
                    b.arg(wv).arg(&mut dense).arg(&ni).arg(&ki);
                })?;
            }
            self.gemm(&x.buf.as_view(), &dense.as_view(), &mut y.buf, (m, n, k))
        })?;
        if let Some(bias) = bias {
            let (rows, dim) = (int("linear", m)?, int("linear", n)?);
            // SAFETY: add_bias_<t>(x, bias, n_rows, dim) on y [m, n] with a bias of n (checked above).
            unsafe {
                self.launch(&format!("add_bias_{}", self.act), (m, 1, 1), 256, |b| {
                    b.arg(&y.buf).arg(&bias.buf).arg(&rows).arg(&dim);
                })?;
            }
        }
        Ok(y)
    }

    fn gemm(
        &self,
        x: &CudaView<'_, u8>,
        w: &CudaView<'_, u8>,
        y: &mut CudaSlice<u8>,
        mnk: (usize, usize, usize),
    ) -> Result<()> {
        match self.act {
            DType::F16 => gemm_typed(&self.blas, (f16::ONE, f16::ZERO), x, w, y, mnk),
            DType::BF16 => gemm_typed(&self.blas, (bf16::ONE, bf16::ZERO), x, w, y, mnk),
            _ => gemm_typed(&self.blas, (1f32, 0f32), x, w, y, mnk),
        }
    }

    /// Device copies of a plan's index arrays, reused while consecutive layers ask for the same plan.
    fn attn_indices<'g>(
        &self,
        cache: &'g mut std::sync::MutexGuard<'_, super::IndexCache>,
        plan: AttnPlan,
    ) -> Result<&'g AttnIndices> {
        if cache.attention.as_ref().is_none_or(|(p, _)| *p != plan) {
            let up = |v: &[i32]| self.compute.clone_htod(v).map_err(dev_err("uploading attention indices"));
            let (first, second) = match &plan.mode {
                AttnMode::Prefill { cu_seqlens, .. } => (up(cu_seqlens)?, None),
                AttnMode::Decode { block_tables, context_lens, .. } => (up(block_tables)?, Some(up(context_lens)?)),
            };
            let slots = up(&plan.slots)?;
            cache.attention = Some((plan, AttnIndices { slots, first, second }));
        }
        cache.attention.as_ref().map(|(_, d)| d).ok_or_else(|| Error::Device("attention index cache is empty".into()))
    }

    pub(super) fn attention_impl(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        cache: &mut CudaKvLayer,
        seqs: &[AttnSeq<'_>],
        shape: AttnShape,
    ) -> Result<CudaAct> {
        let rows = q.rows;
        let plan = attn_plan::plan(seqs, rows, cache.num_blocks, cache.block_size)?;
        let mode = plan.mode.clone();
        let mut index = lock(&self.index, "index cache")?;
        let idx = self.attn_indices(&mut index, plan)?;
        let (n_heads, n_kv, hd) = (
            int("attention", shape.num_heads)?,
            int("attention", shape.num_kv_heads)?,
            int("attention", shape.head_dim)?,
        );
        let (kv_dim, q_dim, n_tokens) =
            (int("attention", cache.kv_dim)?, int("attention", q.cols)?, int("attention", rows)?);
        // SAFETY: kv_write[_q8_0]_<t>(k, v, k_cache, v_cache, slot_mapping, n_tokens, n_kv_heads, head_dim, k_stride,
        // v_stride); k and v hold rows × kv_dim, every slot is inside the cache (checked by the plan), a Q8_0
        // cache's rows are kv_dim / 32 whole blocks (checked at allocation).
        unsafe {
            self.launch(&cache.kernel("kv_write", self.act), (rows, 1, 1), 128, |b| {
                b.arg(&k.buf).arg(&v.buf).arg(&cache.k).arg(&cache.v).arg(&idx.slots);
                b.arg(&n_tokens).arg(&n_kv).arg(&hd).arg(&kv_dim).arg(&kv_dim);
            })?;
        }
        let mut out = self.alloc_act(rows, q.cols)?;
        let scale = shape.scale();
        match mode {
            AttnMode::Prefill { cu_seqlens, max_len } => {
                let grid = (max_len.div_ceil(PREFILL_QUERY_TILE), shape.num_heads, cu_seqlens.len() - 1);
                // SAFETY: attention_prefill_<t>(q, k, v, out, cu_seqlens, n_heads, n_kv_heads, head_dim, scale,
                // q_stride, kv_stride); cu_seqlens covers exactly the rows of q, k, v and out.
                unsafe {
                    self.launch(&format!("attention_prefill_{}", self.act), grid, 256, |b| {
                        b.arg(&q.buf).arg(&k.buf).arg(&v.buf).arg(&mut out.buf).arg(&idx.first);
                        b.arg(&n_heads).arg(&n_kv).arg(&hd).arg(&scale).arg(&q_dim).arg(&kv_dim);
                    })?;
                }
            }
            AttnMode::Decode { max_blocks, max_context, .. } => {
                let lens =
                    idx.second.as_ref().ok_or_else(|| Error::Device("decode plan without context lengths".into()))?;
                let g = decode_heads_per_cta(shape.num_heads, shape.num_kv_heads)
                    .ok_or_else(|| Error::Shape { op: "attention", reason: "heads do not group".into() })?;
                let groups = shape.num_heads / g;
                let ps = attn_plan::partition_size(max_context, groups * rows, self.sm_count);
                let parts = max_context.div_ceil(ps).max(1);
                let part_len = if parts > 1 { rows * shape.num_heads * parts } else { 1 };
                let mut part_out = self.uninit(part_len * shape.head_dim * 4)?;
                let mut part_ml = self.uninit(part_len * 2 * 4)?;
                let (bs, mb, psi, np) = (
                    int("attention", cache.block_size)?,
                    int("attention", max_blocks)?,
                    int("attention", ps)?,
                    int("attention", parts)?,
                );
                // SAFETY: paged_attention_decode[_q8_0]_<t>(q, k_cache, v_cache, block_tables, context_lens, part_out,
                // part_ml, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size,
                // scale, q_stride): one "sequence" per row of q/out; tables are rows × max_blocks of blocks inside
                // the cache; part buffers hold rows × n_heads × parts entries when parts > 1 (unused otherwise).
                unsafe {
                    self.launch(&cache.kernel("paged_attention_decode", self.act), (parts, groups, rows), 256, |b| {
                        b.arg(&q.buf).arg(&cache.k).arg(&cache.v).arg(&idx.first).arg(lens);
                        b.arg(&mut part_out).arg(&mut part_ml).arg(&mut out.buf);
                        b.arg(&n_heads).arg(&n_kv).arg(&hd).arg(&bs).arg(&mb).arg(&psi).arg(&scale).arg(&q_dim);
                    })?;
                }
                if parts > 1 {
                    // SAFETY: paged_attention_reduce_<t>(part_out, part_ml, context_lens, out, n_heads, head_dim,
                    // num_partitions, partition_size) over the buffers the decode launch filled.
                    unsafe {
                        self.launch(
                            &format!("paged_attention_reduce_{}", self.act),
                            (shape.num_heads, rows, 1),
                            128,
                            |b| {
                                b.arg(&part_out).arg(&part_ml).arg(lens).arg(&mut out.buf);
                                b.arg(&n_heads).arg(&hd).arg(&np).arg(&psi);
                            },
                        )?;
                    }
                }
            }
        }
        Ok(out)
    }
}
