//! AVX2 decoding of the block format kept in the file's layout (Q8_K: every other format is kept interleaved,
//! `interleaved`) for the integer dot kernels of `simd::x86` and `qgemm::x86`: a super-block is read in
//! 32-element sub-blocks (eight per super-block), each lined up with one 8-bit activation block. A sub-block
//! becomes its signed values, their magnitudes (the unsigned operand of `maddubs`) and its float scale.
//! Formats are const-generic tags so each kernel instance is specialized to one layout.

use std::arch::x86_64::*;

pub(super) const Q8_K: u8 = 5;

/// Bytes per block of layout `Q` (checked against the format table in the tests).
pub(super) const fn block_bytes<const Q: u8>() -> usize {
    292
}

/// 32-element sub-blocks per block (every layout here is a super-block of 256 elements).
pub(super) const fn subs<const Q: u8>() -> usize {
    8
}

/// Byte offset of sub-block `b` in a row, for prefetching.
pub(super) const fn sub_offset<const Q: u8>(b: usize) -> usize {
    b * block_bytes::<Q>() / subs::<Q>()
}

/// One decoded sub-block: `Σ w·a = d · madd(maddubs(wabs, a'), 1)`, a' = a with `wq`'s signs.
pub(super) struct Sub {
    pub wabs: __m256i,
    pub wq: __m256i,
    pub d: f32,
}

/// Sub-block `b` of a row of layout `Q`: its block and index within the block.
#[inline(always)]
fn locate<const Q: u8>(row: *const u8, b: usize) -> (*const u8, usize) {
    (row.wrapping_add(b / subs::<Q>() * block_bytes::<Q>()), b % subs::<Q>())
}

/// The float scale of sub-block `b` of `row` (what [`unpack`] returns beside the integers; `qgemm` reads them
/// alone in its first pass): Q8_K's f32 `d`, shared by its eight sub-blocks.
///
/// # Safety
/// `row` holds at least block `b / subs::<Q>()` of layout `Q`.
#[inline(always)]
pub(super) unsafe fn scale<const Q: u8>(row: *const u8, b: usize) -> f32 {
    let (blk, _) = locate::<Q>(row, b);
    // SAFETY: the block's first 4 bytes (the layout of ggml-common.h's `block_q8_K`).
    unsafe { (blk as *const f32).read_unaligned() }
}

/// Decodes sub-block `b` of `row`: its values, their magnitudes and its scale.
///
/// # Safety
/// AVX2 available; `row` holds at least block `b / subs::<Q>()` of layout `Q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack<const Q: u8>(row: *const u8, b: usize) -> Sub {
    let (blk, j) = locate::<Q>(row, b);
    // SAFETY: the sub-block's 32 values lie inside that block, after its 4-byte scale.
    let wq = unsafe { _mm256_loadu_si256(blk.add(4 + 32 * j) as *const __m256i) };
    // SAFETY: forwarded.
    Sub { wabs: _mm256_sign_epi8(wq, wq), wq, d: unsafe { scale::<Q>(row, b) } }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;
    use rand::SeedableRng;

    /// Every decoded sub-block, as `d · q`, is the table's dequantized block.
    #[test]
    fn unpacked_sub_blocks_are_the_reference_dequantization() {
        if !super::super::simd::Isa::Avx2.supported() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let dtype = crate::tensor::DType::Q8_K;
        let f = quant::format(dtype).map(|f| (f.block_bytes, f.block_elems));
        let Some((bb, elems)) = f else { panic!("{dtype} has no format") };
        assert_eq!((block_bytes::<Q8_K>(), subs::<Q8_K>() * quant::QK), (bb, elems), "{dtype}");
        let row = quant::random_blocks(dtype, 2, &mut rng);
        let mut want = vec![0f32; 2 * elems];
        quant::dequantize(dtype, &row, &mut want);
        for b in 0..2 * subs::<Q8_K>() {
            // SAFETY: AVX2 was detected; `row` holds two blocks.
            let s = unsafe { unpack::<Q8_K>(row.as_ptr(), b) };
            let mut q = [0i8; 32];
            // SAFETY: 32 writable bytes.
            unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, s.wq) };
            for (l, &v) in q.iter().enumerate() {
                let (got, w) = (s.d * f32::from(v), want[b * 32 + l]);
                assert!((got - w).abs() <= 1e-6 * w.abs().max(1.0), "sub-block {b} element {l}: {got} vs {w}");
            }
        }
    }
}
