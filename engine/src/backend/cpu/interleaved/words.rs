//! Q8_0 against many tokens at the AVX2 level, as 16-bit words. Without VNNI a 4-byte group of 8 rows costs each
//! token three instructions on the two ports that multiply (a sign move, `maddubs`, `madd`: Q8_0's values leave
//! `maddubs` no room for an offset, see `x86::dots256`). Widened to 16-bit words once per row group, two columns
//! of 8 rows take one `madd` and one add per token: per block and 8 rows 19 multiplying instructions instead of 29.
//! The widening costs about a token's work per row group, so the driver takes this path from [`MIN_TOKENS`]
//! tokens (prefill), each row group then against every token. The sums are the same integers and the float steps
//! the same as the other levels': the same bits.

use super::x86::store256;
use super::{Q8_0, ROWS, block_bytes, values_at};
use crate::backend::cpu::simd::Q8Block;
use crate::quant::QK;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Tokens from which the driver widens (below, batched decode, the widening would cost more than it saves).
pub(super) const MIN_TOKENS: usize = 16;

/// 16-bit words one row group of `blocks` blocks widens to: per block, per half of 8 rows, per pair of columns
/// `(2p, 2p + 1)`, the 8 rows' two words, row by row.
pub(super) fn group_words(blocks: usize) -> usize {
    blocks * ROWS * QK
}

/// Widens the row group at `w` (`blocks` Q8_0 blocks of the interleaved layout) into `words`
/// ([`group_words`] of them).
///
/// # Safety
/// AVX2; `w` points at `blocks` blocks.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn widen(w: *const u8, blocks: usize, words: &mut [MaybeUninit<i16>]) {
    assert!(words.len() >= group_words(blocks), "a row group's words");
    // A half's 32 bytes are 8 rows' 4 values: the first two of each row (its pair 2g) to the 8 low bytes of each
    // 128-bit lane, the last two (pair 2g + 1) to the high ones, then the lanes' low halves together.
    let pairs = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let flip = _mm256_set1_epi8(i8::MIN);
    // SAFETY (whole body): the caller's blocks; `words` holds the group (asserted).
    unsafe {
        for b in 0..blocks {
            let v = w.add(b * block_bytes(Q8_0) + values_at(Q8_0));
            let dst = words.as_mut_ptr().cast::<i16>().add(b * ROWS * QK);
            for g in 0..QK / 4 {
                for h in 0..2 {
                    // The stored `w + 128`, back to signed.
                    let x = _mm256_xor_si256(_mm256_loadu_si256(v.add(g * 4 * ROWS + 32 * h) as *const __m256i), flip);
                    let x = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(x, pairs));
                    let at = |p: usize| dst.add((h * QK / 2 + p) * 16) as *mut __m256i;
                    _mm256_storeu_si256(at(2 * g), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)));
                    _mm256_storeu_si256(at(2 * g + 1), _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(x)));
                }
            }
        }
    }
}

/// Prefetches into the second-level cache the `part`-th of `parts` shares of `next`, the row group after the one
/// being tiled: [`widen`] reads each group from memory once, and the tiles between leave the memory idle for
/// far longer than a group takes to arrive (the widening waited on it: ~5 % of an AVX2-level Q8_0 prefill).
#[inline(always)]
pub(super) fn prefetch_part(next: &[u8], part: usize, parts: usize) {
    let lines = next.len().div_ceil(64);
    let per_part = lines.div_ceil(parts.max(1));
    for line in part * per_part..((part + 1) * per_part).min(lines) {
        // SAFETY: a prefetch reads nothing and never faults; the address is inside `next` besides.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(next.as_ptr().wrapping_add(64 * line) as *const i8) };
    }
}

/// One tile's operands: the row group at `w` (its scales) widened at `words`, against tokens whose blocks are at
/// `a` and whose values, as 16-bit words, at `aw` (`QK` per block), into `out + t·stride + r`.
#[derive(Clone, Copy)]
pub(super) struct Operands {
    pub w: *const u8,
    pub words: *const i16,
    pub a: *const Q8Block,
    pub aw: *const i16,
    pub blocks: usize,
    pub out: *mut f32,
    pub stride: usize,
    pub rows: usize,
}

/// Tokens per tile: both halves' sums and float accumulators for 3 tokens take 12 of the 16 registers, the two
/// halves' words and a broadcast the rest. Each broadcast pair then feeds two `madd`s, which Zen 4 issues faster
/// than one half's 4 tokens (one `madd` per broadcast): ~1.6 `madd`/`add` pairs a cycle against ~1.4 in a loop of
/// those instructions alone; SmolLM2's Q8_0 prefill at the AVX2 level +7 %.
pub(super) const TOKENS: usize = 3;

/// The row group against `tokens` (1..=[`TOKENS`]) tokens.
///
/// # Safety
/// AVX2, FMA and F16C; `o.w` points at `o.blocks` blocks and `o.words` at their [`widen`]ed words; `o.a` and
/// `o.aw` at `tokens` rows of `o.blocks` blocks; `o.out + t·o.stride + r` is writable for `t < tokens`,
/// `r < o.rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile(tokens: usize, o: Operands) {
    // SAFETY: forwarded; this function's features are the body's.
    unsafe {
        match tokens {
            3 => body::<3>(o),
            2 => body::<2>(o),
            _ => body::<1>(o),
        }
    }
}

/// [`tile`] for `T` tokens: per block, each pair of columns' words (both halves) against each token's pair,
/// broadcast, summed as integers; then `acc = fma(Σ, d_w·d_a, acc)` per half as every level does.
///
/// # Safety
/// As for [`tile`], with `T` tokens.
#[inline(always)]
unsafe fn body<const T: usize>(o: Operands) {
    let Operands { w, words, a, aw, blocks, out, stride, rows } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); T]; 2];
        for b in 0..blocks {
            let wb = words.add(b * ROWS * QK);
            let mut sum = [[_mm256_setzero_si256(); T]; 2];
            for p in 0..QK / 2 {
                let wv = [0, 1].map(|h| _mm256_loadu_si256(wb.add(h * ROWS * QK / 2 + 16 * p) as *const __m256i));
                for t in 0..T {
                    let pair = (aw.add((t * blocks + b) * QK + 2 * p) as *const i32).read_unaligned();
                    let pair = _mm256_set1_epi32(pair);
                    for (sum, wv) in sum.iter_mut().zip(wv) {
                        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(wv, pair));
                    }
                }
            }
            for (h, (acc, sum)) in acc.iter_mut().zip(sum).enumerate() {
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(w.add(b * block_bytes(Q8_0) + 16 * h) as *const __m128i));
                for (t, (acc, sum)) in acc.iter_mut().zip(sum).enumerate() {
                    let d = (*a.add(t * blocks + b)).d;
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(d)), *acc);
                }
            }
        }
        store256(&acc, out, stride, rows);
    }
}
