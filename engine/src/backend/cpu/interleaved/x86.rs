//! The x86 tiles of the interleaved layout at each instruction-set level (see the parent module).

use super::{
    Format, Q2_K, Q3_K, Q8_0, ROWS, TOKENS_256, TOKENS_512, bias, block_bytes, elems, five, has_min, high_bits_at,
    is_k, values_at,
};
use crate::backend::cpu::simd::x86::{AVX_VNNI, AVX2, AVX512_VNNI};
use crate::backend::cpu::simd::{Isa, Q8Block};
use crate::quant::QK;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// One tile's operands: `rows` (≤ 16) rows of the group at `w` (`blocks` blocks of 32 columns) against tokens
/// at `a` with their sums at `sums`, their halves' at `pairs`, `q3k_starts` and `q6k_starts`, and pairs of
/// their sums at `sub_pairs` (`blocks` each, as `Acts` holds them), into `out + t·stride + r`. For the 5-bit
/// formats at the 256-bit levels `values` may hold the group's values [`expand`]ed to bytes (else null: the tile
/// unpacks them itself).
#[derive(Clone, Copy)]
pub struct Operands {
    pub w: *const u8,
    pub values: *const u8,
    pub a: *const Q8Block,
    pub sums: *const i32,
    pub pairs: *const i32,
    pub sub_pairs: *const i32,
    pub q3k_starts: *const [i32; 2],
    pub q6k_starts: *const [i32; 2],
    pub blocks: usize,
    pub out: *mut f32,
    pub stride: usize,
    pub rows: usize,
}

/// A level's tile for one format: one row group against `tokens` (1..=8) tokens.
pub type Tile = unsafe fn(tokens: usize, o: Operands);

/// The tile of `isa` for format `f` and the tokens it takes at most, `None` for the scalar level; the 512-bit Q2_K and
/// Q3_K tiles that pick values with GFNI where `gfni` (which this CPU must then have).
pub(super) fn tile_with(isa: Isa, f: Format, gfni: bool) -> Option<(Tile, usize)> {
    match isa {
        Isa::Avx512Vnni if gfni && matches!(f, Format::Q2_K | Format::Q3_K) => {
            Some((avx512_gfni::TILES[(f == Format::Q3_K) as usize], TOKENS_512))
        }
        Isa::Scalar => None,
        Isa::Avx2 => Some((avx2::TILES[f as usize], TOKENS_256)),
        Isa::AvxVnni => Some((avx_vnni::TILES[f as usize], TOKENS_256)),
        Isa::Avx512Vnni => Some((avx512_vnni::TILES[f as usize], TOKENS_512)),
    }
}

macro_rules! level {
    ($module:ident, $level:expr, $features:literal) => {
        mod $module {
            use super::*;

            /// This level's tile of each [`Format`], in its order.
            pub const TILES: [Tile; 10] = [
                tile::<0>, tile::<1>, tile::<2>, tile::<3>, tile::<4>, tile::<5>, tile::<6>, tile::<7>, tile::<8>,
                tile::<9>,
            ];

            /// [`Tile`] at this level for format `F`.
            ///
            /// # Safety
            /// The CPU has this level's features; `o.w` points at a row group of `o.blocks` blocks of `F`,
            /// `o.a` and `o.sums` at `tokens` rows of `o.blocks` each; `o.out + t·o.stride + r` is writable
            /// for `t < tokens`, `r < o.rows`.
            #[target_feature(enable = $features)]
            unsafe fn tile<const F: u8>(tokens: usize, o: Operands) {
                // SAFETY: forwarded; this function's features are the level's.
                unsafe {
                    match tokens {
                        8 => body::<{ $level }, 8, F>(o),
                        7 => body::<{ $level }, 7, F>(o),
                        6 => body::<{ $level }, 6, F>(o),
                        5 => body::<{ $level }, 5, F>(o),
                        4 => body::<{ $level }, 4, F>(o),
                        3 => body::<{ $level }, 3, F>(o),
                        2 => body::<{ $level }, 2, F>(o),
                        _ => body::<{ $level }, 1, F>(o),
                    }
                }
            }
        }
    };
}
crate::backend::cpu::isa::for_each_level!(level);

/// The 512-bit Q2_K and Q3_K tiles with GFNI (Ice Lake and later, Zen 4; not Cascade Lake's AVX-512 VNNI).
mod avx512_gfni {
    use super::*;

    /// Q2_K's tile, then Q3_K's.
    pub const TILES: [Tile; 2] = [tile::<Q2_K>, tile::<Q3_K>];

    /// [`Tile`] for format `F` (Q2_K or Q3_K) at the 512-bit level with GFNI.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL, VNNI and GFNI; otherwise as for the levels' tiles.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,gfni")]
    unsafe fn tile<const F: u8>(tokens: usize, o: Operands) {
        use super::super::kquant_x86::wide;
        // SAFETY: forwarded; this function's features are what `wide` with GFNI needs.
        unsafe {
            match tokens {
                8 => wide::<8, F, true>(o),
                7 => wide::<7, F, true>(o),
                6 => wide::<6, F, true>(o),
                5 => wide::<5, F, true>(o),
                4 => wide::<4, F, true>(o),
                3 => wide::<3, F, true>(o),
                2 => wide::<2, F, true>(o),
                _ => wide::<1, F, true>(o),
            }
        }
    }
}

/// Token `t`'s 4 activation bytes of group `g` in block `b`, as one integer.
///
/// # Safety
/// `a` points at `t + 1` rows of `blocks` blocks.
#[inline(always)]
pub(super) unsafe fn four(a: *const Q8Block, blocks: usize, t: usize, b: usize, g: usize) -> i32 {
    // SAFETY: forwarded; a block's 32 bytes hold 8 groups.
    unsafe { ((*a.add(t * blocks + b)).qs.as_ptr().add(4 * g) as *const i32).read_unaligned() }
}

/// The tile at level `V` for `T` tokens: the 16 rows in 512-bit registers, or in two 256-bit halves.
///
/// # Safety
/// As for [`Tile`], with `T` tokens.
#[inline(always)]
unsafe fn body<const V: u8, const T: usize, const F: u8>(o: Operands) {
    // SAFETY: forwarded.
    unsafe {
        if V == AVX512_VNNI && is_k(F) {
            super::kquant_x86::wide::<T, F, false>(o);
        } else if V == AVX512_VNNI {
            wide::<T, F>(o);
        } else {
            halves::<V, T, F>(o);
        }
    }
}

/// 16 rows in one 512-bit register per token: per 4-byte group of the block one register of values (loaded,
/// or two from a line of nibbles, the fifth bits added under a mask) and one `vpdpbusd` per token, its 4
/// activation bytes broadcast from memory, each sum starting from `bias · Σ a`.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI; otherwise as for [`Tile`].
#[inline(always)]
unsafe fn wide<const T: usize, const F: u8>(o: Operands) {
    let Operands { w, a, sums, blocks, out, stride, rows, .. } = o;
    // SAFETY (whole body): the caller's ranges; a block is `block_bytes(F)` bytes laid out as it says.
    unsafe {
        let low = _mm512_set1_epi8(0x0f);
        let fifth = _mm512_set1_epi8(0x10);
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..blocks {
            let blk = w.add(b * block_bytes(F));
            prefetch::<F>(blk);
            let mut sum = [_mm512_setzero_si512(); T];
            if bias(F) != 0 {
                for (t, s) in sum.iter_mut().enumerate() {
                    *s = _mm512_set1_epi32(bias(F) * *sums.add(t * blocks + b));
                }
            }
            let v = blk.add(values_at(F));
            if F == Q8_0 {
                for g in 0..QK / 4 {
                    dots512(&mut sum, _mm512_loadu_si512(v.add(g * 4 * ROWS) as *const __m512i), a, blocks, b, g);
                }
            } else {
                for j in 0..QK / 8 {
                    let line = _mm512_loadu_si512(v.add(j * 4 * ROWS) as *const __m512i);
                    let mut lo = _mm512_and_si512(line, low);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(line), low);
                    if five(F) {
                        let bits = blk.add(high_bits_at(F)) as *const u64;
                        lo = _mm512_mask_add_epi8(lo, bits.add(j).read_unaligned(), lo, fifth);
                        hi = _mm512_mask_add_epi8(hi, bits.add(j + 4).read_unaligned(), hi, fifth);
                    }
                    dots512(&mut sum, lo, a, blocks, b, j);
                    dots512(&mut sum, hi, a, blocks, b, j + 4);
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mw = if has_min(F) {
                _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * ROWS) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            for (t, acc) in acc.iter_mut().enumerate() {
                let ab = &*a.add(t * blocks + b);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(dw, _mm512_set1_ps(ab.d)), *acc);
                if has_min(F) {
                    *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(ab.s), *acc);
                }
            }
        }
        store512(&acc, out, stride, rows);
    }
}

/// The 16 rows in two 256-bit halves of 8, both within each block (with one token, a half at a time over the
/// whole group would read the weights from memory in the first half's pass and compute the second's after it,
/// 12 % slower in batch-1 decode): `vpdpbusd` with AVX-VNNI; without it `maddubs` + `madd` (Q8_0's weights'
/// magnitudes against the activations under their signs, as its `+128` values would saturate `maddubs`' 16-bit
/// pairs; the 4/5-bit values cannot), the same integers.
///
/// # Safety
/// Level `V`'s features; otherwise as for [`Tile`].
#[inline(always)]
unsafe fn halves<const V: u8, const T: usize, const F: u8>(o: Operands) {
    let Operands { w, blocks, out, stride, rows, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); T]; 2];
        for b in 0..blocks / (elems(F) / QK) {
            prefetch::<F>(w.add(b * block_bytes(F)));
            if is_k(F) {
                super::kquant_x86::super_block_halves::<V, T, F>(w.add(b * block_bytes(F)), b, o, &mut acc);
                continue;
            }
            for (h, acc) in acc.iter_mut().enumerate() {
                if five(F) && !o.values.is_null() {
                    half_block::<V, T, F, true>(h, w.add(b * block_bytes(F)), b, o, acc);
                } else {
                    half_block::<V, T, F, false>(h, w.add(b * block_bytes(F)), b, o, acc);
                }
            }
        }
        store256(&acc, out, stride, rows);
    }
}

/// Half `h` (rows `8h..8h + 8`) of block `b` at `blk` into its accumulators; its values from `o.values` where
/// `EXPANDED`.
///
/// # Safety
/// As for [`halves`]; half h's scales, minimums and values are the second 16 or 32 bytes of each, its fifth
/// bits the second 4 bytes of each group's 8.
#[inline(always)]
unsafe fn half_block<const V: u8, const T: usize, const F: u8, const EXPANDED: bool>(
    h: usize,
    blk: *const u8,
    b: usize,
    o: Operands,
    acc: &mut [__m256; T],
) {
    let Operands { a, sums, blocks, .. } = o;
    // SAFETY (whole body): the caller's ranges.
    unsafe {
        let mut sum = [_mm256_setzero_si256(); T];
        // Q8_0 without VNNI sums the signed weights directly, from zero.
        if bias(F) != 0 && !(V == AVX2 && F == Q8_0) {
            for (t, s) in sum.iter_mut().enumerate() {
                *s = _mm256_set1_epi32(bias(F) * *sums.add(t * blocks + b));
            }
        }
        let v = blk.add(values_at(F) + 32 * h);
        if F == Q8_0 {
            for g in 0..QK / 4 {
                let wg = _mm256_loadu_si256(v.add(g * 4 * ROWS) as *const __m256i);
                dots256::<V, T, F>(&mut sum, wg, a, blocks, b, g);
            }
        } else {
            for j in 0..QK / 8 {
                let lohi = if EXPANDED {
                    let at = o.values.add(expanded_at(b, h, j)) as *const __m256i;
                    [_mm256_loadu_si256(at), _mm256_loadu_si256(at.add(4))]
                } else {
                    unpack::<F>(blk, h, j)
                };
                dots256_pair::<V, T, F>(&mut sum, lohi, [j, j + 4], a, blocks, b);
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
        let mw = if has_min(F) {
            _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * ROWS + 16 * h) as *const __m128i))
        } else {
            _mm256_setzero_ps()
        };
        for (t, acc) in acc.iter_mut().enumerate() {
            let ab = &*a.add(t * blocks + b);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(dw, _mm256_set1_ps(ab.d)), *acc);
            if has_min(F) {
                *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(ab.s), *acc);
            }
        }
    }
}

/// Half `h`'s values of group lines `j` and `j + 4` of the 4/5-bit block at `blk` (each line's low nibbles the
/// first, its high ones the second), as bytes.
///
/// # Safety
/// AVX2; `blk` points at a block of format `F`.
#[inline(always)]
unsafe fn unpack<const F: u8>(blk: *const u8, h: usize, j: usize) -> [__m256i; 2] {
    // SAFETY: forwarded; a block holds its values and fifth bits where `values_at` and `high_bits_at` say.
    unsafe {
        let low = _mm256_set1_epi8(0x0f);
        let line = _mm256_loadu_si256(blk.add(values_at(F) + 32 * h + j * 4 * ROWS) as *const __m256i);
        let mut lo = _mm256_and_si256(line, low);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(line), low);
        if five(F) {
            let bits = blk.add(high_bits_at(F) + 4 * h);
            lo = _mm256_or_si256(lo, fifth256(bits.add(8 * j)));
            hi = _mm256_or_si256(hi, fifth256(bits.add(8 * (j + 4))));
        }
        [lo, hi]
    }
}

/// Where [`expand`] puts the 32 bytes of block `b`'s half `h`, group line `j` (0..4; its high nibbles' group
/// 128 bytes on).
const fn expanded_at(b: usize, h: usize, j: usize) -> usize {
    ((2 * b + h) * 8 + j) * 32
}

/// Bytes [`expand`] writes for a row group of `blocks` blocks.
pub(super) const fn expanded_len(blocks: usize) -> usize {
    blocks * ROWS * QK
}

/// The row group at `w` (`blocks` blocks of the 5-bit format `f`) with its values unpacked to bytes into `out`,
/// once for many tokens: unpacking two 5-bit groups (their fifth bits spread over the bytes) takes ~17
/// instructions against ~28 for their products with 4 tokens, and prefill's tiles would repeat it every 4 tokens.
///
/// # Safety
/// AVX2; `w` points at `blocks` blocks of `f`, which is Q5_0 or Q5_1.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn expand(f: Format, w: *const u8, blocks: usize, out: &mut [MaybeUninit<u8>]) {
    assert!(out.len() >= expanded_len(blocks) && five(f as u8), "expanded values");
    // SAFETY: forwarded; `out` holds them (asserted).
    unsafe {
        match f {
            Format::Q5_0 => expand_f::<{ Format::Q5_0 as u8 }>(w, blocks, out),
            _ => expand_f::<{ Format::Q5_1 as u8 }>(w, blocks, out),
        }
    }
}

/// [`expand`] for format `F`.
///
/// # Safety
/// As for [`expand`].
#[inline(always)]
unsafe fn expand_f<const F: u8>(w: *const u8, blocks: usize, out: &mut [MaybeUninit<u8>]) {
    // SAFETY (whole body): the caller's blocks; `out` holds `expanded_len(blocks)` bytes.
    unsafe {
        for b in 0..blocks {
            for h in 0..2 {
                for j in 0..QK / 8 {
                    let [lo, hi] = unpack::<F>(w.add(b * block_bytes(F)), h, j);
                    let at = out.as_mut_ptr().add(expanded_at(b, h, j)).cast::<__m256i>();
                    _mm256_storeu_si256(at, lo);
                    _mm256_storeu_si256(at.add(4), hi);
                }
            }
        }
    }
}

/// Each token's `vpdpbusd` of the 16 rows' values `wg` (group `g` of block `b`) with its 4 activation bytes.
///
/// # Safety
/// AVX-512 VNNI; `a` points at `T` rows of `blocks` blocks.
#[inline(always)]
pub(super) unsafe fn dots512<const T: usize>(
    sum: &mut [__m512i; T],
    wg: __m512i,
    a: *const Q8Block,
    blocks: usize,
    b: usize,
    g: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        for (t, s) in sum.iter_mut().enumerate() {
            *s = _mm512_dpbusd_epi32(*s, wg, _mm512_set1_epi32(four(a, blocks, t, b, g)));
        }
    }
}

/// [`dots512`] for 8 rows at level `V`: Q8_0 without VNNI takes its weights' magnitudes (`wg` holds `w + 128`)
/// against the activations under their signs.
///
/// # Safety
/// Level `V`'s features; `a` points at `T` rows of `blocks` blocks.
#[inline(always)]
pub(super) unsafe fn dots256<const V: u8, const T: usize, const F: u8>(
    sum: &mut [__m256i; T],
    wg: __m256i,
    a: *const Q8Block,
    blocks: usize,
    b: usize,
    g: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        if V == AVX2 && F == Q8_0 {
            let signed = _mm256_xor_si256(wg, _mm256_set1_epi8(i8::MIN));
            let magnitude = _mm256_abs_epi8(signed);
            for (t, s) in sum.iter_mut().enumerate() {
                let av = _mm256_sign_epi8(_mm256_set1_epi32(four(a, blocks, t, b, g)), signed);
                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, av), ones));
            }
            return;
        }
        for (t, s) in sum.iter_mut().enumerate() {
            let av = _mm256_set1_epi32(four(a, blocks, t, b, g));
            *s = match V {
                AVX_VNNI => _mm256_dpbusd_avx_epi32(*s, wg, av),
                AVX512_VNNI => _mm256_dpbusd_epi32(*s, wg, av),
                _ => _mm256_add_epi32(*s, _mm256_madd_epi16(_mm256_maddubs_epi16(wg, av), ones)),
            };
        }
    }
}

/// [`dots256`] of two groups' values (`w[i]` of group `g[i]`), each below 64, so that two `maddubs` pairs add up
/// within 16 bits (≤ 2 · 2 · 63 · 128): without VNNI their products are summed as 16-bit integers before one `madd`
/// instead of a `madd` each (a quarter fewer instructions on the ports that multiply; the same integers).
///
/// # Safety
/// Level `V`'s features; `a` points at `T` rows of `blocks` blocks.
#[inline(always)]
pub(super) unsafe fn dots256_pair<const V: u8, const T: usize, const F: u8>(
    sum: &mut [__m256i; T],
    w: [__m256i; 2],
    g: [usize; 2],
    a: *const Q8Block,
    blocks: usize,
    b: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        if V != AVX2 || F == Q8_0 {
            dots256::<V, T, F>(sum, w[0], a, blocks, b, g[0]);
            dots256::<V, T, F>(sum, w[1], a, blocks, b, g[1]);
            return;
        }
        maddubs_pair(sum, w, g, _mm256_set1_epi16(1), a, blocks, b);
    }
}

/// Without VNNI, each token's `maddubs` products of two groups' values (`w[i]` of group `g[i]`, each below 64)
/// summed as 16-bit integers, then one `madd` against `by` (ones, or a row's scale in both words) into `sum`.
///
/// # Safety
/// AVX2; `a` points at `T` rows of `blocks` blocks.
#[inline(always)]
pub(super) unsafe fn maddubs_pair<const T: usize>(
    sum: &mut [__m256i; T],
    w: [__m256i; 2],
    g: [usize; 2],
    by: __m256i,
    a: *const Q8Block,
    blocks: usize,
    b: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        for (t, s) in sum.iter_mut().enumerate() {
            let p0 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(four(a, blocks, t, b, g[0])));
            let p1 = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(four(a, blocks, t, b, g[1])));
            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), by));
        }
    }
}

/// A group's fifth bits for 8 rows (the 4 bytes at `bits`) as `0x10` in each value byte whose bit is set: byte
/// k takes bit k, from byte k / 8 of the word under the mask `1 << k % 8`.
///
/// # Safety
/// AVX2; `bits` points at 4 readable bytes.
#[inline(always)]
unsafe fn fifth256(bits: *const u8) -> __m256i {
    // SAFETY: forwarded.
    unsafe {
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let word = _mm256_set1_epi32((bits as *const i32).read_unaligned());
        let set = _mm256_and_si256(_mm256_shuffle_epi8(word, spread), select);
        _mm256_and_si256(_mm256_cmpeq_epi8(set, select), _mm256_set1_epi8(0x10))
    }
}

/// How far ahead of the block it reads a tile prefetches (into the next row groups: prefetches never fault).
const PREFETCH_BYTES: usize = 4096;

/// Prefetches the cache lines [`PREFETCH_BYTES`] ahead of block `blk`: one-token decode streams every weight from
/// memory once per step.
#[inline(always)]
pub(super) fn prefetch<const F: u8>(blk: *const u8) {
    for line in (0..block_bytes(F)).step_by(64) {
        // SAFETY: a prefetch reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH_BYTES + line) as *const i8) };
    }
}

/// Writes each token's 16 sums (rows past `rows` left alone) to `out + t·stride`.
///
/// # Safety
/// AVX-512 F; `out + t·stride + r` writable for `t < T`, `r < rows`.
#[inline(always)]
pub(super) unsafe fn store512<const T: usize>(acc: &[__m512; T], out: *mut f32, stride: usize, rows: usize) {
    let mask = if rows >= ROWS { 0xffff } else { (1u16 << rows) - 1 };
    for (t, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's range; the mask stops at `rows`.
        unsafe { _mm512_mask_storeu_ps(out.add(t * stride), mask, *acc) };
    }
}

/// [`store512`] for sums in two halves of 8 rows.
///
/// # Safety
/// AVX2; as for [`store512`].
#[inline(always)]
pub(super) unsafe fn store256<const T: usize>(acc: &[[__m256; T]; 2], out: *mut f32, stride: usize, rows: usize) {
    // A whole group with plain stores: Zen 4 takes ~12 cycles for each masked one (a tile's 6 to 8 of them cost
    // the AVX2-level Q8_0 prefill ~2 %).
    if rows >= ROWS {
        for (h, acc) in acc.iter().enumerate() {
            for (t, acc) in acc.iter().enumerate() {
                // SAFETY: the caller's range: 16 rows from `out + t·stride`.
                unsafe { _mm256_storeu_ps(out.add(t * stride + 8 * h), *acc) };
            }
        }
        return;
    }
    for (h, acc) in acc.iter().enumerate() {
        let n = rows.saturating_sub(8 * h).min(8) as i32;
        // SAFETY: AVX2 (the caller's).
        let mask = unsafe { _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) };
        for (t, acc) in acc.iter().enumerate() {
            // SAFETY: the caller's range; the mask stops at `rows`.
            unsafe { _mm256_maskstore_ps(out.add(t * stride + 8 * h), mask, *acc) };
        }
    }
}
