//! The CPU kernels of each block-quantized format kept in the file's layout (Q8_K; the 32-element formats and the
//! other K-quants are kept interleaved, `interleaved`), selected by format here and nowhere else: the scalar reference dot (one weight row against 8-bit activation blocks of 32, several per K-quant
//! block) and, on x86-64, the instances of the one-row and token-tile kernels specialized to the
//! format's block layout (`unpack` decodes a sub-block for them) at each instruction-set level of [`Isa::X86`].
//! A new format adds one [`QuantKernels`] here and its `unpack` arm; `simd` and `qgemm` call through the table
//! and need no edit.

#[cfg(target_arch = "x86_64")]
use super::qgemm::{self, GroupPtr};
use super::simd::{Isa, Q8Block};
#[cfg(target_arch = "x86_64")]
use super::{simd, unpack};
use crate::quant::{self, BlockFormat, QK};
use crate::tensor::DType;

/// One format's CPU kernels.
pub(super) struct QuantKernels {
    /// Scalar reference: one weight row (whole blocks) against its activation blocks (one per 32 elements).
    pub scalar_dot: fn(w: &[u8], a: &[Q8Block]) -> f32,
    /// The x86 instances, one per level of [`Isa::X86`] (AVX2, AVX-VNNI, AVX512-VNNI), all giving the same bits.
    #[cfg(target_arch = "x86_64")]
    pub x86: [X86Kernels; 3],
}

impl QuantKernels {
    /// The instances of `isa`; `None` for [`Isa::Scalar`].
    #[cfg(target_arch = "x86_64")]
    pub fn x86(&self, isa: Isa) -> Option<&X86Kernels> {
        Isa::X86.iter().position(|&i| i == isa).map(|level| &self.x86[level])
    }
}

/// One format's kernels at one x86 instruction-set level.
#[cfg(target_arch = "x86_64")]
pub(super) struct X86Kernels {
    /// `simd::x86` `dot_one` for this layout.
    pub dot_one: unsafe fn(w: &[u8], a: &[Q8Block], blocks: usize) -> f32,
    /// `qgemm::x86` `dispatch`: one weight row against up to 8 tokens.
    pub tile: unsafe fn(
        tokens: usize,
        w: *const u8,
        group: GroupPtr,
        blocks: usize,
        scales: *mut f32,
        out: *mut f32,
        stride: usize,
    ),
    /// Whether `tile` reads the activations' lane sums (`qgemm::LaneSums`), which take L1 room beside them.
    pub lane_sums: bool,
}

/// The kernels of `dtype`.
///
/// # Panics
/// For float types and the interleaved formats: callers branch on [`DType::is_quantized`] and the matrix's layout
/// first.
pub(super) fn kernels(dtype: DType) -> &'static QuantKernels {
    match dtype {
        DType::Q8_K => &Q8_K,
        DType::F32 | DType::F16 | DType::BF16 => panic!("no quantized kernels for {dtype}"),
        DType::Q8_0
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::Q2_K
        | DType::Q3_K => {
            panic!("{dtype} is kept interleaved, with the kernels of `interleaved`")
        }
    }
}

/// The block formats kept in the file's layout, whose kernels this table holds: Q8_K (the others are kept
/// interleaved, [`super::interleaved`]); the tests run each.
#[cfg(test)]
pub(super) fn formats() -> impl Iterator<Item = &'static BlockFormat> {
    quant::FORMATS.iter().copied().filter(|f| super::interleaved::Format::of(f.dtype).is_none())
}

/// Sums `sub(block, j, a)` over the row's blocks and their 32-element sub-blocks `j`, in order (the order the
/// AVX2 kernels reproduce).
#[inline(always)]
fn row_dot(w: &[u8], a: &[Q8Block], f: &BlockFormat, sub: impl Fn(&[u8], usize, &Q8Block) -> f32) -> f32 {
    let mut sum = 0f32;
    for (blk, acts) in w.chunks_exact(f.block_bytes).zip(a.chunks_exact(f.block_elems / QK)) {
        for (j, ab) in acts.iter().enumerate() {
            sum += sub(blk, j, ab);
        }
    }
    sum
}

/// Σ q(l)·a_l over one activation block.
#[inline(always)]
fn int_dot(a: &Q8Block, q: impl Fn(usize) -> i32) -> i32 {
    a.qs.iter().enumerate().map(|(l, &x)| q(l) * x as i32).sum()
}

/// The kernels of layout tag `$tag`: the scalar reference and the x86 instances at every level.
macro_rules! kernels_of {
    ($scalar:expr, $tag:path) => {
        QuantKernels {
            scalar_dot: $scalar,
            #[cfg(target_arch = "x86_64")]
            x86: [instances!(avx2, $tag), instances!(avx_vnni, $tag), instances!(avx512_vnni, $tag)],
        }
    };
}

/// Layout tag `$tag`'s instances at the level whose entry points are the modules `$level` of `simd::x86` and
/// `qgemm::x86`.
#[cfg(target_arch = "x86_64")]
macro_rules! instances {
    ($level:ident, $tag:path) => {
        X86Kernels {
            dot_one: simd::x86::$level::dot_one::<{ $tag }>,
            tile: qgemm::x86::$level::dispatch::<{ $tag }>,
            lane_sums: qgemm::x86::$level::reads_lane_sums::<{ $tag }>(),
        }
    };
}

static Q8_K: QuantKernels = kernels_of!(
    |w, a| {
        row_dot(w, a, &quant::Q8_K, |blk, j, ab| {
            let d = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
            d * ab.d * int_dot(ab, |l| (blk[4 + 32 * j + l] as i8) as i32) as f32
        })
    },
    unpack::Q8_K
);

#[cfg(test)]
mod tests {
    use super::super::simd::quantize_row;
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every format's scalar dot is the f32 dot of the table's dequantized row with the dequantized 8-bit
    /// activations, to float rounding; and within the activations' rounding (at most half a step, 1/254 of
    /// the block's largest |x|) of the dot with the original x.
    #[test]
    fn scalar_dots_are_the_dequantized_dot_for_every_format() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let n = 2 * quant::QK_K;
        for f in formats() {
            for _ in 0..4 {
                let w = quant::random_blocks(f.dtype, n / f.block_elems, &mut rng);
                let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let mut xq = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; QK] }; n / QK];
                quantize_row(Isa::Scalar, &x, &mut xq);
                let mut wf = vec![0f32; n];
                quant::dequantize(f.dtype, &w, &mut wf);
                let xd: Vec<f32> = (0..n).map(|i| xq[i / QK].d * xq[i / QK].qs[i % QK] as f32).collect();
                let dot = |a: &[f32]| wf.iter().zip(a).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum::<f64>();
                let mass: f64 = wf.iter().zip(&xd).map(|(p, q)| f64::from((p * q).abs())).sum();
                let got = f64::from((kernels(f.dtype).scalar_dot)(&w, &xq));
                let (on_grid, exact) = (dot(&xd), dot(&x));
                assert!((got - on_grid).abs() <= 1e-5 * mass + 1e-6, "{}: {got} vs {on_grid}", f.name);
                let step: f64 = wf.iter().map(|p| f64::from(p.abs()) / 254.0).sum();
                assert!((got - exact).abs() <= step + 1e-5 * mass, "{}: {got} vs f32 {exact}", f.name);
            }
        }
    }
}
