//! The x86 tiles of the K-quants in the interleaved layout ([`super::kquant`]) at each instruction-set level:
//! `x86`'s tiles with a super-block's eight 32-element sub-blocks, each against its own activation block.
//! The shared layout helpers are here; the 512-bit tile in [`tiles512`], the 256-bit ones in [`tiles256`].

use super::kquant::{HIGH_LINE, Q3K_HIGH_LINE, scales_at};
use super::{Q2_K, Q6_K, ROWS};
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

mod tiles256;
mod tiles512;

pub(super) use tiles256::super_block_halves;
pub(super) use tiles512::wide;
