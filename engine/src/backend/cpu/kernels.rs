//! The CPU kernels of each block-quantized format ([`crate::quant`]), selected by format here and nowhere
//! else: the scalar reference dot (one weight row against 8-bit activation blocks) and, on x86-64, the AVX2
//! instances of the one-row, multi-row and token-tile kernels specialized to the format's block layout
//! (`simd::x86::unpack` decodes a block for them). A new format adds one [`QuantKernels`] here and its
//! `unpack` arm; `simd` and `qgemm` call through the table and need no edit.

#[cfg(target_arch = "x86_64")]
use super::qgemm::{self, Q8x8};
use super::simd::{self, Q8Block};
use crate::quant::{self, QK};
use crate::tensor::{DType, f16_at};

/// One format's CPU kernels.
pub(super) struct QuantKernels {
    /// Scalar reference: one weight row (whole blocks) against as many activation blocks.
    pub scalar_dot: fn(w: &[u8], a: &[Q8Block]) -> f32,
    /// AVX2 `simd::x86::dot_quant_one` for this layout.
    #[cfg(target_arch = "x86_64")]
    pub dot_one: unsafe fn(w: &[u8], a: &[Q8Block], blocks: usize) -> f32,
    /// AVX2 `simd::x86::dot_rows_n` for 8 rows.
    #[cfg(target_arch = "x86_64")]
    pub dot_rows8: RowsKernel,
    /// AVX2 `simd::x86::dot_rows_n` for 4 rows.
    #[cfg(target_arch = "x86_64")]
    pub dot_rows4: RowsKernel,
    /// AVX2 `qgemm::x86::dispatch`: one weight row against up to 8 tokens.
    #[cfg(target_arch = "x86_64")]
    pub tile: unsafe fn(
        tokens: usize,
        w: *const u8,
        a: *const Q8x8,
        blocks: usize,
        scales: *mut f32,
        out: *mut f32,
        stride: usize,
    ),
}

/// Consecutive weight rows against one activation row.
#[cfg(target_arch = "x86_64")]
pub(super) type RowsKernel = unsafe fn(w: &[u8], row_bytes: usize, a: &[Q8Block], blocks: usize, out: &mut [f32]);

/// The kernels of `dtype`.
///
/// # Panics
/// For float types: callers branch on [`DType::is_quantized`] first.
pub(super) fn kernels(dtype: DType) -> &'static QuantKernels {
    match dtype {
        DType::Q8_0 => &Q8_0,
        DType::Q4_0 => &Q4_0,
        DType::Q4_1 => &Q4_1,
        DType::F32 | DType::F16 | DType::BF16 => panic!("no quantized kernels for {dtype}"),
    }
}

/// Sums `block(w_b, a_b)` over the row's blocks, in order (the order the AVX2 kernels reproduce).
#[inline(always)]
fn row_dot(w: &[u8], a: &[Q8Block], block_bytes: usize, block: impl Fn(&[u8], &Q8Block) -> f32) -> f32 {
    let mut sum = 0f32;
    for (blk, ab) in w.chunks_exact(block_bytes).zip(a) {
        sum += block(blk, ab);
    }
    sum
}

/// Σ w·a over a block of 4-bit weights (low nibbles elements 0..16, high nibbles 16..32).
fn nibble_dot(qs: &[u8], a: &[i8; QK]) -> i32 {
    let mut isum = 0i32;
    for j in 0..16 {
        isum += (qs[j] & 0x0f) as i32 * a[j] as i32 + (qs[j] >> 4) as i32 * a[j + 16] as i32;
    }
    isum
}

static Q8_0: QuantKernels = QuantKernels {
    scalar_dot: |w, a| {
        row_dot(w, a, quant::Q8_0.block_bytes, |blk, ab| {
            let isum: i32 = blk[2..].iter().zip(&ab.qs).map(|(&q, &x)| (q as i8) as i32 * x as i32).sum();
            f16_at(blk, 0) * ab.d * isum as f32
        })
    },
    #[cfg(target_arch = "x86_64")]
    dot_one: simd::x86::dot_quant_one::<{ simd::Q8_0 }>,
    #[cfg(target_arch = "x86_64")]
    dot_rows8: simd::x86::dot_rows_n::<8, { simd::Q8_0 }>,
    #[cfg(target_arch = "x86_64")]
    dot_rows4: simd::x86::dot_rows_n::<4, { simd::Q8_0 }>,
    #[cfg(target_arch = "x86_64")]
    tile: qgemm::x86::dispatch::<{ simd::Q8_0 }>,
};

static Q4_0: QuantKernels = QuantKernels {
    scalar_dot: |w, a| {
        row_dot(w, a, quant::Q4_0.block_bytes, |blk, ab| {
            f16_at(blk, 0) * (ab.d * nibble_dot(&blk[2..18], &ab.qs) as f32 - 8.0 * ab.s)
        })
    },
    #[cfg(target_arch = "x86_64")]
    dot_one: simd::x86::dot_quant_one::<{ simd::Q4_0 }>,
    #[cfg(target_arch = "x86_64")]
    dot_rows8: simd::x86::dot_rows_n::<8, { simd::Q4_0 }>,
    #[cfg(target_arch = "x86_64")]
    dot_rows4: simd::x86::dot_rows_n::<4, { simd::Q4_0 }>,
    #[cfg(target_arch = "x86_64")]
    tile: qgemm::x86::dispatch::<{ simd::Q4_0 }>,
};

static Q4_1: QuantKernels = QuantKernels {
    scalar_dot: |w, a| {
        row_dot(w, a, quant::Q4_1.block_bytes, |blk, ab| {
            f16_at(blk, 0) * ab.d * nibble_dot(&blk[4..20], &ab.qs) as f32 + f16_at(blk, 2) * ab.s
        })
    },
    #[cfg(target_arch = "x86_64")]
    dot_one: simd::x86::dot_quant_one::<{ simd::Q4_1 }>,
    #[cfg(target_arch = "x86_64")]
    dot_rows8: simd::x86::dot_rows_n::<8, { simd::Q4_1 }>,
    #[cfg(target_arch = "x86_64")]
    dot_rows4: simd::x86::dot_rows_n::<4, { simd::Q4_1 }>,
    #[cfg(target_arch = "x86_64")]
    tile: qgemm::x86::dispatch::<{ simd::Q4_1 }>,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_format_has_kernels_for_its_layout() {
        for f in quant::FORMATS {
            // One block of ones against activations of ones: Σ = 32 for every layout.
            let w = quant::quantize(f.dtype, &[1.0; QK]);
            let mut a = [Q8Block { d: 0.0, s: 0.0, qs: [0; QK] }];
            simd::quantize_row(&[1.0; QK], &mut a);
            let got = (kernels(f.dtype).scalar_dot)(&w, &a);
            assert!((got - QK as f32).abs() < 0.05, "{}: {got}", f.name);
        }
    }
}
