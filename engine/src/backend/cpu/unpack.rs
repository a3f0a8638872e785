//! AVX2 decoding of the block formats kept in the file's layout (Q2_K, Q3_K and Q8_K; the 32-element formats,
//! Q4_K, Q5_K and Q6_K are kept interleaved, `interleaved`) for the integer dot kernels of `simd::x86` and
//! `qgemm::x86`: every format is read in 32-element sub-blocks (eight per super-block), each lined up with one
//! 8-bit activation block. A sub-block becomes the unsigned operand of `maddubs`, the 16-bit multipliers of the
//! following `madd` (ones, or the two scales of 16-element halves), its float scale and (Q2_K) the multiplier of
//! its offset term.
//! Q2_K's minimums differ between the two 16-element halves of a sub-block, so its offset term is an integer dot
//! of its own (the activations against the halves' minimums) under a second float scale.
//! Formats are const-generic tags so each kernel instance is specialized to one layout.

use std::arch::x86_64::*;

use crate::quant::q3k_scale;

pub(super) const Q8_K: u8 = 5;
pub(super) const Q2_K: u8 = 9;
pub(super) const Q3_K: u8 = 10;

/// Bytes per block of layout `Q` (checked against the format table in the tests).
pub(super) const fn block_bytes<const Q: u8>() -> usize {
    match Q {
        Q8_K => 292,
        Q2_K => 84,
        _ => 110,
    }
}

/// 32-element sub-blocks per block (every layout here is a super-block of 256 elements).
pub(super) const fn subs<const Q: u8>() -> usize {
    8
}

/// Whether weights are signed (`maddubs` then takes their magnitude and moves the sign onto the activation).
pub(super) const fn signed<const Q: u8>() -> bool {
    matches!(Q, Q8_K | Q3_K)
}

/// Whether each 16-element half has its own minimum (Q2_K): the offset is then `min · Σ_h m_h·Σ_{l∈h} a_l`,
/// an integer dot with [`Sub::mins`] that the kernels add under the scale `min · d_a`.
pub(super) const fn half_mins<const Q: u8>() -> bool {
    Q == Q2_K
}

/// Whether [`Sub::mul`] is all ones (every format but those with 16-element scales: Q2_K, Q3_K), so the
/// sub-block's dot product is a plain sum of 4-byte groups (one `vpdpbusd` where VNNI is present).
pub(super) const fn unit_mul<const Q: u8>() -> bool {
    !matches!(Q, Q2_K | Q3_K)
}

/// Whether the AVX-512 token tile takes this layout's weights as `w + 128`, each lane starting from the
/// activations' lane sums (`qgemm::LaneSums`): signed weights whose sub-block dot is a plain sum of 4-byte groups
/// (Q8_K). The others' `maddubs` sums would overflow 16 bits with `w + 128`.
pub(super) const fn biased<const Q: u8>() -> bool {
    signed::<Q>() && unit_mul::<Q>()
}

/// Byte offset of sub-block `b` in a row, for prefetching.
pub(super) const fn sub_offset<const Q: u8>(b: usize) -> usize {
    b * block_bytes::<Q>() / subs::<Q>()
}

/// One decoded sub-block: `Σ w·a = d · madd(maddubs(wabs, a'), mul)` (a' = a with `wq`'s signs for signed
/// formats), plus `min · s` with `s` the activation block's `d · Σ qs` (or, for [`half_mins`] formats,
/// `min · d_a · madd(maddubs(1, a), mins)`).
pub(super) struct Sub {
    pub wabs: __m256i,
    pub wq: __m256i,
    pub mul: __m256i,
    /// Q2_K: each half's 4-bit minimum in its eight 16-bit lanes; zero for the other formats.
    pub mins: __m256i,
    pub d: f32,
    pub min: f32,
}

/// The f16 at `p`.
///
/// Assembly, not intrinsics: with only lane 0 of the conversion read, LLVM turns any intrinsic form of the load
/// (`_mm_cvtsi32_si128`, `_mm_set1_epi16`) into a `vpinsrw` into whatever register is free, often the previous
/// block's accumulator, and every block then waits on the one before (measured when the 32-element formats still
/// ran through these kernels: Q8_0's one-row kernel 2.4× slower at the AVX-512 level than at AVX2 on a Zen 4
/// EPYC, Q4_0's and Q5_0's 1.9–2.7× slower than Q4_1's and Q5_1's). A
/// broadcast writes the whole register and depends on nothing. Exact, like any f16 to f32 conversion.
///
/// # Safety
/// Two readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_at(p: *const u8) -> f32 {
    let v: __m128;
    // SAFETY: reads the two bytes at `p` (the caller's contract); AVX2 and F16C are enabled on this function.
    unsafe {
        std::arch::asm!(
            "vpbroadcastw {v}, word ptr [{p}]",
            "vcvtph2ps {v}, {v}",
            p = in(reg) p,
            v = out(xmm_reg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    _mm_cvtss_f32(v)
}

/// Sub-block `b` of a row of layout `Q`: its block and index within the block.
#[inline(always)]
fn locate<const Q: u8>(row: *const u8, b: usize) -> (*const u8, usize) {
    (row.wrapping_add(b / subs::<Q>() * block_bytes::<Q>()), b % subs::<Q>())
}

/// The float scale and offset multiplier of sub-block `b` of `row` (what [`unpack`] returns beside the
/// integers; `qgemm` reads them alone in its first pass).
///
/// # Safety
/// AVX2/FMA/F16C available; `row` holds at least block `b / subs::<Q>()` of layout `Q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scales<const Q: u8>(row: *const u8, b: usize) -> (f32, f32) {
    let (blk, _) = locate::<Q>(row, b);
    // SAFETY (whole body): every read lies inside that block (the layouts of ggml-common.h).
    unsafe {
        match Q {
            Q8_K => ((blk as *const f32).read_unaligned(), 0.0),
            // The integer sums carry Q2_K's sub-scales and minimums; these are the super-block's.
            Q2_K => (half_at(blk.add(80)), -half_at(blk.add(82))),
            _ => (half_at(blk.add(108)), 0.0),
        }
    }
}

/// The float scales and offset multipliers of the eight sub-blocks of K-quant block `k` of `row`, bit for bit
/// what [`scales`] gives for each: the kernels decode them once per block and row.
///
/// # Safety
/// AVX2/FMA/F16C available; `row` holds at least block `k` of layout `Q`, a K-quant layout.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_scales<const Q: u8>(row: *const u8, k: usize) -> ([f32; 8], [f32; 8]) {
    let (mut d, mut min) = ([0f32; 8], [0f32; 8]);
    for j in 0..subs::<Q>() {
        // SAFETY: every read lies inside block k (the layouts of ggml-common.h).
        (d[j], min[j]) = unsafe { scales::<Q>(row, k * subs::<Q>() + j) };
    }
    (d, min)
}

/// Decodes sub-block `b` of `row` with its own scales (the kernels take them from [`block_scales`] once per block;
/// the tests check each sub-block this way).
///
/// # Safety
/// AVX2/FMA/F16C available; `row` holds at least block `b / subs::<Q>()` of layout `Q`.
#[cfg(test)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack<const Q: u8>(row: *const u8, b: usize) -> Sub {
    // SAFETY: forwarded.
    unsafe {
        let (d, min) = scales::<Q>(row, b);
        unpack_with::<Q>(row, b, d, min)
    }
}

/// [`unpack`] with the sub-block's float scale and offset multiplier already known (from [`block_scales`]).
///
/// # Safety
/// As for [`unpack`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack_with<const Q: u8>(row: *const u8, b: usize, d: f32, min: f32) -> Sub {
    let (blk, j) = locate::<Q>(row, b);
    let ones = _mm256_set1_epi16(1);
    // SAFETY (whole body): every read lies inside that block.
    unsafe {
        let zero = _mm256_setzero_si256();
        // The 16-bit multipliers of the two 16-element halves of a sub-block: `lo` for elements 0..16.
        let halves = |lo: i16, hi: i16| _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo));
        // The 2-bit fields of Q2_K and Q3_K: sub-block j = 4n + c at bits 2c of the 32 bytes at `qs + 32n`.
        let two_bits = |qs: *const u8| {
            let q = _mm256_loadu_si256(qs.add(32 * (j / 4)) as *const __m256i);
            _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (j % 4) as i32)), _mm256_set1_epi8(3))
        };
        match Q {
            Q8_K => {
                let wq = _mm256_loadu_si256(blk.add(4 + 32 * j) as *const __m256i);
                Sub { wabs: _mm256_sign_epi8(wq, wq), wq, mul: ones, mins: zero, d, min }
            }
            Q2_K => {
                // Bytes 2j and 2j + 1 hold the halves' scales (low nibbles) and minimums (high nibbles).
                let (lo, hi) = (i16::from(*blk.add(2 * j)), i16::from(*blk.add(2 * j + 1)));
                let wq = two_bits(blk.add(16));
                Sub { wabs: wq, wq, mul: halves(lo & 0x0f, hi & 0x0f), mins: halves(lo >> 4, hi >> 4), d, min }
            }
            Q3_K => {
                // The high bit of element l of sub-block j is bit j of hmask[l]; clear means minus 4.
                let bit = _mm256_set1_epi8((1u8 << j) as i8);
                let hm = _mm256_loadu_si256(blk as *const __m256i);
                let high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), _mm256_set1_epi8(4));
                let wq = _mm256_sub_epi8(_mm256_or_si256(two_bits(blk.add(32)), high), _mm256_set1_epi8(4));
                let sc = |k: usize| q3k_scale(std::slice::from_raw_parts(blk.add(96), 12), 2 * j + k) as i16;
                Sub { wabs: _mm256_sign_epi8(wq, wq), wq, mul: halves(sc(0), sc(1)), mins: zero, d, min }
            }
            _ => unreachable!("no block layout {Q}"),
        }
    }
}

/// The layout tag of each block format, for tests that run every instance.
#[cfg(test)]
pub(super) fn tag(dtype: crate::tensor::DType) -> u8 {
    use crate::tensor::DType;
    match dtype {
        DType::Q8_K => Q8_K,
        DType::Q2_K => Q2_K,
        _ => Q3_K,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;
    use rand::SeedableRng;

    /// Reads the 32 lanes of `wq` (and `mul`'s two halves) back as the integers the dot products see, and each
    /// element's offset: `min`, or `min` times its half's minimum for [`half_mins`] formats.
    fn decoded<const Q: u8>(row: &[u8], b: usize) -> (Vec<i32>, f32, Vec<f32>) {
        // SAFETY: only run after AVX2 detection; `row` holds the block of sub-block b.
        unsafe {
            let s = unpack::<Q>(row.as_ptr(), b);
            let (mut q, mut mul, mut mins) = ([0i8; 32], [0i16; 16], [0i16; 16]);
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, s.wq);
            _mm256_storeu_si256(mul.as_mut_ptr() as *mut __m256i, s.mul);
            _mm256_storeu_si256(mins.as_mut_ptr() as *mut __m256i, s.mins);
            let v = q.iter().enumerate().map(|(i, &x)| i32::from(x) * i32::from(mul[i / 16 * 8])).collect();
            let offset =
                (0..32).map(|i| if half_mins::<Q>() { s.min * f32::from(mins[i / 16 * 8]) } else { s.min }).collect();
            (v, s.d, offset)
        }
    }

    fn check<const Q: u8>(dtype: crate::tensor::DType, rng: &mut rand::rngs::StdRng) {
        let f = quant::format(dtype).map(|f| (f.block_bytes, f.block_elems));
        let Some((bb, elems)) = f else { panic!("{dtype} has no format") };
        assert_eq!((block_bytes::<Q>(), subs::<Q>() * quant::QK, tag(dtype)), (bb, elems, Q), "{dtype}");
        let row = quant::random_blocks(dtype, 2, rng);
        for k in 0..2 {
            // SAFETY: AVX2 was detected; `row` holds two blocks.
            let (d, min) = unsafe { block_scales::<Q>(row.as_ptr(), k) };
            for j in 0..subs::<Q>() {
                // SAFETY: as above.
                let one = unsafe { scales::<Q>(row.as_ptr(), k * subs::<Q>() + j) };
                assert_eq!((d[j].to_bits(), min[j].to_bits()), (one.0.to_bits(), one.1.to_bits()), "{dtype} {k}/{j}");
            }
        }
        let mut want = vec![0f32; 2 * elems];
        quant::dequantize(dtype, &row, &mut want);
        for b in 0..2 * subs::<Q>() {
            let (q, d, offset) = decoded::<Q>(&row, b);
            for (l, &v) in q.iter().enumerate() {
                let got = d * v as f32 + offset[l];
                let w = want[b * 32 + l];
                assert!((got - w).abs() <= 1e-6 * w.abs().max(1.0), "{dtype} sub-block {b} element {l}: {got} vs {w}");
            }
        }
    }

    /// Every decoded sub-block, as `d · q + offset`, is the table's dequantized block.
    #[test]
    fn unpacked_sub_blocks_are_the_reference_dequantization() {
        if !super::super::simd::Isa::Avx2.supported() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        use crate::tensor::DType as D;
        check::<Q8_K>(D::Q8_K, &mut rng);
        check::<Q2_K>(D::Q2_K, &mut rng);
        check::<Q3_K>(D::Q3_K, &mut rng);
    }
}
