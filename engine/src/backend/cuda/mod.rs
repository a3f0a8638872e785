//! The CUDA backend: strata's kernels (compiled with NVRTC at start) and cuBLAS behind the [`Backend`] trait.
//!
//! - Activations, norm weights, biases and the KV cache are kept in one activation type (bf16 by default on
//!   sm_80+, f16 below; f32 for parity tests); the KV cache may be Q8_0 blocks instead (`--kv-dtype q8_0`). Float weights are converted to it on upload so cuBLAS runs one
//!   type; block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) stay in their
//!   blocks and run through the `gemv_*`/`gemm_*`/`dequantize_*`/`embedding_*` kernels named after the format
//!   (`quant`); a block format without those kernels (Q8_K, or one the CPU backend gains first) is refused at
//!   upload, naming the format.
//! - Work runs on one compute stream; a second stream copies offloaded layers in (see `staging`). cudarc's
//!   automatic per-buffer event tracking is off: every buffer is allocated, used and freed on the compute
//!   stream, and the only cross-stream traffic (weight staging) is ordered by explicit events.
//! - Activations enter and leave through pinned host buffers.
//!
//! Nothing here has run on a GPU yet (no GPU was available when it was written); the parity tests in
//! `engine/tests/cuda.rs` and `scripts/gpu-check.sh` are how it gets checked.

mod attn_plan;
mod compile;
mod ops;
mod pool;
mod quant;
mod staging;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

pub use self::attn_plan::{AttnMode, AttnPlan, partition_size};
use self::compile::{Arch, Kernels};
pub use self::compile::{cache_file_name, default_cache_dir, find_cuda_include, functions_to_resolve};
use self::staging::{HostWeight, Staging};
use super::{AttnSeq, AttnShape, Backend};
use crate::config::ModelConfig;
use crate::tensor::{DType, HostTensor};
use crate::{Error, KvDtype, Result};

/// Wraps a CUDA-side error with what was being done.
pub(crate) fn dev_err<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> Error {
    move |e| Error::Device(format!("{what}: {e}"))
}

/// How to open a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// Device ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Activation (and float weight) type; `None` picks bf16 on sm_80+ and f16 below.
    pub act_dtype: Option<DType>,
    /// Where compiled kernels are cached (`None`: compile at every start).
    pub cache_dir: Option<PathBuf>,
    /// Directories holding the CUDA headers NVRTC needs (`cuda_fp16.h`); only used on a cache miss.
    pub include_dirs: Vec<PathBuf>,
    /// Device memory the process may use; checked against the device's size at start.
    pub memory_limit: Option<usize>,
}

impl CudaOptions {
    /// Options for `cuda:ordinal` with the cache and header locations found through `env` (the binaries pass
    /// `|k| std::env::var(k).ok()`).
    pub fn from_env(ordinal: usize, env: impl Fn(&str) -> Option<String>) -> Self {
        CudaOptions {
            ordinal,
            cache_dir: default_cache_dir(&env),
            include_dirs: find_cuda_include(&env),
            ..CudaOptions::default()
        }
    }
}

/// Activations `[rows, cols]` on the device, in the backend's activation type.
pub struct CudaAct {
    buf: CudaSlice<u8>,
    rows: usize,
    cols: usize,
}

enum Store {
    Device(CudaSlice<u8>),
    Host(HostWeight),
}

/// A weight matrix `[rows, cols]`: on the device, or in pinned host memory when its layer is offloaded.
pub struct CudaMatrix {
    rows: usize,
    cols: usize,
    dtype: DType,
    store: Store,
}

/// A vector (norm weight, bias) in the activation type.
pub struct CudaVector {
    buf: CudaSlice<u8>,
    len: usize,
}

/// Paged keys and values of one layer, `[num_blocks, block_size, kv_dim]` each, in the activation type or as
/// Q8_0 blocks.
pub struct CudaKvLayer {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    num_blocks: usize,
    block_size: usize,
    kv_dim: usize,
    dtype: KvDtype,
}

impl CudaKvLayer {
    /// The name of kernel `op` for this cache with `act` activations: `<op>_<act>`, `<op>_q8_0_<act>` for Q8_0.
    fn kernel(&self, op: &str, act: DType) -> String {
        match self.dtype {
            KvDtype::Q8_0 => format!("{op}_q8_0_{act}"),
            _ => format!("{op}_{act}"),
        }
    }
}

/// A pinned host buffer and the event that marks the end of the last copy that used it.
struct PinnedBuf {
    buf: PinnedHostSlice<u8>,
    done: CudaEvent,
}

/// Pinned buffers for activations in and out, kept by exact size (a copy moves a whole buffer), most recently
/// used last; decode steps reuse theirs every step.
#[derive(Default)]
struct HostIo {
    up: Vec<PinnedBuf>,
    down: Vec<PinnedBuf>,
}

/// Pinned buffers kept per direction.
const PINNED_KEEP: usize = 8;

/// Small index arrays uploaded for one forward and reused by its layers (same content, same device copy).
#[derive(Default)]
struct IndexCache {
    positions: Option<(Vec<i32>, CudaSlice<i32>)>,
    inv_freq: Option<(Vec<f32>, CudaSlice<f32>)>,
    attention: Option<(AttnPlan, ops::AttnIndices)>,
}

/// One GPU.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    act: DType,
    arch: Arch,
    sm_count: usize,
    total_memory: usize,
    name: String,
    next_id: AtomicU64,
    staging: Mutex<Staging>,
    io: Mutex<HostIo>,
    index: Mutex<IndexCache>,
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    m.lock().map_err(|_| Error::Device(format!("the CUDA backend's {what} lock was poisoned by a panic")))
}

impl CudaBackend {
    /// Opens `cuda:N`, compiles (or loads cached) kernels and resolves every entry point. Without an NVIDIA
    /// driver, or when anything in CUDA's initialisation fails, this returns an error and never panics.
    pub fn new(opts: CudaOptions) -> Result<Self> {
        let n = opts.ordinal;
        // SAFETY: only tries to open the driver library; cudarc would panic on first use without it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Device(format!(
                "CUDA driver not found: --device cuda:{n} needs an NVIDIA GPU and driver"
            )));
        }
        // cudarc loads CUDA symbols lazily and panics on a missing one (e.g. a driver older than the API it
        // was built for); turn that into an error too.
        catch_unwind(AssertUnwindSafe(|| Self::init(&opts))).unwrap_or_else(|p| {
            Err(Error::Device(format!("CUDA initialisation of cuda:{n} failed: {}", panic_message(p.as_ref()))))
        })
    }

    fn init(opts: &CudaOptions) -> Result<Self> {
        let n = opts.ordinal;
        let ctx = CudaContext::new(n).map_err(|e| {
            let count = CudaContext::device_count().map_or_else(|_| "an unknown number of".into(), |c| c.to_string());
            Error::Device(format!("cannot open cuda:{n} ({count} CUDA devices visible): {e}"))
        })?;
        // SAFETY: called before any stream or buffer exists. From here on the backend orders cross-stream work
        // itself: every buffer lives and dies on the compute stream, and the copy stream only fills staging
        // slots between explicit events (see `staging`).
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(dev_err("reading the compute capability"))?;
        let arch: Arch = (major.max(0) as u32, minor.max(0) as u32);
        let cc = arch.0 * 10 + arch.1;
        if cc < strata_kernels::MIN_COMPUTE_CAPABILITY {
            return Err(Error::Device(format!(
                "cuda:{n} is sm_{cc}; strata's kernels need sm_{} or newer",
                strata_kernels::MIN_COMPUTE_CAPABILITY
            )));
        }
        let act = match opts.act_dtype {
            None if arch.0 >= 8 => DType::BF16,
            None => DType::F16,
            Some(d) if d.is_quantized() => {
                return Err(Error::Device(format!("activations cannot be {d}; use f32, f16 or bf16")));
            }
            Some(DType::BF16) if arch.0 < 8 => {
                return Err(Error::Device(format!("bf16 needs sm_80 or newer; cuda:{n} is sm_{cc} (use --dtype f16)")));
            }
            Some(d) => d,
        };
        let total_memory = ctx.total_mem().map_err(dev_err("reading the device memory size"))?;
        if let Some(limit) = opts.memory_limit
            && limit > total_memory
        {
            return Err(Error::Device(format!(
                "GPU memory limit of {limit} bytes exceeds cuda:{n}'s {total_memory} bytes"
            )));
        }
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err("reading the SM count"))?
            .max(1) as usize;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let compute = ctx.new_stream().map_err(dev_err("creating the compute stream"))?;
        let copy = ctx.new_stream().map_err(dev_err("creating the copy stream"))?;
        // SAFETY: only tries to open the cuBLAS library; cudarc would panic on first use without it.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::Device(
                "cuBLAS (libcublas.so) not found: install the CUDA toolkit or the nvidia-cublas wheel and put its \
                 lib directory on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let blas = CudaBlas::new(compute.clone()).map_err(dev_err("creating the cuBLAS handle"))?;
        let kernels = Kernels::load(&ctx, arch, opts.cache_dir.as_deref(), &opts.include_dirs)?;
        tracing::info!(device = n, kernels = kernels.len(), sm = cc, "CUDA kernels loaded");
        let staging = Staging::new(compute.clone(), copy.clone())?;
        Ok(CudaBackend {
            name: format!("cuda:{n} ({device_name}, sm_{cc}, {act} activations)"),
            ctx,
            compute,
            copy,
            blas,
            kernels,
            act,
            arch,
            sm_count,
            total_memory,
            next_id: AtomicU64::new(1),
            staging: Mutex::new(staging),
            io: Mutex::new(HostIo::default()),
            index: Mutex::new(IndexCache::default()),
        })
    }

    /// The activation type.
    pub fn act_dtype(&self) -> DType {
        self.act
    }

    /// Device memory in bytes.
    pub fn total_memory(&self) -> usize {
        self.total_memory
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.arch
    }

    /// Waits for all queued work (benchmarks time with this).
    pub fn synchronize(&self) -> Result<()> {
        self.copy.synchronize().and(self.compute.synchronize()).map_err(dev_err("synchronizing"))
    }

    /// Host bytes of `t` as stored on this device: float weights converted to the activation type.
    fn device_tensor(&self, t: &HostTensor) -> Result<HostTensor> {
        if t.shape.len() != 2 {
            return Err(Error::Shape { op: "upload_matrix", reason: format!("expected 2-D, got {:?}", t.shape) });
        }
        if t.dtype.is_quantized() {
            quant::check_upload(t.dtype, t.shape[1], self.act)?;
            return Ok(t.clone());
        }
        Ok(t.convert(self.act))
    }

    /// Pinned memory of `len` bytes; `write_combined` for buffers the CPU only writes (faster to copy from,
    /// very slow to read).
    fn pinned(&self, len: usize, write_combined: bool) -> Result<PinnedHostSlice<u8>> {
        let flags = if write_combined { cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED } else { 0 };
        // SAFETY: cudarc marks the allocation unsafe because it is uninitialised; u8 has no invalid values and
        // every caller writes (or copies into) the whole buffer before reading it.
        unsafe { self.ctx.alloc_pinned_with_flags::<u8>(len.max(1), flags) }
            .map_err(dev_err("allocating pinned memory"))
    }

    fn pinned_buf(&self, pool: &mut Vec<PinnedBuf>, len: usize, write_combined: bool) -> Result<PinnedBuf> {
        if let Some(i) = pool.iter().position(|b| b.buf.len() == len) {
            return Ok(pool.remove(i));
        }
        if pool.len() >= PINNED_KEEP {
            pool.remove(0);
        }
        let done = self.ctx.new_event(None).map_err(dev_err("creating an event"))?;
        Ok(PinnedBuf { buf: self.pinned(len, write_combined)?, done })
    }

    fn host_weights<'a>(mats: &[&'a CudaMatrix]) -> Vec<&'a HostWeight> {
        mats.iter()
            .filter_map(|m| match &m.store {
                Store::Host(h) => Some(h),
                Store::Device(_) => None,
            })
            .collect()
    }
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Mat = CudaMatrix;
    type Vector = CudaVector;
    type KvLayer = CudaKvLayer;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn check_model(&self, cfg: &ModelConfig) -> Result<()> {
        let shape = AttnShape {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size: 1,
        };
        attn_plan::check_shape(&shape)
    }

    fn upload_matrix(&self, t: &HostTensor) -> Result<CudaMatrix> {
        let t = self.device_tensor(t)?;
        let buf = self.compute.clone_htod(t.bytes.as_slice()).map_err(dev_err("uploading a weight"))?;
        Ok(CudaMatrix { rows: t.shape[0], cols: t.shape[1], dtype: t.dtype, store: Store::Device(buf) })
    }

    fn upload_matrix_offloaded(&self, t: &HostTensor) -> Result<CudaMatrix> {
        let t = self.device_tensor(t)?;
        let src = t.bytes.as_slice();
        let mut bytes = self.pinned(src.len(), true)?;
        bytes.as_mut_slice().map_err(dev_err("writing pinned memory"))?[..src.len()].copy_from_slice(src);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Ok(CudaMatrix {
            rows: t.shape[0],
            cols: t.shape[1],
            dtype: t.dtype,
            store: Store::Host(HostWeight { id, bytes }),
        })
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaVector> {
        let bytes = ops::host_to_act_bytes(self.act, v);
        let buf = self.compute.clone_htod(&bytes).map_err(dev_err("uploading a vector"))?;
        Ok(CudaVector { buf, len: v.len() })
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> usize {
        match &m.store {
            Store::Device(b) => b.len(),
            Store::Host(h) => h.bytes.len(),
        }
    }

    fn storage_dtype(&self, dtype: DType) -> DType {
        if dtype.is_quantized() { dtype } else { self.act }
    }

    fn device_memory_capacity(&self) -> Option<usize> {
        Some(self.total_memory)
    }

    fn reset_allocation_peak(&self) -> Result<()> {
        // Work still queued may free memory; let it finish so the new mark starts from what stays.
        self.compute.synchronize().map_err(dev_err("waiting for the compute stream"))?;
        pool::reset_peak(&self.ctx)
    }

    fn allocation_peak(&self) -> Result<Option<usize>> {
        self.compute.synchronize().map_err(dev_err("waiting for the compute stream"))?;
        pool::peak(&self.ctx)
    }

    fn default_kv_dtype(&self) -> KvDtype {
        match self.act {
            DType::F16 => KvDtype::F16,
            DType::BF16 => KvDtype::Bf16,
            _ => KvDtype::F32,
        }
    }

    fn stage_layer(&self, layer: &[&CudaMatrix], next: &[&CudaMatrix]) -> Result<()> {
        let (now, next) = (Self::host_weights(layer), Self::host_weights(next));
        if now.is_empty() && next.is_empty() {
            return Ok(());
        }
        lock(&self.staging, "staging")?.stage(&now, &next)
    }

    fn alloc_kv_layer(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        dtype: KvDtype,
    ) -> Result<CudaKvLayer> {
        // The kernels keep the cache in the activation type or as Q8_0 blocks; a float type other than the
        // activations' would need conversions in every attention kernel.
        let act = self.default_kv_dtype();
        if dtype != act && dtype != KvDtype::Q8_0 {
            return Err(Error::KvDtypeUnsupported {
                device: self.name.clone(),
                dtype,
                reason: format!(
                    "a GPU keeps KV in its activation type or q8_0; use --kv-dtype {act} or q8_0, or --dtype {dtype} \
                     for {dtype} activations"
                ),
            });
        }
        let bytes = num_blocks * block_size * dtype.row_bytes(kv_dim)?;
        let k = self.compute.alloc_zeros::<u8>(bytes.max(1)).map_err(dev_err("allocating the KV cache"))?;
        let v = self.compute.alloc_zeros::<u8>(bytes.max(1)).map_err(dev_err("allocating the KV cache"))?;
        Ok(CudaKvLayer { k, v, num_blocks, block_size, kv_dim, dtype })
    }

    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaAct> {
        if data.len() != rows * cols {
            return Err(Error::Shape {
                op: "act_from_host",
                reason: format!("{} values for {rows}x{cols}", data.len()),
            });
        }
        self.upload_act(data, rows, cols)
    }

    fn act_to_host(&self, a: &CudaAct) -> Result<Vec<f32>> {
        self.download_act(a)
    }

    fn act_shape(&self, a: &CudaAct) -> (usize, usize) {
        (a.rows, a.cols)
    }

    fn embed(&self, table: &CudaMatrix, ids: &[u32]) -> Result<CudaAct> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(Error::InvalidRequest(format!("token id {bad} is outside the vocabulary of {}", table.rows)));
        }
        self.gather(table, ids.iter().map(|&i| i as usize))
    }

    fn rms_norm(&self, x: &CudaAct, w: &CudaVector, eps: f32) -> Result<CudaAct> {
        if w.len != x.cols {
            return Err(Error::Shape { op: "rms_norm", reason: format!("weight {} for {} columns", w.len, x.cols) });
        }
        self.rms_norm_impl(x, w, eps)
    }

    fn rms_norm_heads(&self, x: &CudaAct, w: &CudaVector, eps: f32) -> Result<CudaAct> {
        if w.len == 0 || !x.cols.is_multiple_of(w.len) {
            return Err(Error::Shape {
                op: "rms_norm_heads",
                reason: format!("heads of {} do not tile {} columns", w.len, x.cols),
            });
        }
        self.rms_norm_heads_impl(x, w, eps)
    }

    fn linear(&self, x: &CudaAct, w: &CudaMatrix, bias: Option<&CudaVector>) -> Result<CudaAct> {
        self.linear_impl(x, w, bias)
    }

    fn rope(&self, x: &mut CudaAct, positions: &[u32], inv_freq: &[f32], head_dim: usize) -> Result<()> {
        if positions.len() != x.rows
            || head_dim == 0
            || !x.cols.is_multiple_of(head_dim)
            || inv_freq.len() * 2 != head_dim
        {
            return Err(Error::Shape {
                op: "rope",
                reason: format!("{} positions for {} rows", positions.len(), x.rows),
            });
        }
        self.rope_impl(x, positions, inv_freq, head_dim)
    }

    fn attention(
        &self,
        q: &CudaAct,
        k: &CudaAct,
        v: &CudaAct,
        cache: &mut CudaKvLayer,
        seqs: &[AttnSeq<'_>],
        shape: AttnShape,
    ) -> Result<CudaAct> {
        let kv_dim = shape.num_kv_heads * shape.head_dim;
        if k.cols != cache.kv_dim
            || v.cols != cache.kv_dim
            || kv_dim != cache.kv_dim
            || q.cols != shape.num_heads * shape.head_dim
            || k.rows != q.rows
            || v.rows != q.rows
            || shape.block_size != cache.block_size
        {
            return Err(Error::Shape { op: "attention", reason: "q/k/v widths do not match the cache".into() });
        }
        attn_plan::check_shape(&shape)?;
        self.attention_impl(q, k, v, cache, seqs, shape)
    }

    fn silu_mul(&self, gate: &CudaAct, up: &CudaAct) -> Result<CudaAct> {
        ops::same_shape("silu_mul", gate, up)?;
        self.silu_mul_impl(gate, up)
    }

    fn add_assign(&self, x: &mut CudaAct, y: &CudaAct) -> Result<()> {
        ops::same_shape("add", x, y)?;
        self.add_impl(x, y)
    }

    fn select_rows(&self, x: &CudaAct, rows: &[usize]) -> Result<CudaAct> {
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(Error::Shape { op: "select_rows", reason: format!("row {r} of {}", x.rows) });
        }
        self.select_rows_impl(x, rows)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Let queued work finish before buffers (freed on the compute stream) and pinned memory go away.
        if let Err(e) = self.synchronize() {
            tracing::warn!(error = %e, "synchronizing cuda on drop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_new_is_an_error_not_a_panic() {
        // On machines with a GPU this opens it; either way it must return, never unwind.
        let r = catch_unwind(|| CudaBackend::new(CudaOptions { ordinal: 0, ..CudaOptions::default() }));
        let r = r.expect("CudaBackend::new must not panic");
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            let e = r.err().map(|e| e.to_string()).unwrap_or_default();
            assert_eq!(e, "device unavailable: CUDA driver not found: --device cuda:0 needs an NVIDIA GPU and driver");
        }
    }

    #[test]
    fn options_from_env_find_the_cache() {
        let o = CudaOptions::from_env(3, |k| (k == "XDG_CACHE_HOME").then(|| "/c".to_string()));
        assert_eq!((o.ordinal, o.cache_dir), (3, Some(PathBuf::from("/c/strata/kernels"))));
    }
}
