//! The x86 tiles of the K-quants in the interleaved layout ([`super::kquant`]) at each instruction-set level:
//! `x86`'s tiles with a super-block's eight 32-element sub-blocks, each against its own activation block.

use super::kquant::{HIGH_LINE, Q3K_HIGH_LINE, d_at, dmin_at, per_half, scales_at};
use super::x86::{Operands, dots256_pair, dots512, four, prefetch, store512};
use super::{Q2_K, Q3_K, Q5_K, Q6_K, ROWS, block_bytes};
use crate::backend::cpu::simd::Q8Block;
use crate::backend::cpu::simd::x86::AVX2;
use crate::quant::{QK, QK_K};
use std::arch::x86_64::*;

/// 32-element sub-blocks (activation blocks) per super-block.
const SUBS: usize = QK_K / QK;
/// Bytes of one line of values: a 4-byte group of the 16 rows.
const LINE: usize = 4 * ROWS;

/// `n`, hidden from the optimizer: the bound of the loops over a super-block's sub-blocks, which it would otherwise
/// unroll whole and then keep lines two sub-blocks share (Q4_K's nibbles) live across them, spilling the tokens'
/// broadcast activations to the stack. Kept rolled, the 512-bit Q4_K tile ran 0.21 ns per block and token against
/// 0.25-0.36 unrolled, and a 256-token TinyLlama-shape Q4_K_M prefill +10-20 %.
#[inline(always)]
fn rolled(n: usize) -> usize {
    std::hint::black_box(n)
}

/// A Q4_K or Q5_K super-block's 6-bit scales (`[j]`) and minimums (`[8 + j]`) of sub-block `j`, each as the 16 rows'
/// bytes: [`crate::quant::k4_scale_min`] on 16 rows at once, from the 12 bytes' lines at `p`.
///
/// # Safety
/// SSE2; `p` points at 12 × 16 readable bytes.
#[inline(always)]
unsafe fn k4_scales(p: *const u8) -> [__m128i; 16] {
    // SAFETY: forwarded.
    unsafe {
        let (six, nibble, top) = (_mm_set1_epi8(63), _mm_set1_epi8(0x0f), _mm_set1_epi8(0x30));
        let mut q = [_mm_setzero_si128(); 12];
        for (k, q) in q.iter_mut().enumerate() {
            *q = _mm_loadu_si128(p.add(k * ROWS) as *const __m128i);
        }
        let mut out = [_mm_setzero_si128(); 16];
        for j in 0..4 {
            out[j] = _mm_and_si128(q[j], six);
            out[8 + j] = _mm_and_si128(q[j + 4], six);
            // Sub-block j + 4's: nibbles of byte j + 8, top bits from bytes j (scale) and j + 4 (minimum).
            let (scale_top, min_top) =
                (_mm_and_si128(_mm_srli_epi16::<2>(q[j]), top), _mm_and_si128(_mm_srli_epi16::<2>(q[j + 4]), top));
            out[4 + j] = _mm_or_si128(_mm_and_si128(q[j + 8], nibble), scale_top);
            out[12 + j] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(q[j + 8]), nibble), min_top);
        }
        out
    }
}

/// Sub-block `j`'s 4-bit values of one 4-byte group (line `line`): the low nibbles for even `j`, high for odd.
#[inline(always)]
fn q4k_line(j: usize, g: usize) -> usize {
    ((j / 2) * (QK / 4) + g) * LINE
}

/// Q6_K sub-block `j`'s lines of group `g`: its low nibbles (high ones if `j % 4 ≥ 2`) and its top bits.
#[inline(always)]
fn q6k_lines(j: usize, g: usize) -> (usize, usize) {
    let (n, c) = (j / 4, j % 4);
    ((16 * n + 8 * (c % 2) + g) * LINE, (HIGH_LINE + 8 * n + g) * LINE)
}

/// What each value of a format with a scale per 16 elements is stored above: Q6_K's `q + 32`, Q3_K's `q + 4`.
const fn half_bias(f: u8) -> i32 {
    match f {
        Q6_K => -32,
        Q3_K => -4,
        _ => 0,
    }
}

/// The 16 rows' signed scales of 16-element half `k` (0..16) of a Q2_K, Q3_K or Q6_K super-block at `blk`: Q6_K's
/// bytes, Q2_K's low nibbles, Q3_K's 6 bits ([`crate::quant::q3k_scale`] on 16 rows at once) less 32.
///
/// # Safety
/// SSE2; `blk` points at a super-block of format `F`.
#[inline(always)]
unsafe fn half_scales<const F: u8>(blk: *const u8, k: usize) -> __m128i {
    // SAFETY: forwarded; the fields lie inside the super-block.
    unsafe {
        let field = |n: usize| _mm_loadu_si128(blk.add(scales_at(F) + n * ROWS) as *const __m128i);
        let shr = |v: __m128i, n: usize| _mm_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
        match F {
            Q6_K => field(k),
            Q2_K => _mm_and_si128(field(k), _mm_set1_epi8(0x0f)),
            _ => {
                let low = _mm_and_si128(shr(field(k % 8), 4 * (k / 8)), _mm_set1_epi8(0x0f));
                let high = _mm_and_si128(shr(field(8 + k % 4), 2 * (k / 4)), _mm_set1_epi8(3));
                _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16::<4>(high)), _mm_set1_epi8(32))
            }
        }
    }
}

/// Q2_K sub-block `j`'s minimums of its two halves as 16-bit pairs, row after row (rows 0..8, then 8..16), for one
/// `madd` against a token's two half sums.
///
/// # Safety
/// SSE2; `blk` points at a Q2_K super-block.
#[inline(always)]
unsafe fn q2k_min_pairs(blk: *const u8, j: usize) -> [__m128i; 2] {
    // SAFETY: forwarded; the fields lie inside the super-block.
    unsafe {
        let min = |k: usize| {
            let field = _mm_loadu_si128(blk.add(scales_at(Q2_K) + k * ROWS) as *const __m128i);
            _mm_and_si128(_mm_srli_epi16::<4>(field), _mm_set1_epi8(0x0f))
        };
        interleave_rows(min(2 * j), min(2 * j + 1))
    }
}

/// Two 16-row byte vectors as pairs `(x_row, y_row)`, row after row: rows 0..8, then rows 8..16.
///
/// # Safety
/// SSE2.
#[inline(always)]
unsafe fn interleave_rows(x: __m128i, y: __m128i) -> [__m128i; 2] {
    // SAFETY: forwarded.
    unsafe { [_mm_unpacklo_epi8(x, y), _mm_unpackhi_epi8(x, y)] }
}

/// The 2-bit field line and (Q3_K) high-bit line of sub-block `j`'s group `g` in a Q2_K or Q3_K super-block: the
/// 32 bytes of fields of each half of 128 elements are 8 lines, quarter `j % 4` at bits `2·(j % 4)`; the high bit
/// is bit `j` of the 8 high-bit lines.
#[inline(always)]
fn k2_lines(j: usize, g: usize) -> (usize, usize) {
    ((8 * (j / 4) + g) * LINE, (Q3K_HIGH_LINE + g) * LINE)
}

/// The counts [`q6k_values512`] shifts sub-block `j`'s lines by, in every 32-bit lane: its nibbles right by 0 or 4
/// and its top bits (bits `2·(j % 4)` of their byte) rotated to bits 4-5. As for [`k2_counts`].
#[inline(always)]
fn q6k_counts(j: usize) -> [__m512i; 2] {
    // SAFETY: AVX-512 F, which every caller's level has.
    std::hint::black_box(unsafe {
        [_mm512_set1_epi32(4 * (j % 4 / 2) as i32), _mm512_set1_epi32(((2 * (j % 4) + 28) % 32) as i32)]
    })
}

/// Sub-block `j`'s values of group `g` for the 16 rows of a Q6_K super-block at `blk`, unsigned (`q + 32`), with
/// `j`'s [`q6k_counts`].
///
/// # Safety
/// AVX-512 F/BW; `blk` points at a Q6_K super-block.
#[inline(always)]
unsafe fn q6k_values512(blk: *const u8, j: usize, g: usize, counts: &[__m512i; 2]) -> __m512i {
    // SAFETY: forwarded; the lines lie inside the super-block.
    unsafe {
        let (ql, qh) = q6k_lines(j, g);
        let low4 = _mm512_srlv_epi32(_mm512_loadu_si512(blk.add(ql) as *const __m512i), counts[0]);
        let high2 = _mm512_rorv_epi32(_mm512_loadu_si512(blk.add(qh) as *const __m512i), counts[1]);
        // (low4 & 0x0f) | (high2 & 0x30)
        _mm512_ternarylogic_epi32::<0xec>(low4, _mm512_and_si512(high2, _mm512_set1_epi8(0x30)), _mm512_set1_epi8(0x0f))
    }
}

/// The counts [`k2_values512`] shifts sub-block `j`'s lines by, in every 32-bit lane: right by `2·(j % 4)` (its
/// 2-bit field down to bits 0-1) and rotated right by `j - 2` (its high bit to bit 2). Made once per sub-block and
/// hidden from the optimizer, which would otherwise turn a shift by equal counts into a shift by one count held
/// in a register: two instructions where this is one (`j` is not a constant; the sub-block loop stays rolled).
#[inline(always)]
fn k2_counts(j: usize) -> [__m512i; 2] {
    // SAFETY: AVX-512 F, which every caller's level has.
    std::hint::black_box(unsafe { [_mm512_set1_epi32(2 * (j % 4) as i32), _mm512_set1_epi32(((j + 30) % 32) as i32)] })
}

/// Sub-block `j`'s values of group `g` for the 16 rows of a Q2_K or Q3_K super-block at `blk`, unsigned (Q3_K's
/// `q + 4`), with `j`'s [`k2_counts`].
///
/// # Safety
/// AVX-512 F/BW; `blk` points at a super-block of format `F`.
#[inline(always)]
unsafe fn k2_values512<const F: u8>(blk: *const u8, j: usize, g: usize, counts: &[__m512i; 2]) -> __m512i {
    // SAFETY: forwarded; the lines lie inside the super-block.
    unsafe {
        let (two, high) = k2_lines(j, g);
        let line = _mm512_srlv_epi32(_mm512_loadu_si512(blk.add(two) as *const __m512i), counts[0]);
        if F != Q3_K {
            return _mm512_and_si512(line, _mm512_set1_epi8(3));
        }
        // The high bit rotated to bit 2 (the 4 of `q + 4`) and or'ed above the 2-bit field: a test and a masked
        // add would be three instructions (LLVM makes the add an `or` and a masked move).
        let high = _mm512_rorv_epi32(_mm512_loadu_si512(blk.add(high) as *const __m512i), counts[1]);
        let high = _mm512_and_si512(high, _mm512_set1_epi8(4));
        // (line & 3) | high
        _mm512_ternarylogic_epi32::<0xec>(line, high, _mm512_set1_epi8(3))
    }
}

/// `x86`'s 512-bit tile for a K-quant: 16 rows in one register per token, per sub-block one `vpdpbusd` per group
/// and token (Q6_K: sums per half, each started at `-32 · Σ a` of the half and times its scale).
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI; otherwise as for `x86::Tile`, with `o.blocks` a multiple of 8.
#[inline(always)]
pub(super) unsafe fn wide<const T: usize, const F: u8>(o: Operands) {
    let Operands { w, a, pairs, q3k_starts, q6k_starts, blocks, out, stride, rows, .. } = o;
    // SAFETY (whole body): the caller's ranges; a super-block is `block_bytes(F)` bytes laid out as `kquant` says.
    unsafe {
        let low = _mm512_set1_epi8(0x0f);
        let sign = _mm512_set1_epi32(i32::MIN);
        let mut acc = [_mm512_setzero_ps(); T];
        for sb in 0..blocks / SUBS {
            let blk = w.add(sb * block_bytes(F));
            prefetch::<F>(blk);
            if !per_half(F) {
                let sm = k4_scales(blk.add(scales_at(F)));
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(d_at(F)) as *const __m256i));
                let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(dmin_at(F)) as *const __m256i));
                for j in 0..rolled(SUBS) {
                    let b = sb * SUBS + j;
                    let mut sum = [_mm512_setzero_si512(); T];
                    for g in 0..QK / 4 {
                        let line = _mm512_loadu_si512(blk.add(q4k_line(j, g)) as *const __m512i);
                        let v = if j % 2 == 0 { line } else { _mm512_srli_epi16::<4>(line) };
                        let mut v = _mm512_and_si512(v, low);
                        if F == Q5_K {
                            let high = _mm512_loadu_si512(blk.add((HIGH_LINE + g) * LINE) as *const __m512i);
                            let set = _mm512_test_epi8_mask(high, _mm512_set1_epi8((1u8 << j) as i8));
                            v = _mm512_mask_add_epi8(v, set, v, _mm512_set1_epi8(0x10));
                        }
                        dots512(&mut sum, v, a, blocks, b, g);
                    }
                    let dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm[j])));
                    let min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm[8 + j])));
                    let neg_min = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(min), sign));
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let ab = &*a.add(t * blocks + b);
                        *acc =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(dsc, _mm512_set1_ps(ab.d)), *acc);
                        *acc = _mm512_fmadd_ps(neg_min, _mm512_set1_ps(ab.s), *acc);
                    }
                }
            } else {
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(d_at(F)) as *const __m256i));
                let neg_dmin = if F == Q2_K {
                    let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(dmin_at(F)) as *const __m256i));
                    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmin), sign))
                } else {
                    _mm512_setzero_ps()
                };
                for j in 0..rolled(SUBS) {
                    let b = sb * SUBS + j;
                    if F == Q6_K {
                        q6k_sub_block(blk, j, b, a, q6k_starts, blocks, d, &mut acc);
                        continue;
                    }
                    let total = paired_halves::<T, F>(blk, j, b, a, q3k_starts, blocks);
                    let mins = if F == Q2_K {
                        let [lo, hi] = q2k_min_pairs(blk, j);
                        _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo))
                    } else {
                        _mm512_setzero_si512()
                    };
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let ab = &*a.add(t * blocks + b);
                        *acc =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[t]), _mm512_mul_ps(d, _mm512_set1_ps(ab.d)), *acc);
                        if F == Q2_K {
                            let m = _mm512_madd_epi16(mins, _mm512_set1_epi32(*pairs.add(t * blocks + b)));
                            *acc = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(m),
                                _mm512_mul_ps(neg_dmin, _mm512_set1_ps(ab.d)),
                                *acc,
                            );
                        }
                    }
                }
            }
        }
        store512(&acc, out, stride, rows);
    }
}

/// Both halves' `vpdpbusd` sums of a sub-block (activation block `b`) for `T` tokens, each started at the token's
/// `starts` of the block (broadcast from memory) or at 0; `values(g)` gives the 16 rows' values of group `g`.
///
/// # Safety
/// AVX-512 F and VNNI; `a` and `starts` point at `T` tokens' rows of `blocks` activation blocks, `b` below
/// `blocks`; `values` reads inside its super-block.
#[inline(always)]
unsafe fn half_sums<const T: usize>(
    starts: Option<*const [i32; 2]>,
    values: impl Fn(usize) -> __m512i,
    a: *const Q8Block,
    blocks: usize,
    b: usize,
) -> [[__m512i; T]; 2] {
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        // Plain loops: `array::from_fn` and `map` leave calls behind that take the registers through memory.
        let mut sums = [[_mm512_setzero_si512(); T]; 2];
        if let Some(starts) = starts {
            let [first, second] = &mut sums;
            for (t, (f, s)) in first.iter_mut().zip(second.iter_mut()).enumerate() {
                let [s0, s1] = *starts.add(t * blocks + b);
                (*f, *s) = (_mm512_set1_epi32(s0), _mm512_set1_epi32(s1));
            }
        }
        for g in 0..4 {
            dots512(&mut sums[0], values(g), a, blocks, b, g);
            dots512(&mut sums[1], values(g + 4), a, blocks, b, g + 4);
        }
        sums
    }
}

/// Sub-block `j` (activation block `b`) of the 16 rows of a Q2_K or Q3_K super-block at `blk`: each token's
/// `Σ_h sc_h · Σ_{l∈h} q_l·a_l` as integers, the same integers as one `mullo` per half at fewer instructions on
/// the ports that multiply. Each half's `vpdpbusd` sum fits the low 16-bit word of its register (Q2_K's `Σ q·a` at
/// most 16 · 3 · 127 in magnitude; Q3_K's, of the stored `q + 4`, started at [`super::q3k_start`]), so one `madd`
/// and one `vpdpwssds` against words holding the row's scale (low) and, for Q3_K, `-4 ·` the scale (high, against
/// the half's activation sum in the high word: the bias of the stored values) scale and add both halves; Q2_K's
/// high words are multiplied by 0. The starts are broadcast from memory (no port that computes). 512-bit tile, ns per block and token: Q3_K 0.38 → 0.35 (the halves as 16-bit
/// pairs, shifted and offset) → 0.28 (this), Q2_K 0.30 → 0.28 → 0.24; with [`k2_values512`]'s shifts, Q3_K 0.26.
///
/// # Safety
/// AVX-512 F/BW and VNNI; `blk` points at a super-block of format `F` (Q2_K or Q3_K), `a` and `starts` at `T`
/// tokens' rows of `blocks` activation blocks, `b` below `blocks`.
#[inline(always)]
unsafe fn paired_halves<const T: usize, const F: u8>(
    blk: *const u8,
    j: usize,
    b: usize,
    a: *const Q8Block,
    starts: *const [i32; 2],
    blocks: usize,
) -> [__m512i; T] {
    // SAFETY (whole body): the caller's ranges; the fields lie inside the super-block.
    unsafe {
        let counts = k2_counts(j);
        let starts = if F == Q3_K { Some(starts) } else { None };
        let [mut first, second] = half_sums::<T>(starts, |g| k2_values512::<F>(blk, j, g, &counts), a, blocks, b);
        // The rows' scales in the low words; Q3_K's `-4 ·` them in the high ones (`-(sc << 18)`), Q2_K's 0 (its
        // scales are not negative).
        let words = |k: usize| {
            let sc = _mm512_cvtepi8_epi32(half_scales::<F>(blk, k));
            if F == Q3_K {
                _mm512_sub_epi32(_mm512_and_si512(sc, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32::<18>(sc))
            } else {
                sc
            }
        };
        let (w0, w1) = (words(2 * j), words(2 * j + 1));
        for (f, s) in first.iter_mut().zip(&second) {
            // The saturating form, which never saturates here (every sum stays far inside 32 bits): LLVM splits
            // the plain `vpdpwssd` back into `madd` + `add` to shorten the chain, at one more instruction.
            *f = _mm512_dpwssds_epi32(_mm512_madd_epi16(*f, w0), *s, w1);
        }
        first
    }
}

/// Sub-block `j` (activation block `b`) of the 16 rows of a Q6_K super-block at `blk` into `acc`: each half's
/// `vpdpbusd` sum, started from memory at `-32 · Σ a` of its activations (the stored values' bias), times its
/// scale and added in floats instead of with a `mullo` (two instructions on one port) and an `add` per half: the
/// integers are exact as floats (`|Σ q·a| ≤ 16 · 32 · 128`, times `|sc| ≤ 128`, both halves within 2^24), so the
/// product, and the `fma` that adds the second, give the integer sum's float, the bits of the integer route.
/// 512-bit tile, ns per block and token: 0.36 → 0.28.
///
/// # Safety
/// As for [`paired_halves`], with a Q6_K super-block and `starts` at `Acts`' `q6k_starts`; `d` holds the rows' d.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q6k_sub_block<const T: usize>(
    blk: *const u8,
    j: usize,
    b: usize,
    a: *const Q8Block,
    starts: *const [i32; 2],
    blocks: usize,
    d: __m512,
    acc: &mut [__m512; T],
) {
    // SAFETY (whole body): the caller's ranges; the fields lie inside the super-block.
    unsafe {
        let counts = q6k_counts(j);
        let [first, second] = half_sums::<T>(Some(starts), |g| q6k_values512(blk, j, g, &counts), a, blocks, b);
        let scale = |k: usize| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half_scales::<Q6_K>(blk, k)));
        let (sc0, sc1) = (scale(2 * j), scale(2 * j + 1));
        for t in 0..T {
            let ab = &*a.add(t * blocks + b);
            let both =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(second[t]), sc1, _mm512_mul_ps(_mm512_cvtepi32_ps(first[t]), sc0));
            acc[t] = _mm512_fmadd_ps(both, _mm512_mul_ps(d, _mm512_set1_ps(ab.d)), acc[t]);
        }
    }
}

/// Both halves of 8 rows of super-block `sb` at `blk` into their accumulators (`x86`'s `halves` for a K-quant).
///
/// # Safety
/// Level `V`'s features; otherwise as for `x86::Tile`.
#[inline(always)]
pub(super) unsafe fn super_block_halves<const V: u8, const T: usize, const F: u8>(
    blk: *const u8,
    sb: usize,
    o: Operands,
    acc: &mut [[__m256; T]; 2],
) {
    // SAFETY: forwarded.
    unsafe {
        let sm = if per_half(F) {
            std::array::from_fn(|k| half_scales::<F>(blk, k))
        } else {
            k4_scales(blk.add(scales_at(F)))
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            half_block::<V, T, F>(r, blk, sb, &sm, o, acc);
        }
    }
}

/// The 8 bytes of rows `8r..8r + 8` of a 16-row byte vector, widened to 32-bit lanes (signed for Q6_K's scales).
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn rows_of<const SIGNED: bool>(v: __m128i, r: usize) -> __m256i {
    // SAFETY: forwarded.
    unsafe {
        let v = if r == 0 { v } else { _mm_unpackhi_epi64(v, v) };
        if SIGNED { _mm256_cvtepi8_epi32(v) } else { _mm256_cvtepu8_epi32(v) }
    }
}

/// Rows `8r..8r + 8` of super-block `sb` at `blk` into their accumulators (`sm`: Q4_K's or Q5_K's scales and
/// minimums, or the other formats' 16 half scales).
///
/// # Safety
/// As for [`super_block_halves`].
#[inline(always)]
unsafe fn half_block<const V: u8, const T: usize, const F: u8>(
    r: usize,
    blk: *const u8,
    sb: usize,
    sm: &[__m128i; 16],
    o: Operands,
    acc: &mut [__m256; T],
) {
    let Operands { a, pairs, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        let v = blk.add(32 * r);
        if !per_half(F) {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(d_at(F) + 16 * r) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(dmin_at(F) + 16 * r) as *const __m128i));
            for j in 0..rolled(SUBS) {
                let b = sb * SUBS + j;
                let mut sum = [_mm256_setzero_si256(); T];
                for g in (0..QK / 4).step_by(2) {
                    let q = [k4_values::<F>(v, j, g), k4_values::<F>(v, j, g + 1)];
                    dots256_pair::<V, T, F>(&mut sum, q, [g, g + 1], a, blocks, b);
                }
                let dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(rows_of::<false>(sm[j], r)));
                let min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(rows_of::<false>(sm[8 + j], r)));
                let neg_min = _mm256_xor_ps(min, _mm256_set1_ps(-0.0));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let ab = &*a.add(t * blocks + b);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(dsc, _mm256_set1_ps(ab.d)), *acc);
                    *acc = _mm256_fmadd_ps(neg_min, _mm256_set1_ps(ab.s), *acc);
                }
            }
            return;
        }
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(d_at(F) + 16 * r) as *const __m128i));
        let neg_dmin = if F == Q2_K {
            _mm256_xor_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(dmin_at(F) + 16 * r) as *const __m128i)),
                _mm256_set1_ps(-0.0),
            )
        } else {
            _mm256_setzero_ps()
        };
        for j in 0..rolled(SUBS) {
            let b = sb * SUBS + j;
            let total = scaled::<V, T, F>(v, [sm[2 * j], sm[2 * j + 1]], j, b, r, o);
            let mins = if F == Q2_K { _mm256_cvtepu8_epi16(q2k_min_pairs(blk, j)[r]) } else { _mm256_setzero_si256() };
            for (t, acc) in acc.iter_mut().enumerate() {
                let ab = &*a.add(t * blocks + b);
                *acc = _mm256_fmadd_ps(total[t], _mm256_mul_ps(d, _mm256_set1_ps(ab.d)), *acc);
                if F == Q2_K {
                    let m = _mm256_madd_epi16(mins, _mm256_set1_epi32(*pairs.add(t * blocks + b)));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(neg_dmin, _mm256_set1_ps(ab.d)), *acc);
                }
            }
        }
    }
}

/// Sub-block `j` (activation block `b`) of rows `8r..8r + 8` of a Q2_K, Q3_K or Q6_K super-block (values at `v`,
/// its halves' scales `s`): each token's `Σ_h sc_h · Σ_{l∈h} q_l·a_l`, an integer, as a float. With VNNI each
/// half's `vpdpbusd` sums (Q3_K's and Q6_K's started at `bias · Σ a`) are scaled and added in floats, exactly (as in
/// [`q6k_sub_block`]: every product and both halves' total stay within 2^24), where a `mullo` per half cost two
/// instructions (pairing the halves as [`paired_halves`] does gained nothing here: the 16 registers fill up).
/// Without, two groups' `maddubs` products are summed as 16-bit integers (values below 64), then one `madd` against
/// the half's scale in both 16-bit lanes of each row multiplies and sums at once; the bias, `bias · Σ_h
/// sc_h·Σ_{l∈h} a_l`, is one `madd` of the two scales against the token's two half sums, shifted (`-bias` is 4 or
/// 32).
///
/// # Safety
/// Level `V`'s features; otherwise as for [`super_block_halves`].
#[inline(always)]
unsafe fn scaled<const V: u8, const T: usize, const F: u8>(
    v: *const u8,
    s: [__m128i; 2],
    j: usize,
    b: usize,
    r: usize,
    o: Operands,
) -> [__m256; T] {
    let Operands { a, halves, pairs, q6k_starts, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        if V != AVX2 {
            let mut sums = [[_mm256_setzero_si256(); T]; 2];
            for (h, sum) in sums.iter_mut().enumerate() {
                for (t, s) in sum.iter_mut().enumerate() {
                    *s = match F {
                        Q6_K => _mm256_set1_epi32((*q6k_starts.add(t * blocks + b))[h]),
                        Q3_K => _mm256_set1_epi32(half_bias(F) * (*halves.add(t * blocks + b))[h]),
                        _ => _mm256_setzero_si256(),
                    };
                }
                for g in (4 * h..4 * h + 4).step_by(2) {
                    let q = [values256::<F>(v, j, g), values256::<F>(v, j, g + 1)];
                    dots256_pair::<V, T, F>(sum, q, [g, g + 1], a, blocks, b);
                }
            }
            let scale = |h: usize| _mm256_cvtepi32_ps(rows_of::<true>(s[h], r));
            let (sc0, sc1) = (scale(0), scale(1));
            let mut total = [_mm256_setzero_ps(); T];
            for (t, total) in total.iter_mut().enumerate() {
                let first = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[0][t]), sc0);
                *total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[1][t]), sc1, first);
            }
            return total;
        }
        let mut total = [_mm256_setzero_si256(); T];
        for (h, &sh) in s.iter().enumerate() {
            let scale = row_pairs(sh, sh, r);
            for g in (4 * h..4 * h + 4).step_by(2) {
                let q = [values256::<F>(v, j, g), values256::<F>(v, j, g + 1)];
                for (t, total) in total.iter_mut().enumerate() {
                    let p0 = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(four(a, blocks, t, b, g)));
                    let p1 = _mm256_maddubs_epi16(q[1], _mm256_set1_epi32(four(a, blocks, t, b, g + 1)));
                    *total = _mm256_add_epi32(*total, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), scale));
                }
            }
        }
        if half_bias(F) != 0 {
            let scales = row_pairs(s[0], s[1], r);
            for (t, total) in total.iter_mut().enumerate() {
                let m = _mm256_madd_epi16(scales, _mm256_set1_epi32(*pairs.add(t * blocks + b)));
                let m = if F == Q6_K { _mm256_slli_epi32::<5>(m) } else { _mm256_slli_epi32::<2>(m) };
                *total = _mm256_sub_epi32(*total, m);
            }
        }
        let mut floats = [_mm256_setzero_ps(); T];
        for (f, total) in floats.iter_mut().zip(&total) {
            *f = _mm256_cvtepi32_ps(*total);
        }
        floats
    }
}

/// Rows `8r..8r + 8` of two 16-row byte vectors as 16-bit pairs `(x_row, y_row)`, sign-extended, row after row.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn row_pairs(x: __m128i, y: __m128i, r: usize) -> __m256i {
    // SAFETY: forwarded.
    unsafe { _mm256_cvtepi8_epi16(interleave_rows(x, y)[r]) }
}

/// Sub-block `j`'s values of group `g` for the 8 rows at `v` (Q4_K's nibbles, with Q5_K's fifth bits).
///
/// # Safety
/// AVX2; `v` points at the rows' first byte of a Q4_K or Q5_K super-block.
#[inline(always)]
unsafe fn k4_values<const F: u8>(v: *const u8, j: usize, g: usize) -> __m256i {
    // SAFETY: forwarded; the lines lie inside the super-block.
    unsafe {
        let line = _mm256_loadu_si256(v.add(q4k_line(j, g)) as *const __m256i);
        let q = if j.is_multiple_of(2) { line } else { _mm256_srli_epi16::<4>(line) };
        let q = _mm256_and_si256(q, _mm256_set1_epi8(0x0f));
        if F != Q5_K {
            return q;
        }
        let high = _mm256_loadu_si256(v.add((HIGH_LINE + g) * LINE) as *const __m256i);
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
        _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }
}

/// Sub-block `j`'s values of group `g` for the 8 rows at `v` of a Q2_K, Q3_K or Q6_K super-block, unsigned (Q3_K's
/// `q + 4`, Q6_K's `q + 32`).
///
/// # Safety
/// AVX2; `v` points at the rows' first byte of a super-block of format `F`.
#[inline(always)]
unsafe fn values256<const F: u8>(v: *const u8, j: usize, g: usize) -> __m256i {
    // SAFETY: forwarded; the lines lie inside the super-block.
    unsafe {
        if F == Q6_K {
            let (ql, qh) = q6k_lines(j, g);
            let ql = _mm256_loadu_si256(v.add(ql) as *const __m256i);
            let qh = _mm256_loadu_si256(v.add(qh) as *const __m256i);
            let low4 = if j % 4 < 2 { ql } else { _mm256_srli_epi16::<4>(ql) };
            let high2 = match j % 4 {
                0 => _mm256_slli_epi16::<4>(qh),
                1 => _mm256_slli_epi16::<2>(qh),
                2 => qh,
                _ => _mm256_srli_epi16::<2>(qh),
            };
            return _mm256_or_si256(
                _mm256_and_si256(low4, _mm256_set1_epi8(0x0f)),
                _mm256_and_si256(high2, _mm256_set1_epi8(0x30)),
            );
        }
        let (two, high) = k2_lines(j, g);
        let line = _mm256_loadu_si256(v.add(two) as *const __m256i);
        let q = _mm256_and_si256(_mm256_srl_epi16(line, _mm_cvtsi32_si128(2 * (j % 4) as i32)), _mm256_set1_epi8(3));
        if F != Q3_K {
            return q;
        }
        let high = _mm256_loadu_si256(v.add(high) as *const __m256i);
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
        _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(4)))
    }
}
