//! `x · wᵀ` for every weight storage type. Work is split over output rows, so each output element is
//! computed by exactly one sequential dot product: results do not depend on the thread count.

use rayon::prelude::*;

use super::simd::{self, Isa, Q8Block, quantize_row};
use super::{CpuMatrix, CpuTensor};
use crate::tensor::{DType, QK};
use crate::{Error, Result};

/// Output rows handed to one task: enough to amortize scheduling, few enough to balance two cores.
fn rows_per_task(n: usize, threads: usize) -> usize {
    (n / (threads * 4)).clamp(8, 512)
}

/// Computes `x · wᵀ + bias`.
pub fn linear(
    isa: Isa,
    threads: usize,
    x: &CpuTensor,
    w: &CpuMatrix,
    bias: Option<&[f32]>,
) -> Result<CpuTensor> {
    let (m, k, n) = (x.rows, x.cols, w.rows);
    if k != w.cols {
        return Err(Error::Shape {
            op: "linear",
            reason: format!("x has {k} columns, weight has {} inputs", w.cols),
        });
    }
    let mut out_t = vec![0f32; m * n]; // [n, m]: one weight row's outputs for all tokens are contiguous
    let chunk_rows = rows_per_task(n, threads);
    let bytes = w.bytes.as_slice();
    let row_bytes = w.row_bytes();
    match w.dtype {
        DType::F32 if m >= 4 => return Ok(gemm_f32(x, bytemuck::cast_slice(bytes), n, bias)),
        DType::F32 | DType::F16 | DType::BF16 => {
            out_t
                .par_chunks_mut(chunk_rows * m)
                .enumerate()
                .for_each(|(c, dst)| {
                    for (i, out) in dst.chunks_exact_mut(m).enumerate() {
                        let r = c * chunk_rows + i;
                        let wr = &bytes[r * row_bytes..(r + 1) * row_bytes];
                        for (t, o) in out.iter_mut().enumerate() {
                            let xr = &x.data[t * k..(t + 1) * k];
                            *o = match w.dtype {
                                DType::F32 => simd::dot_f32(isa, xr, bytemuck::cast_slice(wr)),
                                DType::F16 => simd::dot_f16(isa, xr, bytemuck::cast_slice(wr)),
                                _ => simd::dot_bf16(isa, xr, bytemuck::cast_slice(wr)),
                            };
                        }
                    }
                });
        }
        q => {
            let blocks = k / QK;
            let mut xq = vec![
                Q8Block {
                    d: 0.0,
                    s: 0.0,
                    qs: [0; QK]
                };
                m * blocks
            ];
            xq.par_chunks_mut(blocks)
                .zip(x.data.par_chunks(k))
                .for_each(|(dst, src)| quantize_row(src, dst));
            let dot = match q {
                DType::Q8_0 => simd::dot_q8_0,
                DType::Q4_0 => simd::dot_q4_0,
                _ => simd::dot_q4_1,
            };
            out_t
                .par_chunks_mut(chunk_rows * m)
                .enumerate()
                .for_each(|(c, dst)| {
                    for (i, out) in dst.chunks_exact_mut(m).enumerate() {
                        let r = c * chunk_rows + i;
                        let wr = &bytes[r * row_bytes..(r + 1) * row_bytes];
                        for (t, o) in out.iter_mut().enumerate() {
                            *o = dot(isa, wr, &xq[t * blocks..(t + 1) * blocks]);
                        }
                    }
                });
        }
    }
    let mut out = if m == 1 {
        out_t
    } else {
        let mut o = vec![0f32; m * n];
        for r in 0..n {
            for t in 0..m {
                o[t * n + r] = out_t[r * m + t];
            }
        }
        o
    };
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(n) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
    Ok(CpuTensor {
        data: out,
        rows: m,
        cols: n,
    })
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
        for row in out.chunks_exact_mut(n) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
    CpuTensor {
        data: out,
        rows: m,
        cols: n,
    }
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
            return Err(Error::InvalidRequest(format!(
                "token id {id} is outside the vocabulary of {}",
                w.rows
            )));
        }
        let src = &bytes[id * row_bytes..(id + 1) * row_bytes];
        match w.dtype {
            DType::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
            DType::F16 => {
                for (d, h) in dst
                    .iter_mut()
                    .zip(bytemuck::cast_slice::<u8, half::f16>(src))
                {
                    *d = h.to_f32();
                }
            }
            DType::BF16 => {
                for (d, h) in dst
                    .iter_mut()
                    .zip(bytemuck::cast_slice::<u8, half::bf16>(src))
                {
                    *d = h.to_f32();
                }
            }
            q => {
                for (blk, d) in src
                    .chunks_exact(q.block_bytes())
                    .zip(dst.chunks_exact_mut(QK))
                {
                    crate::tensor::dequantize_block(q, blk, d);
                }
            }
        }
    }
    Ok(CpuTensor {
        data: out,
        rows: ids.len(),
        cols: k,
    })
}
