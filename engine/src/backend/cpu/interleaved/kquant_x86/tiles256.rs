//! The 256-bit (AVX2, AVX-VNNI) tiles of the K-quants: a row group in two halves of 8 rows ([`super_block_halves`]).

use super::super::kquant::{HIGH_LINE, d_at, dmin_at, per_half, scales_at};
use super::super::x86::{Operands, dots256_pair, maddubs_pair};
use super::super::{Q2_K, Q3_K, Q4_K, Q5_K, Q6_K};
use super::{
    LINE, SUBS, half_scales, interleave_rows, k2_lines, k4_scales, q2k_min_pairs, q4k_line, q6k_lines, rolled,
};
use crate::backend::cpu::simd::x86::{AVX_VNNI, AVX2};
use crate::quant::QK;
use std::arch::x86_64::*;

/// [`floats512`](super::tiles512) for 8 rows.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn floats256<const T: usize>(s: &[__m256i; T]) -> [__m256; T] {
    // SAFETY: forwarded.
    unsafe {
        let mut floats = [_mm256_setzero_ps(); T];
        for (f, s) in floats.iter_mut().zip(s) {
            *f = _mm256_cvtepi32_ps(*s);
        }
        floats
    }
}

/// Both halves of 8 rows of super-block `sb` at `blk` into their accumulators (`x86`'s `halves` for a K-quant).
///
/// # Safety
/// Level `V`'s features; otherwise as for `x86::Tile`, with the activations of each super-block under one scale.
#[inline(always)]
pub(in super::super) unsafe fn super_block_halves<const V: u8, const T: usize, const F: u8>(
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
/// minimums, or the other formats' 16 half scales): [`wide`](super::tiles512::wide)'s arithmetic on 8 rows.
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
    let Operands { a, pairs, sub_pairs, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        let v = blk.add(32 * r);
        let first = sb * SUBS;
        let s =
            if per_half(F) { scaled::<V, T, F>(v, sm, first, r, o) } else { k4_sums256::<V, T, F>(v, sm, first, r, o) };
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(d_at(F) + 16 * r) as *const __m128i));
        for (t, acc) in acc.iter_mut().enumerate() {
            let d_a = _mm256_set1_ps((*a.add(t * blocks + first)).d);
            *acc = _mm256_fmadd_ps(s[t], _mm256_mul_ps(d, d_a), *acc);
        }
        if F == Q3_K || F == Q6_K {
            return;
        }
        // The minimums' `Σ m·Σ a`, as `mins512` (a `madd` and an `add` per pair: once per super-block).
        let mut m = [_mm256_setzero_si256(); T];
        let (count, step, sums) = if F == Q2_K { (SUBS, 1, pairs) } else { (SUBS / 2, 2, sub_pairs) };
        for p in 0..count {
            let pair = if F == Q2_K { q2k_min_pairs(blk, p) } else { interleave_rows(sm[8 + 2 * p], sm[9 + 2 * p]) };
            let words = _mm256_cvtepu8_epi16(pair[r]);
            for (t, m) in m.iter_mut().enumerate() {
                let x = _mm256_set1_epi32(*sums.add(t * blocks + first + step * p));
                *m = _mm256_add_epi32(*m, _mm256_madd_epi16(words, x));
            }
        }
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(dmin_at(F) + 16 * r) as *const __m128i));
        let neg_dmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0));
        for (t, acc) in acc.iter_mut().enumerate() {
            let d_a = _mm256_set1_ps((*a.add(t * blocks + first)).d);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[t]), _mm256_mul_ps(neg_dmin, d_a), *acc);
        }
    }
}

/// [`k4_sums`](super::tiles512) for rows `8r..8r + 8` (values at `v`, scales in `sm`) at level `V`.
///
/// # Safety
/// As for [`super_block_halves`].
#[inline(always)]
// `j` also picks the lines and the activation block; the loop's bound stays hidden (`rolled`).
#[allow(clippy::needless_range_loop)]
unsafe fn k4_sums256<const V: u8, const T: usize, const F: u8>(
    v: *const u8,
    sm: &[__m128i; 16],
    first: usize,
    r: usize,
    o: Operands,
) -> [__m256; T] {
    let Operands { a, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        if F == Q4_K {
            // As `k4_sums`: with VNNI a `vpdpwssds` per half; without, two groups' `maddubs` products summed as
            // 16-bit integers, then one `madd` against the scale in both words of each row's lane, added straight
            // into the super-block's sums (a sum per sub-block first cost T adds per sub-block and T registers).
            let mut s = [_mm256_setzero_si256(); T];
            for j in 0..rolled(SUBS) {
                let b = first + j;
                if V == AVX2 {
                    let pair_scale = row_pairs(sm[j], sm[j], r);
                    for g in (0..QK / 4).step_by(2) {
                        let q = [k4_values::<F>(v, j, g), k4_values::<F>(v, j, g + 1)];
                        maddubs_pair(&mut s, q, [g, g + 1], pair_scale, a, blocks, b);
                    }
                    continue;
                }
                let w = rows_of::<false>(sm[j], r);
                for h in 0..2 {
                    let mut sum = [_mm256_setzero_si256(); T];
                    for g in (4 * h..4 * h + 4).step_by(2) {
                        let q = [k4_values::<F>(v, j, g), k4_values::<F>(v, j, g + 1)];
                        dots256_pair::<V, T, F>(&mut sum, q, [g, g + 1], a, blocks, b);
                    }
                    for (s, sum) in s.iter_mut().zip(&sum) {
                        *s = dpwssds256::<V>(*s, *sum, w);
                    }
                }
            }
            return floats256(&s);
        }
        let mut s = [_mm256_setzero_ps(); T];
        for j in 0..rolled(SUBS) {
            let b = first + j;
            let mut sum = [_mm256_setzero_si256(); T];
            for g in (0..QK / 4).step_by(2) {
                let q = [k4_values::<F>(v, j, g), k4_values::<F>(v, j, g + 1)];
                dots256_pair::<V, T, F>(&mut sum, q, [g, g + 1], a, blocks, b);
            }
            let sc = _mm256_cvtepi32_ps(rows_of::<false>(sm[j], r));
            for (s, sum) in s.iter_mut().zip(&sum) {
                *s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*sum), sc, *s);
            }
        }
        s
    }
}

/// A Q2_K, Q3_K or Q6_K super-block's `Σ sc·Σ q·a` for rows `8r..8r + 8` (values at `v`, half scales `sm`), as
/// [`k2_sums`](super::tiles512) and [`q6k_sums`](super::tiles512) make it. With VNNI: `vpdpbusd` sums per half, Q2_K's and Q3_K's (in the low 16-bit
/// word, Q3_K's started at `acts::q3k_start`) scaled by `vpdpwssds`, Q6_K's (started at `-32 · Σ a`) in floats.
/// Without: two groups' `maddubs` products are summed as 16-bit integers (values below 64); Q2_K's and Q3_K's then
/// one `madd` against the half's scale in both 16-bit lanes of each row multiplies and sums at once (Q3_K's bias,
/// `-4 · Σ_h sc_h·Σ_{l∈h} a_l`, one `madd` of the two scales against the token's two half sums, shifted), Q6_K's one
/// `madd` against ones from `-32 · Σ a`, then in floats.
///
/// # Safety
/// Level `V`'s features; otherwise as for [`super_block_halves`].
#[inline(always)]
unsafe fn scaled<const V: u8, const T: usize, const F: u8>(
    v: *const u8,
    sm: &[__m128i; 16],
    first: usize,
    r: usize,
    o: Operands,
) -> [__m256; T] {
    let Operands { a, pairs, q3k_starts, q6k_starts, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        let mut isum = [_mm256_setzero_si256(); T];
        let mut fsum = [_mm256_setzero_ps(); T];
        for j in 0..rolled(SUBS) {
            let b = first + j;
            let s = [sm[2 * j], sm[2 * j + 1]];
            for (h, &sh) in s.iter().enumerate() {
                let mut sum = [_mm256_setzero_si256(); T];
                for (t, sum) in sum.iter_mut().enumerate() {
                    *sum = match F {
                        Q6_K => _mm256_set1_epi32((*q6k_starts.add(t * blocks + b))[h]),
                        Q3_K if V != AVX2 => _mm256_set1_epi32((*q3k_starts.add(t * blocks + b))[h]),
                        _ => _mm256_setzero_si256(),
                    };
                }
                // Without VNNI, Q2_K's and Q3_K's products go straight into the super-block's sums.
                let direct = V == AVX2 && F != Q6_K;
                let into = if direct { &mut isum } else { &mut sum };
                for g in (4 * h..4 * h + 4).step_by(2) {
                    let q = [values256::<F>(v, j, g), values256::<F>(v, j, g + 1)];
                    if V != AVX2 {
                        dots256_pair::<V, T, F>(into, q, [g, g + 1], a, blocks, b);
                        continue;
                    }
                    let by = if F == Q6_K { _mm256_set1_epi16(1) } else { row_pairs(sh, sh, r) };
                    maddubs_pair(into, q, [g, g + 1], by, a, blocks, b);
                }
                if F == Q6_K {
                    let sc = _mm256_cvtepi32_ps(rows_of::<true>(sh, r));
                    for (f, sum) in fsum.iter_mut().zip(&sum) {
                        *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*sum), sc, *f);
                    }
                } else if !direct {
                    // Q3_K's scale in both words, against its start; Q2_K's in the low word.
                    let words = if F == Q3_K { row_pairs(sh, sh, r) } else { rows_of::<true>(sh, r) };
                    for (i, sum) in isum.iter_mut().zip(&sum) {
                        *i = dpwssds256::<V>(*i, *sum, words);
                    }
                }
            }
            if V == AVX2 && F == Q3_K {
                let scales = row_pairs(s[0], s[1], r);
                for (t, i) in isum.iter_mut().enumerate() {
                    let m = _mm256_madd_epi16(scales, _mm256_set1_epi32(*pairs.add(t * blocks + b)));
                    *i = _mm256_sub_epi32(*i, _mm256_slli_epi32::<2>(m));
                }
            }
        }
        if F == Q6_K { fsum } else { floats256(&isum) }
    }
}

/// `acc + Σ` of each lane's two 16-bit products `x·y`, saturating (never here) with the level's VNNI.
///
/// # Safety
/// Level `V`'s features (AVX-VNNI or AVX-512 VNNI/VL).
#[inline(always)]
unsafe fn dpwssds256<const V: u8>(acc: __m256i, x: __m256i, y: __m256i) -> __m256i {
    // SAFETY: forwarded.
    unsafe { if V == AVX_VNNI { _mm256_dpwssds_avx_epi32(acc, x, y) } else { _mm256_dpwssds_epi32(acc, x, y) } }
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
