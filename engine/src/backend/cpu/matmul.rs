//! `x · wᵀ` for every weight storage type. Work is split over output rows, so each output element is
//! computed by exactly one sequential dot product: results do not depend on the thread count.

use rayon::prelude::*;

use super::half_dot::{self, Half};
use super::interleaved;
#[cfg(target_arch = "x86_64")]
use super::qgemm::{self, PackedActs};
use super::simd::{self, Isa, Q8Block, quantize_row_spans};
use super::written::{Split, written};
use super::{CpuMatrix, CpuTensor, Layout};
use super::{claim, spin};
use crate::quant::QK;
use crate::tensor::DType;
use crate::{Error, Result};

/// Output rows handed to one task: enough to amortize scheduling, few enough to balance the threads. A region
/// ends when its last task does, so the threads finish up to a task apart: a prompt's tasks (long, every row times
/// every token) are cut finer than a decode step's, whose tasks are short enough that scheduling them would show.
fn rows_per_task(n: usize, threads: usize, prompt: bool) -> usize {
    let per_thread = if prompt { 16 } else { 4 };
    (n / (threads * per_thread)).clamp(8, 512)
}

/// One matrix of a fused product and its optional bias.
pub type Job<'a> = (&'a CpuMatrix, Option<&'a [f32]>);

/// Computes `x · wᵢᵀ + biasᵢ` for every job. Matrices sharing an input (q/k/v, gate/up) run in one parallel
/// region and share one quantization of `x`.
pub fn linear_many(isa: Isa, threads: usize, x: &CpuTensor, jobs: &[Job<'_>]) -> Result<Vec<CpuTensor>> {
    let (m, k) = (x.rows, x.cols);
    for (w, bias) in jobs {
        if k != w.cols || bias.is_some_and(|b| b.len() != w.rows) {
            return Err(Error::Shape {
                op: "linear",
                reason: format!("x has {k} columns, weight is {}x{}", w.rows, w.cols),
            });
        }
        // The backend uploads these interleaved; their kernels read nothing else.
        if w.layout == Layout::Rows && interleaved::Format::of(w.dtype).is_some() {
            return Err(Error::Shape {
                op: "linear",
                reason: format!("{} weights must be uploaded (interleaved), not in the file's layout", w.dtype),
            });
        }
    }
    // f32 weights with several tokens go to the blocked GEMM; the rest share the row-wise path.
    if m >= 4 && jobs.iter().any(|(w, _)| w.dtype == DType::F32) {
        return jobs
            .iter()
            .map(|job| match job.0.dtype {
                DType::F32 => Ok(gemm_f32(x, bytemuck::cast_slice(job.0.bytes.as_slice()), job.0.rows, job.1)),
                _ => linear_many(isa, threads, x, std::slice::from_ref(job)).map(|mut v| v.remove(0)),
            })
            .collect();
    }
    let blocks = k / QK;
    // The K-quants' kernels take a scale per 256 activations (`interleaved::SUPER_SPAN` blocks), the others one
    // per block: each quantization made only if a job reads it.
    let span_of = |w: &CpuMatrix| w.layout.interleaved().map_or(1, |f| f.act_span());
    let quantize = |span: usize| {
        if !jobs.iter().any(|(w, _)| w.dtype.is_quantized() && span_of(w) == span) {
            return Vec::new();
        }
        let zero = Q8Block { d: 0.0, s: 0.0, qs: [0; QK] };
        let row = |i: usize, dst: &mut [Q8Block]| quantize_row_spans(isa, &x.data[i * k..][..k], dst, span);
        written(m * blocks, blocks, Split::Parallel { min_chunks: 1 }, zero, row)
    };
    let (xq, xk) = (quantize(1), quantize(interleaved::SUPER_SPAN));
    // Several tokens: the register-tiled kernel, on activations regrouped once for every job.
    let file_layout = |w: &CpuMatrix| w.dtype.is_quantized() && w.layout == Layout::Rows;
    #[cfg(target_arch = "x86_64")]
    let packed = (isa.avx2() && m >= 2 && jobs.iter().any(|(w, _)| file_layout(w))).then(|| {
        let lane_sums = jobs.iter().any(|(w, _)| file_layout(w) && qgemm::reads_lane_sums(isa, w.dtype));
        PackedActs::pack(&xq, m, blocks, lane_sums)
    });
    let tiles_read = |span: usize| jobs.iter().any(|(w, _)| w.layout.interleaved().is_some() && span_of(w) == span);
    let acts = tiles_read(1).then(|| interleaved::Acts::new(&xq, m, blocks));
    let acts_k = tiles_read(interleaved::SUPER_SPAN).then(|| interleaved::Acts::new(&xk, m, blocks));
    // A matrix the interleaved tiles take: its format and the activations they read, per block or (the K-quants)
    // per super-block.
    let tiles =
        |w: &CpuMatrix| w.layout.interleaved().zip(if span_of(w) == 1 { acts.as_ref() } else { acts_k.as_ref() });
    for (f, acts) in jobs.iter().filter_map(|(w, _)| tiles(w)) {
        acts.prepare(isa, f);
    }
    // Final [m, n] outputs, written in place by tasks that each own a disjoint range of rows (output columns).
    // The interleaved tiles store every element of theirs, so those buffers start unwritten: zeroing them was
    // ~4 % of a prompt's pass, on the caller while the other threads waited.
    let mut outs: Vec<Vec<f32>> = jobs
        .iter()
        .map(|(w, _)| if tiles(w).is_some() { Vec::with_capacity(m * w.rows) } else { vec![0f32; m * w.rows] })
        .collect();
    let total_rows: usize = jobs.iter().map(|(w, _)| w.rows).sum();
    let prompt = m >= spin::MIN_TOKENS;
    let chunk_rows = rows_per_task(total_rows, threads, prompt);
    let mut tasks = Vec::new();
    for ((w, _), out) in jobs.iter().zip(outs.iter_mut()) {
        let dst = SharedOut { ptr: out.as_mut_ptr(), n: w.rows };
        // Repacked rows split at whole groups.
        let step =
            if w.layout.interleaved().is_some() { chunk_rows.next_multiple_of(interleaved::ROWS) } else { chunk_rows };
        for first_row in (0..w.rows).step_by(step) {
            tasks.push((*w, first_row, step.min(w.rows - first_row), dst));
        }
    }
    let run = |&(w, first_row, nrows, dst): &(&CpuMatrix, usize, usize, SharedOut)| {
        let bytes = w.bytes.as_slice();
        if let Some((f, acts)) = tiles(w) {
            let group_bytes = interleaved::packed_len(f, interleaved::ROWS, w.cols);
            let (first, groups) = (first_row / interleaved::ROWS, nrows.div_ceil(interleaved::ROWS));
            let groups = &bytes[first * group_bytes..][..groups * group_bytes];
            // SAFETY: elements (t, first_row..first_row + nrows) for t < m are inside the m×n buffer and owned by
            // this task alone.
            unsafe { interleaved::rows_by_tokens(isa, f, groups, nrows, acts, dst.ptr.add(first_row), dst.n) };
            return;
        }
        let row_bytes = w.row_bytes();
        let rows = &bytes[first_row * row_bytes..(first_row + nrows) * row_bytes];
        if m == 1 && w.dtype.is_quantized() {
            // SAFETY: with one token, this task's outputs are the contiguous run first_row..first_row + nrows of
            // the job's buffer, which no other task touches.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.ptr.add(first_row), nrows) };
            simd::dot_quant_rows(isa, w.dtype, rows, row_bytes, &xq, blocks, out);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(acts) = packed.as_ref().filter(|_| w.dtype.is_quantized()) {
            // SAFETY: elements (t, first_row..first_row + nrows) for t < m are inside the m×n buffer and owned by
            // this task alone.
            unsafe { qgemm::rows_by_tokens(isa, w.dtype, rows, row_bytes, acts, dst.ptr.add(first_row), dst.n) };
            return;
        }
        if let Some(kind) = half_kind(w.dtype) {
            half_dot::rows_by_tokens(isa, kind, bytemuck::cast_slice(rows), &x.data, k, |r, t, v| {
                // SAFETY: (t, first_row + r) is inside the m×n buffer and owned by this task alone.
                unsafe { *dst.ptr.add(t * dst.n + first_row + r) = v }
            });
            return;
        }
        let mut col = vec![0f32; m];
        for (i, wr) in rows.chunks_exact(row_bytes).enumerate() {
            match w.dtype {
                DType::F32 => {
                    for (t, o) in col.iter_mut().enumerate() {
                        *o = simd::dot_f32(isa, &x.data[t * k..(t + 1) * k], bytemuck::cast_slice(wr));
                    }
                }
                q => simd::dot_quant(isa, q, wr, &xq, blocks, &mut col),
            }
            for (t, &v) in col.iter().enumerate() {
                // SAFETY: (t, first_row + i) is inside the m×n buffer and owned by this task alone.
                unsafe { *dst.ptr.add(t * dst.n + first_row + i) = v };
            }
        }
    };
    // A prompt's pass keeps the pool's other threads spinning (`spin`), ready to claim tasks as they come. In a
    // decode step they sleep between regions, and claiming there cost batch-1 decode ~9 % (alternated runs).
    if prompt {
        claim::for_each(&tasks, run);
    } else {
        tasks.par_iter().for_each(run);
    }
    for ((w, _), out) in jobs.iter().zip(outs.iter_mut()) {
        // SAFETY: the tasks cover every row of every job, and the interleaved tiles wrote each of their rows'
        // outputs for every token (the rest were zero-filled at this length).
        unsafe { out.set_len(m * w.rows) };
    }
    Ok(jobs
        .iter()
        .zip(outs)
        .map(|((w, bias), mut out)| {
            if let Some(b) = bias {
                add_bias(&mut out, b);
            }
            CpuTensor { data: out, rows: m, cols: w.rows }
        })
        .collect())
}

/// The 16-bit float formats [`half_dot`] computes with.
fn half_kind(dtype: DType) -> Option<Half> {
    match dtype {
        DType::F16 => Some(Half::F16),
        DType::BF16 => Some(Half::Bf16),
        _ => None,
    }
}

/// One job's `[m, n]` output buffer, shared by the tasks of a product; each writes only its own rows' columns.
#[derive(Clone, Copy)]
struct SharedOut {
    ptr: *mut f32,
    n: usize,
}

// SAFETY: tasks write disjoint elements (see the task body), and the buffer outlives the parallel region.
unsafe impl Send for SharedOut {}
// SAFETY: as above; no task reads through the pointer.
unsafe impl Sync for SharedOut {}

fn add_bias(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_exact_mut(bias.len()) {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
}

/// Prefill path for f32 weights: the `gemm` crate's blocked kernel beats row-wise dots here.
fn gemm_f32(x: &CpuTensor, w: &[f32], n: usize, bias: Option<&[f32]>) -> CpuTensor {
    let (m, k) = (x.rows, x.cols);
    let mut out = vec![0f32; m * n];
    // SAFETY: dst is m×n row-major (col stride 1, row stride n); lhs is x (m×k row-major); rhs is wᵀ, i.e. the
    // k×n view of w (n×k row-major): element (i, j) at w[j*k + i] → col stride k, row stride 1.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.data.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        );
    }
    if let Some(b) = bias {
        add_bias(&mut out, b);
    }
    CpuTensor { data: out, rows: m, cols: n }
}

/// Gathers embedding rows (dequantizing quantized tables).
pub fn embed(w: &CpuMatrix, ids: &[u32]) -> Result<CpuTensor> {
    let k = w.cols;
    let mut out = vec![0f32; ids.len() * k];
    let bytes = w.bytes.as_slice();
    let row_bytes = w.row_bytes();
    for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(k)) {
        let id = id as usize;
        if id >= w.rows {
            return Err(Error::InvalidRequest(format!("token id {id} is outside the vocabulary of {}", w.rows)));
        }
        if let Some(f) = w.layout.interleaved() {
            interleaved::dequantize_row(f, bytes, k, id, dst);
            continue;
        }
        let src = &bytes[id * row_bytes..(id + 1) * row_bytes];
        match w.dtype {
            DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
            DType::F16 => {
                for (d, h) in dst.iter_mut().zip(bytemuck::cast_slice::<u8, half::f16>(src)) {
                    *d = h.to_f32();
                }
            }
            DType::BF16 => {
                for (d, h) in dst.iter_mut().zip(bytemuck::cast_slice::<u8, half::bf16>(src)) {
                    *d = h.to_f32();
                }
            }
            q => crate::quant::dequantize(q, src, dst),
        }
    }
    Ok(CpuTensor { data: out, rows: ids.len(), cols: k })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Bytes;
    use rand::{Rng, SeedableRng};

    /// `v` as a `dtype` matrix; random blocks for formats strata does not quantize into.
    fn matrix(dtype: DType, rows: usize, cols: usize, v: &[f32], rng: &mut rand::rngs::StdRng) -> CpuMatrix {
        let bytes: Vec<u8> = match dtype {
            DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::F16 => v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
            DType::BF16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
            q if crate::quant::format(q).is_some_and(|f| f.quantize.is_some()) => crate::quant::quantize(q, v),
            q => crate::quant::random_blocks(q, rows * cols / q.block_elems(), rng),
        };
        // As the backend keeps them.
        if let Some(f) = interleaved::Format::of(dtype) {
            let packed = interleaved::pack(f, &bytes, rows, cols).expect("whole blocks");
            return CpuMatrix { rows, cols, dtype, bytes: Bytes::owned(&packed), layout: Layout::Interleaved(f) };
        }
        CpuMatrix { rows, cols, dtype, bytes: Bytes::owned(&bytes), layout: Layout::Rows }
    }

    /// A matrix of an interleaved format in the file's layout (which the backend never uploads) is refused with an
    /// error, not run through kernels that no longer read it.
    #[test]
    fn interleaved_formats_in_the_file_layout_are_refused() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(22);
        let bytes = crate::quant::random_blocks(DType::Q4_1, 4, &mut rng);
        let w = CpuMatrix { rows: 4, cols: 32, dtype: DType::Q4_1, bytes: Bytes::owned(&bytes), layout: Layout::Rows };
        let x = CpuTensor { data: vec![0.5; 32], rows: 1, cols: 32 };
        let err = linear_many(Isa::detect(), 1, &x, &[(&w, None)]).err().map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("interleaved")), "{err:?}");
    }

    #[test]
    fn every_token_count_and_path_gives_each_row_the_one_token_result() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        // k: two K-quant super-blocks.
        let (n, k) = (37, 512);
        let isa = Isa::detect();
        let quantized = crate::quant::FORMATS.map(|f| f.dtype);
        for dtype in [DType::F32, DType::F16, DType::BF16].into_iter().chain(quantized) {
            let wv: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let (w, w2) = (matrix(dtype, n, k, &wv, &mut rng), matrix(dtype, 5, k, &wv[..5 * k], &mut rng));
            let bias: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
            // 40: a prompt's path (`spin::MIN_TOKENS`), its tasks claimed one at a time into unfilled outputs.
            for m in [1, 3, 9, 17, 40] {
                let x =
                    CpuTensor { data: (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect(), rows: m, cols: k };
                // Two jobs in one region (as q/k/v are), over 3 threads' worth of tasks.
                let outs = linear_many(isa, 3, &x, &[(&w, Some(&bias)), (&w2, None)])?;
                let slow = linear_many(Isa::Scalar, 3, &x, &[(&w, Some(&bias))])?;
                for t in 0..m {
                    let one = CpuTensor { data: x.data[t * k..(t + 1) * k].to_vec(), rows: 1, cols: k };
                    let single = linear_many(isa, 3, &one, &[(&w, Some(&bias)), (&w2, None)])?;
                    let row = &outs[0].data[t * n..(t + 1) * n];
                    // f32 weights with 4+ tokens go to the `gemm` crate, whose summation order differs.
                    if !(dtype == DType::F32 && m >= 4) {
                        assert!(row == single[0].data, "{dtype}, {m} tokens: token {t} differs from alone");
                        assert!(outs[1].data[t * 5..(t + 1) * 5] == single[1].data, "{dtype}: second job, token {t}");
                    }
                    for (a, b) in row.iter().zip(&slow[0].data[t * n..(t + 1) * n]) {
                        assert!((a - b).abs() < 2e-3 * b.abs().max(1.0), "{dtype}, {m} tokens: {a} vs scalar {b}");
                    }
                }
            }
        }
        Ok(())
    }
}
