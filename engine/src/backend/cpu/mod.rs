//! The CPU backend: f32 activations, weights in their storage type, KV in any [`KvDtype`], rayon over a
//! private thread pool.
//! It is the reference every other backend and the distributed path are checked against.

mod arena;
mod attention;
mod claim;
pub(crate) mod exp;
mod half_dot;
mod interleaved;
mod isa;
pub mod kernel_bench;
mod kernels;
mod kv;
mod matmul;
mod pages;
mod qgemm;
pub mod simd;
mod spin;
#[cfg(target_arch = "x86_64")]
mod unpack;
mod written;

pub use self::isa::CpuIsa;
pub use self::kv::CpuKvLayer;
use super::{AttnSeq, AttnShape, Backend};
use crate::tensor::{Bytes, DType, HostTensor, Paging};
use crate::{Error, KvDtype, Result};
use rayon::prelude::*;
use simd::Isa;
use written::{Split, written};

/// Row-major f32 activations.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    /// Elements, `rows × cols`.
    pub data: Vec<f32>,
    /// Rows (tokens).
    pub rows: usize,
    /// Columns (features).
    pub cols: usize,
}

/// A weight matrix `[rows, cols]` in its storage type.
#[derive(Debug, Clone)]
pub struct CpuMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Storage type.
    pub dtype: DType,
    /// Storage: see `layout`.
    pub bytes: Bytes,
    /// How `bytes` hold the rows.
    pub layout: Layout,
}

/// How a [`CpuMatrix`] holds its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Row after row, GGML blocks for quantized types (as a file has them).
    Rows,
    /// The 32-element block formats in groups of 16 rows side by side (`interleaved`), as resident and
    /// offloaded Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights are kept.
    Interleaved(interleaved::Format),
}

impl Layout {
    /// The interleaved format, if this is [`Layout::Interleaved`].
    fn interleaved(self) -> Option<interleaved::Format> {
        match self {
            Layout::Interleaved(f) => Some(f),
            Layout::Rows => None,
        }
    }
}

impl CpuMatrix {
    /// Bytes per row ([`Layout::Rows`]).
    pub fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }
}

/// The CPU device.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    /// Where resident weights are copied; `None` where the system grants no transparent huge pages.
    arena: Option<arena::WeightArena>,
    /// Whether short passes spin, from their own times.
    spin: std::sync::Mutex<spin::Choice>,
}

/// The worker threads a `threads` setting means: itself, or one per core for 0.
pub fn threads_or_cores(threads: usize) -> usize {
    if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads }
}

impl CpuBackend {
    /// A backend using `threads` worker threads (0: one per core) and the best instruction set this CPU has.
    pub fn new(threads: usize) -> Result<Self> {
        Self::with_isa(threads, CpuIsa::Auto)
    }

    /// A backend using `threads` worker threads (0: one per core) and the instruction set `isa` names, which this
    /// CPU must have.
    pub fn with_isa(threads: usize, isa: CpuIsa) -> Result<Self> {
        let isa = isa.resolve()?;
        let threads = threads_or_cores(threads);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("strata-cpu-{i}"))
            .build()
            .map_err(|e| Error::Device(format!("cannot start CPU thread pool: {e}")))?;
        Ok(CpuBackend { pool, threads, isa, arena: arena::WeightArena::if_supported(), spin: Default::default() })
    }

    /// The same backend restricted to portable scalar kernels (for testing the SIMD ones).
    pub fn scalar(threads: usize) -> Result<Self> {
        Self::with_isa(threads, CpuIsa::Level(Isa::Scalar))
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// `t`'s shape and type over `bytes` (its own or a copy).
fn cpu_matrix(t: &HostTensor, bytes: Bytes) -> Result<CpuMatrix> {
    if t.shape.len() != 2 {
        return Err(Error::Shape { op: "upload_matrix", reason: format!("expected 2-D, got {:?}", t.shape) });
    }
    Ok(CpuMatrix { rows: t.shape[0], cols: t.shape[1], dtype: t.dtype, bytes, layout: Layout::Rows })
}

/// `t` as a matrix the kernels read in another layout than the file's, without its bytes, and that layout's
/// format: the 32-element block formats ([`interleaved`]).
fn to_repack(t: &HostTensor) -> Result<Option<(CpuMatrix, interleaved::Format)>> {
    let m = cpu_matrix(t, Bytes::owned(&[]))?;
    Ok(interleaved::Format::of(m.dtype).map(|f| (CpuMatrix { layout: Layout::Interleaved(f), ..m }, f)))
}

fn same_shape(op: &'static str, a: &CpuTensor, b: &CpuTensor) -> Result<()> {
    if a.rows == b.rows && a.cols == b.cols {
        Ok(())
    } else {
        Err(Error::Shape { op, reason: format!("{}x{} vs {}x{}", a.rows, a.cols, b.rows, b.cols) })
    }
}

/// Rows from which the row-wise steps (norms, RoPE, the residual add) split them among the pool's threads (a
/// prompt's; one row's sum of squares is a serial chain of float adds, ~0.5 µs for 576 columns, too short to share
/// out for a decode step's few).
const PARALLEL_ROWS: usize = spin::MIN_TOKENS;

/// Each `w.len()`-long slice of `x` (a row, or a head of one) over its root mean square, times `w`; the caller has
/// checked that the slices tile the rows. Slices are independent, so splitting them among threads changes no bit.
fn rms_norm_slices(pool: &rayon::ThreadPool, x: &CpuTensor, w: &[f32], eps: f32) -> CpuTensor {
    let norm = |i: usize, dst: &mut [f32]| {
        let src = &x.data[i * w.len()..][..w.len()];
        let ss: f32 = src.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((d, s), w) in dst.iter_mut().zip(src).zip(w) {
            *d = s * inv * w;
        }
    };
    let out = if x.rows >= PARALLEL_ROWS {
        pool.install(|| written(x.data.len(), w.len(), Split::Parallel { min_chunks: 8 }, 0.0, norm))
    } else {
        written(x.data.len(), w.len(), Split::Serial, 0.0, norm)
    };
    CpuTensor { data: out, rows: x.rows, cols: x.cols }
}

impl Backend for CpuBackend {
    type Act = CpuTensor;
    type Mat = CpuMatrix;
    type Vector = Vec<f32>;
    type KvLayer = CpuKvLayer;

    fn name(&self) -> String {
        format!("cpu ({} threads, {})", self.threads, self.isa.name())
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn scope_pass<R: Send>(&self, tokens: usize, f: impl FnOnce() -> R + Send) -> R {
        if self.threads == 1 {
            return self.pool.install(f);
        }
        if tokens >= spin::MIN_TOKENS {
            return spin::while_running(&self.pool, f);
        }
        // A poisoned lock only means a pass panicked while recording: the choice itself is still whole.
        let mode = self.spin.lock().unwrap_or_else(|e| e.into_inner()).mode(tokens);
        let start = std::time::Instant::now();
        let out = match mode {
            spin::Mode::Spin => spin::while_running(&self.pool, f),
            spin::Mode::Sleep => self.pool.install(f),
        };
        self.spin.lock().unwrap_or_else(|e| e.into_inner()).record(tokens, mode, start.elapsed());
        out
    }

    /// Resident weights are copied into huge pages where the system has them (`arena`); those of the 32-element
    /// block formats are repacked (`interleaved`) on the way.
    fn upload_matrix(&self, t: &HostTensor) -> Result<CpuMatrix> {
        if let Some((m, f)) = to_repack(t)? {
            let file = t.bytes.as_slice();
            let bytes = match &self.arena {
                // The backend's threads repack row groups side by side.
                Some(arena) => arena.write(interleaved::packed_len(f, m.rows, m.cols), |dst| {
                    self.pool.install(|| interleaved::pack_into(f, file, m.rows, m.cols, dst))
                })?,
                None => Bytes::owned(&self.pool.install(|| interleaved::pack(f, file, m.rows, m.cols))?),
            };
            t.bytes.advise(Paging::DontNeed)?;
            return Ok(CpuMatrix { bytes, ..m });
        }
        let m = cpu_matrix(t, t.bytes.clone())?;
        let Some(arena) = &self.arena else {
            return Ok(m);
        };
        let bytes = arena.copy(t.bytes.as_slice())?;
        // The file's pages are not read again: let them leave this process's resident set.
        t.bytes.advise(Paging::DontNeed)?;
        Ok(CpuMatrix { bytes, ..m })
    }

    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn matrix_bytes(&self, m: &CpuMatrix) -> usize {
        m.bytes.len()
    }

    fn rows_independent(&self, m: &CpuMatrix) -> bool {
        // f32 weights with several tokens go to the `gemm` crate, whose summation order differs from the
        // row-wise kernels every other type (and f32 with fewer tokens) uses.
        m.dtype != DType::F32
    }

    /// Offloaded matrices page in from their file on use and out after their layer ([`Backend::release_layer`]);
    /// ones converted at load or repacked (`interleaved`: no file holds them in that form) are first written to
    /// a temporary file in `TMPDIR`.
    fn upload_matrix_offloaded(&self, t: &HostTensor) -> Result<CpuMatrix> {
        if let Some((m, f)) = to_repack(t)? {
            let packed = self.pool.install(|| interleaved::pack(f, t.bytes.as_slice(), m.rows, m.cols))?;
            let bytes = Bytes::spilled(&packed, &std::env::temp_dir())?;
            t.bytes.advise(Paging::DontNeed)?;
            return Ok(CpuMatrix { bytes, ..m });
        }
        cpu_matrix(t, t.bytes.spill(&std::env::temp_dir())?)
    }

    /// Starts reading the next offloaded layer's pages while this one runs.
    fn stage_layer(&self, _layer: &[&CpuMatrix], next: &[&CpuMatrix]) -> Result<()> {
        next.iter().try_for_each(|m| m.bytes.advise(Paging::WillNeed))
    }

    fn release_layer(&self, layer: &[&CpuMatrix]) -> Result<()> {
        layer.iter().try_for_each(|m| m.bytes.advise(Paging::DontNeed))
    }

    fn prefault_kv_layer(&self, layer: &mut CpuKvLayer) {
        layer.prefault();
    }

    fn alloc_kv_layer(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        dtype: KvDtype,
    ) -> Result<CpuKvLayer> {
        CpuKvLayer::new(num_blocks, block_size, kv_dim, dtype)
    }

    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuTensor> {
        if data.len() != rows * cols {
            return Err(Error::Shape {
                op: "act_from_host",
                reason: format!("{} values for {rows}x{cols}", data.len()),
            });
        }
        Ok(CpuTensor { data: data.to_vec(), rows, cols })
    }

    fn act_to_host(&self, a: &CpuTensor) -> Result<Vec<f32>> {
        Ok(a.data.clone())
    }

    fn act_shape(&self, a: &CpuTensor) -> (usize, usize) {
        (a.rows, a.cols)
    }

    fn embed(&self, table: &CpuMatrix, ids: &[u32]) -> Result<CpuTensor> {
        matmul::embed(table, ids)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> Result<CpuTensor> {
        if w.len() != x.cols {
            return Err(Error::Shape { op: "rms_norm", reason: format!("weight {} for {} columns", w.len(), x.cols) });
        }
        Ok(rms_norm_slices(&self.pool, x, w, eps))
    }

    fn rms_norm_heads(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> Result<CpuTensor> {
        if w.is_empty() || !x.cols.is_multiple_of(w.len()) {
            return Err(Error::Shape {
                op: "rms_norm_heads",
                reason: format!("heads of {} do not tile {} columns", w.len(), x.cols),
            });
        }
        Ok(rms_norm_slices(&self.pool, x, w, eps))
    }

    fn linear(&self, x: &CpuTensor, w: &CpuMatrix, bias: Option<&Vec<f32>>) -> Result<CpuTensor> {
        let mut out =
            self.pool.install(|| matmul::linear_many(self.isa, self.threads, x, &[(w, bias.map(Vec::as_slice))]))?;
        Ok(out.remove(0))
    }

    fn linear_many(&self, x: &CpuTensor, ws: &[(&CpuMatrix, Option<&Vec<f32>>)]) -> Result<Vec<CpuTensor>> {
        let jobs: Vec<matmul::Job<'_>> = ws.iter().map(|(w, b)| (*w, b.map(Vec::as_slice))).collect();
        self.pool.install(|| matmul::linear_many(self.isa, self.threads, x, &jobs))
    }

    fn rope(&self, x: &mut CpuTensor, positions: &[u32], inv_freq: &[f32], head_dim: usize) -> Result<()> {
        if positions.len() != x.rows || !x.cols.is_multiple_of(head_dim) || inv_freq.len() * 2 != head_dim {
            return Err(Error::Shape {
                op: "rope",
                reason: format!("{} positions for {} rows", positions.len(), x.rows),
            });
        }
        let (half, cols) = (head_dim / 2, x.cols);
        // A run of rows and their positions; each row's angles computed once for all its heads.
        let rotate = |(rows, positions): (&mut [f32], &[u32])| {
            let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
            for (row, &pos) in rows.chunks_exact_mut(cols).zip(positions) {
                for j in 0..half {
                    let a = pos as f32 * inv_freq[j];
                    (sin[j], cos[j]) = a.sin_cos();
                }
                for head in row.chunks_exact_mut(head_dim) {
                    let (lo, hi) = head.split_at_mut(half);
                    for j in 0..half {
                        let (a, b) = (lo[j], hi[j]);
                        lo[j] = a * cos[j] - b * sin[j];
                        hi[j] = b * cos[j] + a * sin[j];
                    }
                }
            }
        };
        // Rows are independent, so a prompt's are split among the threads as the norms are (no bit changes);
        // serial, a 128-token prompt's rotations kept the pool's other thread spinning.
        if x.rows >= PARALLEL_ROWS {
            const RUN: usize = 8;
            let runs = x.data.par_chunks_mut(RUN * cols).zip(positions.par_chunks(RUN));
            self.pool.install(|| runs.for_each(rotate));
        } else {
            rotate((&mut x.data, positions));
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut CpuKvLayer,
        seqs: &[AttnSeq<'_>],
        shape: AttnShape,
    ) -> Result<CpuTensor> {
        if k.cols != cache.kv_dim || v.cols != cache.kv_dim || q.cols != shape.num_heads * shape.head_dim {
            return Err(Error::Shape { op: "attention", reason: "q/k/v widths do not match the cache".into() });
        }
        cache.write(k, v, seqs)?;
        Ok(self.pool.install(|| attention::attend(self.isa, q, cache, seqs, shape)))
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        same_shape("silu_mul", gate, up)?;
        // Elementwise, so splitting it changes no bit; serial, its exps were ~10 % of a batch-16 decode step.
        const CHUNK: usize = 4096;
        let silu = |i: usize, o: &mut [f32]| {
            let at = i * CHUNK..i * CHUNK + o.len();
            exp::silu_mul(self.isa, &gate.data[at.clone()], &up.data[at], o)
        };
        let n = gate.data.len();
        let data = if n > CHUNK {
            self.pool.install(|| written(n, CHUNK, Split::Parallel { min_chunks: 1 }, 0.0, silu))
        } else {
            written(n, CHUNK, Split::Serial, 0.0, silu)
        };
        Ok(CpuTensor { data, rows: gate.rows, cols: gate.cols })
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape("add", x, y)?;
        let add = |(a, b): (&mut [f32], &[f32])| a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        if x.rows >= PARALLEL_ROWS {
            let rows = x.data.par_chunks_mut(x.cols).zip(y.data.par_chunks(x.cols));
            self.pool.install(|| rows.with_min_len(8).for_each(add));
        } else {
            add((&mut x.data, &y.data));
        }
        Ok(())
    }

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            if r >= x.rows {
                return Err(Error::Shape { op: "select_rows", reason: format!("row {r} of {}", x.rows) });
            }
            data.extend_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        Ok(CpuTensor { data, rows: rows.len(), cols: x.cols })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompts_rows_split_among_threads_give_each_rows_own_bits() -> Result<()> {
        // RoPE and the residual add over a prompt's rows (split among the threads from `PARALLEL_ROWS`, in runs)
        // against the same rows one at a time (serial): the same bits, each row at its own position.
        let be = CpuBackend::new(2)?;
        let (head_dim, heads, rows) = (8, 3, PARALLEL_ROWS + 13);
        let cols = head_dim * heads;
        let inv_freq: Vec<f32> = (0..head_dim / 2).map(|j| 10000f32.powf(-2.0 * j as f32 / head_dim as f32)).collect();
        let positions: Vec<u32> = (0..rows as u32).map(|r| 3 * r + 5).collect();
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 7.0;
        let x = CpuTensor { data: (0..rows * cols).map(value).collect(), rows, cols };
        let y = CpuTensor { data: (0..rows * cols).map(|i| value(i + 11)).collect(), rows, cols };
        let (mut rotated, mut summed) = (x.clone(), x.clone());
        be.rope(&mut rotated, &positions, &inv_freq, head_dim)?;
        be.add_assign(&mut summed, &y)?;
        for r in 0..rows {
            let row = |t: &CpuTensor| CpuTensor { data: t.data[r * cols..(r + 1) * cols].to_vec(), rows: 1, cols };
            let mut one = row(&x);
            be.rope(&mut one, &positions[r..r + 1], &inv_freq, head_dim)?;
            assert_eq!(bits(&one.data), bits(&rotated.data[r * cols..(r + 1) * cols]), "RoPE, row {r}");
            let mut one = row(&x);
            be.add_assign(&mut one, &row(&y))?;
            assert_eq!(bits(&one.data), bits(&summed.data[r * cols..(r + 1) * cols]), "residual add, row {r}");
        }
        assert_ne!(bits(&rotated.data), bits(&x.data), "the rotation changed the rows");
        Ok(())
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn resident_weights_are_copied_into_the_arena_and_offloaded_ones_are_not() -> Result<()> {
        let values: Vec<f32> = (0..64 * 32).map(|i| i as f32 * 0.5).collect();
        let t =
            HostTensor { dtype: DType::F32, shape: vec![64, 32], bytes: Bytes::owned(bytemuck::cast_slice(&values)) };
        let x = CpuTensor { data: (0..32).map(|i| i as f32).collect(), rows: 1, cols: 32 };
        let mut outputs = Vec::new();
        for arena in [None, Some(arena::WeightArena::new())] {
            let with_arena = arena.is_some();
            let be = CpuBackend { arena, ..CpuBackend::new(2)? };
            let m = be.upload_matrix(&t)?;
            assert_eq!(matches!(m.bytes, Bytes::Arena(_)), with_arena, "{:?}", m.bytes);
            assert!(m.bytes.as_slice() == t.bytes.as_slice());
            let off = be.upload_matrix_offloaded(&t)?;
            assert!(matches!(off.bytes, Bytes::Mapped { .. }), "offloaded weights stay file-backed: {:?}", off.bytes);
            outputs.push(be.linear(&x, &m, None)?);
        }
        assert_eq!(outputs[0], outputs[1]);
        Ok(())
    }

    /// Q8_0 weights are repacked resident and offloaded alike ([`interleaved`]): the same products bit for bit,
    /// close to the dequantized weights' products, and embedding rows equal to the file's dequantized rows.
    #[test]
    fn q8_0_weights_are_repacked_resident_and_offloaded_alike() -> Result<()> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (rows, cols, tokens) = (40, 64, 3);
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let file = crate::quant::quantize(DType::Q8_0, &values);
        let t = HostTensor { dtype: DType::Q8_0, shape: vec![rows, cols], bytes: Bytes::owned(&file) };
        let be = CpuBackend::new(2)?;
        let (m, off) = (be.upload_matrix(&t)?, be.upload_matrix_offloaded(&t)?);
        let layout = Layout::Interleaved(interleaved::Format::Q8_0);
        assert_eq!((m.layout, off.layout), (layout, layout));
        assert!(matches!(off.bytes, Bytes::Mapped { .. }), "offloaded weights stay file-backed: {:?}", off.bytes);
        let x = CpuTensor {
            data: (0..tokens * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
            rows: tokens,
            cols,
        };
        let y = be.linear(&x, &m, None)?;
        assert_eq!(y, be.linear(&x, &off, None)?);
        let mut w = vec![0f32; rows * cols];
        crate::quant::dequantize(DType::Q8_0, &file, &mut w);
        for (t, xt) in x.data.chunks_exact(cols).enumerate() {
            for (r, wr) in w.chunks_exact(cols).enumerate() {
                let want: f32 = wr.iter().zip(xt).map(|(a, b)| a * b).sum();
                // The activations' 8-bit rounding: at most half a step (max |x| / 127) per element.
                let amax = xt.iter().fold(0f32, |m, v| m.max(v.abs()));
                let bound = wr.iter().map(|v| v.abs()).sum::<f32>() * amax / 254.0 + 1e-4;
                let got = y.data[t * rows + r];
                assert!((got - want).abs() <= bound, "({t}, {r}): {got} vs {want}");
            }
        }
        let ids = [0u32, 17, 39];
        let rows_out = be.embed(&m, &ids)?;
        for (got, &id) in rows_out.data.chunks_exact(cols).zip(&ids) {
            assert!(got == &w[id as usize * cols..][..cols], "embedding row {id}");
        }
        Ok(())
    }
}
