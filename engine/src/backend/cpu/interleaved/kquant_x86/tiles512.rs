//! The 512-bit (AVX-512 with VNNI) tile of the K-quants: 16 rows in one register per token ([`wide`]).

use super::super::kquant::{HIGH_LINE, d_at, dmin_at, per_half, scales_at};
use super::super::x86::{Operands, dots512, prefetch, store512};
use super::super::{Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, ROWS, block_bytes};
use super::{
    LINE, SUBS, half_scales, interleave_rows, k2_lines, k4_scales, q2k_min_pairs, q4k_line, q6k_lines, rolled,
};
use crate::backend::cpu::simd::Q8Block;
use crate::quant::QK;
use std::arch::x86_64::*;

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

/// With GFNI, what picks sub-block `j`'s values out of a Q2_K or Q3_K group's lines, in every lane: the bits a byte
/// takes from the 2-bit line (its field, `3 << 2·(j % 4)`; the rest from the high-bit line), and the affine matrix
/// that moves the field to bits 0-1 and the high bit to bit 2. The high bit sits at bit `j` of its byte, but for
/// j = 0 and 7, where it would share a bit with the field: [`k2_values_gfni`] shifts it to bit 2 or 5 first
/// (`SHIFT`).
#[inline(always)]
fn k2_picks<const F: u8>(j: usize) -> [__m512i; 2] {
    let field = 2 * (j % 4);
    let high = match j {
        0 => 2,
        7 => 5,
        _ => j,
    };
    // Byte 7 - i of the matrix's qword selects output bit i's input bits; Q2_K has no high bit.
    let high_row = if F == Q3_K { (1u64 << high) << 40 } else { 0 };
    let matrix = (1u64 << field) << 56 | (1u64 << (field + 1)) << 48 | high_row;
    // SAFETY: AVX-512 F, which every caller's level has.
    unsafe { [_mm512_set1_epi32((0x0303_0303u32 << field) as i32), _mm512_set1_epi64(matrix as i64)] }
}

/// [`k2_values512`] with GFNI: one `vpternlogd` merges the field with the high bit (Q3_K) and one
/// `vgf2p8affineqb` moves both into place ([`k2_picks`]), where shifts, a rotate and masks take four instructions;
/// Q2_K's field takes the affine alone.
///
/// # Safety
/// AVX-512 F/BW and GFNI; `blk` points at a super-block of format `F`.
#[inline(always)]
unsafe fn k2_values_gfni<const F: u8, const SHIFT: u8>(
    blk: *const u8,
    j: usize,
    g: usize,
    picks: &[__m512i; 2],
) -> __m512i {
    // SAFETY: forwarded; the lines lie inside the super-block.
    unsafe {
        let (two, high) = k2_lines(j, g);
        let line = _mm512_loadu_si512(blk.add(two) as *const __m512i);
        if F != Q3_K {
            return _mm512_gf2p8affine_epi64_epi8::<0>(line, picks[1]);
        }
        let high = _mm512_loadu_si512(blk.add(high) as *const __m512i);
        let high = match SHIFT {
            SHIFT_LEFT => _mm512_slli_epi16::<2>(high),
            SHIFT_RIGHT => _mm512_srli_epi16::<2>(high),
            _ => high,
        };
        // picks[0] ? line : high, bit by bit.
        let merged = _mm512_ternarylogic_epi32::<0xca>(picks[0], line, high);
        _mm512_gf2p8affine_epi64_epi8::<0>(merged, picks[1])
    }
}

/// `x86`'s 512-bit tile for a K-quant: 16 rows in one register per token, per sub-block one `vpdpbusd` per group
/// and token, the super-block's `Σ sc·Σ q·a` gathered over its sub-blocks (as integers or floats, [`kquant::scalar`]'s
/// way) and scaled once: the activations' scale is the super-block's.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI; otherwise as for `x86::Tile`, with `o.blocks` a multiple of 8 and the activations of
/// each super-block under one scale.
///
/// [`kquant::scalar`]: super::super::kquant::scalar
#[inline(always)]
pub(in super::super) unsafe fn wide<const T: usize, const F: u8, const GFNI: bool>(o: Operands) {
    let Operands { w, a, blocks, out, stride, rows, .. } = o;
    // SAFETY (whole body): the caller's ranges; a super-block is `block_bytes(F)` bytes laid out as `kquant` says.
    unsafe {
        let sign = _mm512_set1_epi32(i32::MIN);
        let mut acc = [_mm512_setzero_ps(); T];
        for sb in 0..blocks / SUBS {
            let blk = w.add(sb * block_bytes(F));
            prefetch::<F>(blk);
            let first = sb * SUBS;
            // Q4_K's and Q5_K's scales and minimums, made once for both.
            let sm = if per_half(F) { [_mm_setzero_si128(); 16] } else { k4_scales(blk.add(scales_at(F))) };
            let s = match F {
                Q2_K | Q3_K => k2_sums::<T, F, GFNI>(blk, first, o),
                Q6_K => q6k_sums::<T>(blk, first, o),
                _ => k4_sums::<T, F>(blk, &sm, first, o),
            };
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(d_at(F)) as *const __m256i));
            for (t, acc) in acc.iter_mut().enumerate() {
                let d_a = _mm512_set1_ps((*a.add(t * blocks + first)).d);
                *acc = _mm512_fmadd_ps(s[t], _mm512_mul_ps(d, d_a), *acc);
            }
            if F == Q3_K || F == Q6_K {
                continue;
            }
            let m = mins512::<T, F>(blk, &sm, first, o);
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(dmin_at(F)) as *const __m256i));
            let neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmin), sign));
            for (t, acc) in acc.iter_mut().enumerate() {
                let d_a = _mm512_set1_ps((*a.add(t * blocks + first)).d);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m[t]), _mm512_mul_ps(neg_dmin, d_a), *acc);
            }
        }
        store512(&acc, out, stride, rows);
    }
}

/// Sub-block `j`'s values of group `g` for the 16 rows of a Q4_K or Q5_K super-block at `blk` (its nibbles, with
/// Q5_K's fifth bits): [`k4_values`](super::tiles256) in one 512-bit register.
///
/// # Safety
/// AVX-512 F/BW; `blk` points at a super-block of format `F`.
#[inline(always)]
unsafe fn k4_values512<const F: u8>(blk: *const u8, j: usize, g: usize) -> __m512i {
    // SAFETY: forwarded; the lines lie inside the super-block.
    unsafe {
        let line = _mm512_loadu_si512(blk.add(q4k_line(j, g)) as *const __m512i);
        let q = _mm512_and_si512(
            if j.is_multiple_of(2) { line } else { _mm512_srli_epi16::<4>(line) },
            _mm512_set1_epi8(0x0f),
        );
        if F != Q5_K {
            return q;
        }
        let high = _mm512_loadu_si512(blk.add((HIGH_LINE + g) * LINE) as *const __m512i);
        let set = _mm512_test_epi8_mask(high, _mm512_set1_epi8((1u8 << j) as i8));
        _mm512_mask_add_epi8(q, set, q, _mm512_set1_epi8(0x10))
    }
}

/// Each token's integer sums as floats (a super-block's `Σ sc·Σ q·a` once gathered).
///
/// # Safety
/// AVX-512 F.
#[inline(always)]
unsafe fn floats512<const T: usize>(s: &[__m512i; T]) -> [__m512; T] {
    // SAFETY: forwarded.
    unsafe {
        let mut floats = [_mm512_setzero_ps(); T];
        for (f, s) in floats.iter_mut().zip(s) {
            *f = _mm512_cvtepi32_ps(*s);
        }
        floats
    }
}

/// A Q4_K or Q5_K super-block's `Σ_j sc_j·Σ q·a` for the 16 rows and `T` tokens (activation blocks from `first`), as
/// integers (Q4_K) or in floats sub-block after sub-block (Q5_K, whose half sums fit in no 16-bit word), `sm` its
/// [`k4_scales`].
///
/// # Safety
/// As for [`wide`]; `blk` points at super-block `first / 8` of format `F`.
#[inline(always)]
// `j` also picks the lines and the activation block; the loop's bound stays hidden (`rolled`).
#[allow(clippy::needless_range_loop)]
unsafe fn k4_sums<const T: usize, const F: u8>(
    blk: *const u8,
    sm: &[__m128i; 16],
    first: usize,
    o: Operands,
) -> [__m512; T] {
    let Operands { a, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        if F == Q4_K {
            // Each half's sum fits in its low 16-bit word (`|Σ q·a| ≤ 16 · 15 · 127`, the high word 0 or -1 against
            // a 0 high word of the scale's lane): one `vpdpwssds` per half scales it into the super-block's integer
            // sum, and the two halves are two chains of 4 `vpdpbusd` per token instead of one of 8.
            let mut s = [_mm512_setzero_si512(); T];
            for j in 0..rolled(SUBS) {
                let [half0, half1] = half_sums::<T>(None, |g| k4_values512::<F>(blk, j, g), a, blocks, first + j);
                let w = _mm512_cvtepu8_epi32(sm[j]);
                for ((s, h0), h1) in s.iter_mut().zip(&half0).zip(&half1) {
                    *s = _mm512_dpwssds_epi32(_mm512_dpwssds_epi32(*s, *h0, w), *h1, w);
                }
            }
            return floats512(&s);
        }
        let mut s = [_mm512_setzero_ps(); T];
        for j in 0..rolled(SUBS) {
            let b = first + j;
            let mut sum = [_mm512_setzero_si512(); T];
            for g in 0..QK / 4 {
                dots512(&mut sum, k4_values512::<F>(blk, j, g), a, blocks, b, g);
            }
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm[j]));
            for (s, sum) in s.iter_mut().zip(&sum) {
                *s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*sum), sc, *s);
            }
        }
        s
    }
}

/// A super-block's `Σ m·Σ a` for the 16 rows and `T` tokens, as integers: Q4_K's and Q5_K's minimums per
/// sub-block against `Acts`' pairs of sub-block sums, Q2_K's per half against its pairs of half sums, each pair of
/// minimums as the two 16-bit words of a row's lane of one `vpdpwssds` (`sm`: Q4_K's and Q5_K's [`k4_scales`]).
///
/// # Safety
/// As for [`wide`]; `blk` points at super-block `first / 8` of format `F` (Q2_K, Q4_K or Q5_K).
#[inline(always)]
unsafe fn mins512<const T: usize, const F: u8>(
    blk: *const u8,
    sm: &[__m128i; 16],
    first: usize,
    o: Operands,
) -> [__m512i; T] {
    let Operands { pairs, sub_pairs, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        let mut m = [_mm512_setzero_si512(); T];
        let (count, step, sums) = if F == Q2_K { (SUBS, 1, pairs) } else { (SUBS / 2, 2, sub_pairs) };
        for p in 0..rolled(count) {
            let [lo, hi] =
                if F == Q2_K { q2k_min_pairs(blk, p) } else { interleave_rows(sm[8 + 2 * p], sm[9 + 2 * p]) };
            let words = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
            for (t, m) in m.iter_mut().enumerate() {
                *m = _mm512_dpwssds_epi32(*m, words, _mm512_set1_epi32(*sums.add(t * blocks + first + step * p)));
            }
        }
        m
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

/// A Q3_K super-block's 16 half scales of the 16 rows (signed, [`half_scales`]), each row's twice in a row: half
/// `k`'s 32 bytes at `32·k`, which widen (`vpmovsxbw`) to the lanes one `vpdpwssds` scales its sums by (the scale in
/// both 16-bit words, `acts::q3k_start`). Made 64 bytes at a time, 4 halves per register: per half, its own
/// 6-bit extraction took 12 instructions, about a fifth of the 512-bit tile's.
///
/// # Safety
/// AVX-512 F/BW; `blk` points at a Q3_K super-block.
#[inline(always)]
unsafe fn q3k_scale_pairs(blk: *const u8) -> [__m512i; 8] {
    // SAFETY (whole body): the fields lie inside the super-block.
    unsafe {
        let field = |n: usize| _mm512_loadu_si512(blk.add(scales_at(Q3_K) + n * ROWS) as *const __m512i);
        let (l0, l1, l2) = (field(0), field(4), field(8));
        let (nibble, top) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
        // 128-bit lanes of `lo` and `hi` (rows 0..8 and 8..16 of a half, each byte twice) taken in half order.
        let first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        let second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        let mut out = [_mm512_setzero_si512(); 8];
        for (g, out) in out.chunks_exact_mut(2).enumerate() {
            // Halves 4g..4g + 4: low 4 bits from bytes k % 8 (nibble k / 8), top 2 from byte 8 + k % 4 (bits 2g).
            let low = match g {
                0 => l0,
                1 => l1,
                2 => _mm512_srli_epi16::<4>(l0),
                _ => _mm512_srli_epi16::<4>(l1),
            };
            let high = match g {
                0 => _mm512_slli_epi16::<4>(l2),
                1 => _mm512_slli_epi16::<2>(l2),
                2 => l2,
                _ => _mm512_srli_epi16::<2>(l2),
            };
            let sc = _mm512_or_si512(_mm512_and_si512(low, nibble), _mm512_and_si512(high, top));
            let sc = _mm512_sub_epi8(sc, _mm512_set1_epi8(32));
            let (lo, hi) = (_mm512_unpacklo_epi8(sc, sc), _mm512_unpackhi_epi8(sc, sc));
            out[0] = _mm512_permutex2var_epi64(lo, first, hi);
            out[1] = _mm512_permutex2var_epi64(lo, second, hi);
        }
        out
    }
}

/// A Q2_K or Q3_K super-block's `Σ sc·Σ q·a` for the 16 rows and `T` tokens (activation blocks from `first`), as
/// integers: each half's `vpdpbusd` sum stays in the low 16-bit word of its register (Q2_K's `Σ q·a` at most
/// 16 · 3 · 127 in magnitude, its high word 0 or -1 against a 0 high word of the scale's lane; Q3_K's, of the stored
/// `q + 4`, started at `acts::q3k_start`, against its scale in both words: [`q3k_scale_pairs`]), so one
/// `vpdpwssds` per half scales it and adds it to the super-block's sum. The starts are broadcast from memory (no port
/// that computes).
///
/// # Safety
/// As for [`wide`]; `blk` points at super-block `first / 8` of format `F`.
#[inline(always)]
unsafe fn k2_sums<const T: usize, const F: u8, const GFNI: bool>(
    blk: *const u8,
    first: usize,
    o: Operands,
) -> [__m512; T] {
    // SAFETY (whole body): the caller's ranges; the fields lie inside the super-block.
    unsafe {
        let mut s = [_mm512_setzero_si512(); T];
        let scale_pairs = if F == Q3_K { q3k_scale_pairs(blk) } else { [_mm512_setzero_si512(); 8] };
        if GFNI && F == Q3_K {
            // Sub-blocks 0 and 7 shift their high bits first (`k2_picks`), each in a body of its own: a choice
            // per group in one body made LLVM spill most registers (the tile ran 0.30 ns per block and token).
            k2_sub_block::<T, F, GFNI, SHIFT_LEFT>(blk, 0, first, o, &scale_pairs, &mut s);
            for j in 1..1 + rolled(SUBS - 2) {
                k2_sub_block::<T, F, GFNI, 0>(blk, j, first, o, &scale_pairs, &mut s);
            }
            k2_sub_block::<T, F, GFNI, SHIFT_RIGHT>(blk, SUBS - 1, first, o, &scale_pairs, &mut s);
        } else {
            for j in 0..rolled(SUBS) {
                k2_sub_block::<T, F, GFNI, 0>(blk, j, first, o, &scale_pairs, &mut s);
            }
        }
        floats512(&s)
    }
}

/// [`k2_values_gfni`]'s shift of the high-bit line: none, left by 2 (sub-block 0) or right by 2 (sub-block 7).
const SHIFT_LEFT: u8 = 1;
const SHIFT_RIGHT: u8 = 2;

/// Sub-block `j` of [`k2_sums`] into `s` (Q3_K's half scales in `scale_pairs`).
///
/// # Safety
/// As for [`k2_sums`].
#[inline(always)]
unsafe fn k2_sub_block<const T: usize, const F: u8, const GFNI: bool, const SHIFT: u8>(
    blk: *const u8,
    j: usize,
    first: usize,
    o: Operands,
    scale_pairs: &[__m512i; 8],
    s: &mut [__m512i; T],
) {
    let Operands { a, q3k_starts, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges; the fields lie inside the super-block.
    unsafe {
        let b = first + j;
        let zeros = [_mm512_setzero_si512(); 2];
        let counts = if GFNI { zeros } else { k2_counts(j) };
        let picks = if GFNI { k2_picks::<F>(j) } else { zeros };
        let starts = if F == Q3_K { Some(q3k_starts) } else { None };
        let values = |g: usize| {
            if GFNI { k2_values_gfni::<F, SHIFT>(blk, j, g, &picks) } else { k2_values512::<F>(blk, j, g, &counts) }
        };
        let [half0, half1] = half_sums::<T>(starts, values, a, blocks, b);
        let words = |k: usize| {
            if F == Q3_K {
                _mm512_cvtepi8_epi16(_mm256_loadu_si256((scale_pairs.as_ptr() as *const __m256i).add(k)))
            } else {
                _mm512_cvtepi8_epi32(half_scales::<F>(blk, k))
            }
        };
        let (w0, w1) = (words(2 * j), words(2 * j + 1));
        for ((s, h0), h1) in s.iter_mut().zip(&half0).zip(&half1) {
            // The saturating form, which never saturates here (every sum stays far inside 32 bits): LLVM splits
            // the plain `vpdpwssd` into `madd` + `add` to shorten the chain, at one more instruction.
            *s = _mm512_dpwssds_epi32(_mm512_dpwssds_epi32(*s, *h0, w0), *h1, w1);
        }
    }
}

/// A Q6_K super-block's `Σ sc·Σ q·a` for the 16 rows and `T` tokens (activation blocks from `first`), in floats half
/// after half: each half's `vpdpbusd` sum, started from memory at `-32 · Σ a` of its activations (the stored
/// values' bias), converted and multiplied by its scale in one `fma` (the products are exact: `|Σ q·a| ≤ 16·32·128`,
/// `|sc| ≤ 128`), where a `mullo` would cost two instructions.
///
/// # Safety
/// As for [`wide`]; `blk` points at Q6_K super-block `first / 8`.
#[inline(always)]
unsafe fn q6k_sums<const T: usize>(blk: *const u8, first: usize, o: Operands) -> [__m512; T] {
    let Operands { a, q6k_starts, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges; the fields lie inside the super-block.
    unsafe {
        let mut s = [_mm512_setzero_ps(); T];
        for j in 0..rolled(SUBS) {
            let b = first + j;
            let counts = q6k_counts(j);
            let [half0, half1] = half_sums::<T>(Some(q6k_starts), |g| q6k_values512(blk, j, g, &counts), a, blocks, b);
            let scale = |k: usize| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half_scales::<Q6_K>(blk, k)));
            let (sc0, sc1) = (scale(2 * j), scale(2 * j + 1));
            for ((s, h0), h1) in s.iter_mut().zip(&half0).zip(&half1) {
                *s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*h1), sc1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(*h0), sc0, *s));
            }
        }
        s
    }
}
