//! Q8_0 weights as the CPU backend keeps them: 16 rows side by side ([`pack`]), so a 4-byte group of 16 rows
//! fills one 512-bit register and one `vpdpbusd` against a token's 4 activation bytes, broadcast, advances 16
//! rows' sums. A block's 32 products are summed as integers (exact, in any order), then each row accumulates
//! `acc = fma(Σ w·a, d_w·d_a, acc)` block by block: [`scalar`]'s arithmetic, so every level, token count and
//! thread split gives the same bits. The file's layout costs a conversion and a multiply-add per 8 products
//! (float lane sums per block, `qgemm`), as llama.cpp's tinyBLAS does; this one costs them per 512 (16 rows ×
//! 32), which is what lets prefill run at the speed of the 8-bit dot products.

use super::simd::{Isa, Q8Block};
use crate::quant::QK;
use crate::tensor::f16_at;
use crate::{Error, Result};

/// Rows side by side.
pub const ROWS: usize = 16;
/// Bytes of one block of a row group: its 16 rows' f16 scales, then the weights as `[4-byte group][row][4]`,
/// each stored as `w + 128` (unsigned, as `vpdpbusd` takes its first operand).
const BLOCK: usize = 2 * ROWS + ROWS * QK;
/// Where a block's weights start, after the scales.
const QS: usize = 2 * ROWS;
/// A Q8_0 block as the file has it: an f16 scale and 32 signed bytes.
const FILE_BLOCK: usize = 2 + QK;
/// Tokens per tile call: the 512-bit tile keeps 8 sums and 8 accumulators in its 32 registers, the 256-bit ones
/// (16 registers) 4.
const TOKENS_512: usize = 8;
const TOKENS_256: usize = 4;
/// Activation bytes (blocks and their sums) one run of tokens may occupy: half of a 32 KiB L1 data cache.
const L1_ACT_BYTES: usize = 16 * 1024;

/// Bytes of a `rows × cols` Q8_0 matrix repacked ([`pack`]): whole groups of 16 rows.
pub fn packed_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(ROWS) * (cols / QK) * BLOCK
}

/// Repacks `rows` rows of `cols` Q8_0 weights from the file's layout; the last group's missing rows are zeros.
pub fn pack(file: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; packed_len(rows, cols)];
    pack_into(file, rows, cols, &mut out)?;
    Ok(out)
}

/// [`pack`] into `out`, [`packed_len`] bytes.
pub fn pack_into(file: &[u8], rows: usize, cols: usize, out: &mut [u8]) -> Result<()> {
    let blocks = cols / QK;
    if !cols.is_multiple_of(QK) || file.len() != rows * blocks * FILE_BLOCK || out.len() != packed_len(rows, cols) {
        return Err(Error::Shape {
            op: "q8_0 repack",
            reason: format!("{} bytes are not {rows} rows of {cols} Q8_0 weights", file.len()),
        });
    }
    // Missing rows: scale 0, weights 0 (stored as 128).
    for (group, dst) in out.chunks_exact_mut((blocks * BLOCK).max(1)).enumerate() {
        for (b, blk) in dst.chunks_exact_mut(BLOCK).enumerate() {
            blk[QS..].fill(128);
            for i in 0..ROWS.min(rows - group * ROWS) {
                let src = &file[((group * ROWS + i) * blocks + b) * FILE_BLOCK..][..FILE_BLOCK];
                blk[2 * i..2 * i + 2].copy_from_slice(&src[..2]);
                for (g, four) in src[2..].chunks_exact(4).enumerate() {
                    for (d, &s) in blk[QS + g * 4 * ROWS + 4 * i..][..4].iter_mut().zip(four) {
                        *d = s ^ 0x80;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Row `r`'s weights as floats (`cols` of them): the values the file's block decodes to.
pub fn dequantize_row(packed: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    let blocks = cols / QK;
    let group = &packed[(r / ROWS) * blocks * BLOCK..][..blocks * BLOCK];
    let i = r % ROWS;
    for (blk, dst) in group.chunks_exact(BLOCK).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(blk, 2 * i);
        for (l, v) in dst.iter_mut().enumerate() {
            *v = d * f32::from((blk[QS + (l / 4) * 4 * ROWS + 4 * i + l % 4] ^ 0x80) as i8);
        }
    }
}

/// The activations [`rows_by_tokens`] reads: `tokens` rows of 8-bit blocks and, per block, `-128 · Σ a`, where
/// the VNNI tiles start each block's sum to take back the weights' `+128`.
#[derive(Debug)]
pub struct Acts<'a> {
    q: &'a [Q8Block],
    bias: Vec<i32>,
    blocks: usize,
    tokens: usize,
}

impl<'a> Acts<'a> {
    /// `q` holds `tokens` rows of `blocks` blocks, back to back.
    pub fn new(q: &'a [Q8Block], tokens: usize, blocks: usize) -> Self {
        let q = &q[..tokens * blocks];
        let bias = q.iter().map(|b| -128 * b.qs.iter().map(|&v| i32::from(v)).sum::<i32>()).collect();
        Acts { q, bias, blocks, tokens }
    }
}

/// `out[t · stride + r] = w_r · x_t` for the `rows` rows held by the row groups in `w` (whole groups from
/// [`pack`]) and every token `t` of `acts`, with the kernels of `isa`, an instruction set this CPU has.
///
/// # Safety
/// Those output elements must be valid for writes and not accessed by anyone else during the call.
pub unsafe fn rows_by_tokens(isa: Isa, w: &[u8], rows: usize, acts: &Acts<'_>, out: *mut f32, stride: usize) {
    let blocks = acts.blocks;
    let group_bytes = blocks * BLOCK;
    // These bounds are what every raw-pointer access below relies on.
    assert!(
        w.len() == rows.div_ceil(ROWS) * group_bytes && isa.supported() && acts.q.len() == acts.tokens * blocks,
        "q8_0 row-group operands do not match"
    );
    #[cfg(target_arch = "x86_64")]
    if let Some((tile, per_tile)) = x86::tile(isa) {
        let tiles = acts.tokens.div_ceil(per_tile);
        // Token tiles are visited in runs that fit in L1, all row groups per run (see `qgemm::rows_by_tokens`).
        let tile_bytes = per_tile * blocks * (std::mem::size_of::<Q8Block>() + 4);
        let run = (L1_ACT_BYTES / tile_bytes.max(1)).clamp(1, tiles.max(1));
        for t0 in (0..tiles).step_by(run) {
            for (g, wg) in w.chunks_exact(group_bytes.max(1)).enumerate() {
                for tile_index in t0..(t0 + run).min(tiles) {
                    let first = tile_index * per_tile;
                    let tokens = (acts.tokens - first).min(per_tile);
                    // SAFETY: the level was detected; the group holds `blocks` blocks, tokens first..first + tokens
                    // have `blocks` blocks and sums each (asserted above), and the caller vouches for the outputs
                    // (first + t, 16g + r) for r below the group's rows.
                    unsafe {
                        tile(
                            tokens,
                            x86::Operands {
                                w: wg.as_ptr(),
                                a: acts.q[first * blocks..].as_ptr(),
                                bias: acts.bias[first * blocks..].as_ptr(),
                                blocks,
                                out: out.wrapping_add(first * stride + g * ROWS),
                                stride,
                                rows: (rows - g * ROWS).min(ROWS),
                            },
                        )
                    }
                }
            }
        }
        return;
    }
    for (g, wg) in w.chunks_exact(group_bytes.max(1)).enumerate() {
        for t in 0..acts.tokens {
            let sums = scalar(wg, &acts.q[t * blocks..(t + 1) * blocks]);
            for (r, v) in sums.iter().enumerate().take((rows - g * ROWS).min(ROWS)) {
                // SAFETY: the caller vouches for output (t, 16g + r).
                unsafe { *out.add(t * stride + g * ROWS + r) = *v };
            }
        }
    }
}

/// The reference: one row group against one token, row by row.
pub fn scalar(group: &[u8], a: &[Q8Block]) -> [f32; ROWS] {
    let mut acc = [0f32; ROWS];
    for (blk, ab) in group.chunks_exact(BLOCK).zip(a) {
        for (i, acc) in acc.iter_mut().enumerate() {
            let mut isum = 0i32;
            for (l, &x) in ab.qs.iter().enumerate() {
                isum += i32::from((blk[QS + (l / 4) * 4 * ROWS + 4 * i + l % 4] ^ 0x80) as i8) * i32::from(x);
            }
            *acc = (isum as f32).mul_add(f16_at(blk, 2 * i) * ab.d, *acc);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BLOCK, QS, ROWS, TOKENS_256, TOKENS_512};
    use crate::backend::cpu::simd::x86::{AVX_VNNI, AVX2, AVX512_VNNI};
    use crate::backend::cpu::simd::{Isa, Q8Block};
    use crate::quant::QK;
    use std::arch::x86_64::*;

    /// One tile's operands: `rows` (≤ 16) rows of the group at `w` (`blocks` blocks) against tokens at `a` with
    /// their sums at `bias` (`blocks` each), into `out + t·stride + r`.
    #[derive(Clone, Copy)]
    pub struct Operands {
        pub w: *const u8,
        pub a: *const Q8Block,
        pub bias: *const i32,
        pub blocks: usize,
        pub out: *mut f32,
        pub stride: usize,
        pub rows: usize,
    }

    /// A level's tile: one row group against `tokens` (1..=8) tokens.
    pub type Tile = unsafe fn(tokens: usize, o: Operands);

    /// `isa`'s tile and the tokens it takes at most; `None` for the scalar level.
    pub fn tile(isa: Isa) -> Option<(Tile, usize)> {
        match isa {
            Isa::Scalar => None,
            Isa::Avx2 => Some((avx2::tile, TOKENS_256)),
            Isa::AvxVnni => Some((avx_vnni::tile, TOKENS_256)),
            Isa::Avx512Vnni => Some((avx512_vnni::tile, TOKENS_512)),
        }
    }

    macro_rules! level {
        ($module:ident, $level:expr, $features:literal) => {
            mod $module {
                use super::*;

                /// [`Tile`] at this level.
                ///
                /// # Safety
                /// The CPU has this level's features; `o.w` points at a row group of `o.blocks` blocks, `o.a` and
                /// `o.bias` at `tokens` rows of `o.blocks` each; `o.out + t·o.stride + r` is writable for
                /// `t < tokens`, `r < o.rows`.
                #[target_feature(enable = $features)]
                pub unsafe fn tile(tokens: usize, o: Operands) {
                    // SAFETY: forwarded; this function's features are the level's.
                    unsafe {
                        match tokens {
                            8 => body::<{ $level }, 8>(o),
                            7 => body::<{ $level }, 7>(o),
                            6 => body::<{ $level }, 6>(o),
                            5 => body::<{ $level }, 5>(o),
                            4 => body::<{ $level }, 4>(o),
                            3 => body::<{ $level }, 3>(o),
                            2 => body::<{ $level }, 2>(o),
                            _ => body::<{ $level }, 1>(o),
                        }
                    }
                }
            }
        };
    }
    crate::backend::cpu::isa::for_each_level!(level);

    /// Token `t`'s 4 activation bytes of group `g` in block `b`, as one integer.
    ///
    /// # Safety
    /// `a` points at `t + 1` rows of `blocks` blocks.
    #[inline(always)]
    unsafe fn four(a: *const Q8Block, blocks: usize, t: usize, b: usize, g: usize) -> i32 {
        // SAFETY: forwarded; a block's 32 bytes hold 8 groups.
        unsafe { ((*a.add(t * blocks + b)).qs.as_ptr().add(4 * g) as *const i32).read_unaligned() }
    }

    /// The tile at level `V` for `T` tokens: one 512-bit pass over the 16 rows, or two 256-bit ones of 8.
    ///
    /// # Safety
    /// As for [`Tile`], with `T` tokens.
    #[inline(always)]
    unsafe fn body<const V: u8, const T: usize>(o: Operands) {
        // SAFETY: forwarded.
        unsafe {
            if V == AVX512_VNNI {
                wide::<T>(o);
            } else {
                half::<V, T>(0, Operands { rows: o.rows.min(8), ..o });
                if o.rows > 8 {
                    half::<V, T>(1, Operands { out: o.out.add(8), rows: o.rows - 8, ..o });
                }
            }
        }
    }

    /// 16 rows in one 512-bit register per token: per 4-byte group one weight load and one `vpdpbusd` per token
    /// (its 4 activation bytes broadcast from memory), each sum starting from the token's `-128 · Σ a`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and VNNI; otherwise as for [`Tile`].
    #[inline(always)]
    unsafe fn wide<const T: usize>(o: Operands) {
        let Operands { w, a, bias, blocks, out, stride, rows } = o;
        // SAFETY (whole body): the caller's ranges; a block is BLOCK bytes, its scales 32 of them.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); T];
            for b in 0..blocks {
                let blk = w.add(b * BLOCK);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
                let mut sum = [_mm512_setzero_si512(); T];
                for (t, s) in sum.iter_mut().enumerate() {
                    *s = _mm512_set1_epi32(*bias.add(t * blocks + b));
                }
                for g in 0..QK / 4 {
                    let wg = _mm512_loadu_si512(blk.add(QS + g * 4 * ROWS) as *const __m512i);
                    for (t, s) in sum.iter_mut().enumerate() {
                        *s = _mm512_dpbusd_epi32(*s, wg, _mm512_set1_epi32(four(a, blocks, t, b, g)));
                    }
                }
                for (t, acc) in acc.iter_mut().enumerate() {
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps((*a.add(t * blocks + b)).d));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), scale, *acc);
                }
            }
            let mask = if rows >= ROWS { 0xffff } else { (1u16 << rows) - 1 };
            for (t, acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add(t * stride), mask, *acc);
            }
        }
    }

    /// Rows `8h..8h + 8` of the group in 256-bit registers: `vpdpbusd` with AVX-VNNI; without it the weights'
    /// magnitudes times the activations under their signs (`maddubs`, whose 16-bit pairs cannot saturate:
    /// |w| ≤ 128, |a| ≤ 127) summed by `madd`, the same integers.
    ///
    /// # Safety
    /// Level `V`'s features; otherwise as for [`Tile`], with `o.rows` ≤ 8 rows from `o.out`.
    #[inline(always)]
    unsafe fn half<const V: u8, const T: usize>(h: usize, o: Operands) {
        let Operands { w, a, bias, blocks, out, stride, rows } = o;
        // SAFETY (whole body): the caller's ranges; half h's scales are 16 bytes in, its weights 32 per group.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..blocks {
                let blk = w.add(b * BLOCK);
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h) as *const __m128i));
                let mut sum = [_mm256_setzero_si256(); T];
                if V != AVX2 {
                    for (t, s) in sum.iter_mut().enumerate() {
                        *s = _mm256_set1_epi32(*bias.add(t * blocks + b));
                    }
                }
                for g in 0..QK / 4 {
                    let wg = _mm256_loadu_si256(blk.add(QS + g * 4 * ROWS + 32 * h) as *const __m256i);
                    if V == AVX2 {
                        let signed = _mm256_xor_si256(wg, _mm256_set1_epi8(i8::MIN));
                        let magnitude = _mm256_abs_epi8(signed);
                        for (t, s) in sum.iter_mut().enumerate() {
                            let av = _mm256_sign_epi8(_mm256_set1_epi32(four(a, blocks, t, b, g)), signed);
                            let pairs = _mm256_maddubs_epi16(magnitude, av);
                            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
                        }
                    } else {
                        for (t, s) in sum.iter_mut().enumerate() {
                            let av = _mm256_set1_epi32(four(a, blocks, t, b, g));
                            *s = if V == AVX_VNNI {
                                _mm256_dpbusd_avx_epi32(*s, wg, av)
                            } else {
                                _mm256_dpbusd_epi32(*s, wg, av)
                            };
                        }
                    }
                }
                for (t, acc) in acc.iter_mut().enumerate() {
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps((*a.add(t * blocks + b)).d));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), scale, *acc);
                }
            }
            let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (t, acc) in acc.iter().enumerate() {
                _mm256_maskstore_ps(out.add(t * stride), mask, *acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::{quantize_row, report_not_run};
    use crate::tensor::DType;
    use rand::{Rng, SeedableRng};

    /// `tokens` rows of `blocks` 8-bit blocks from random values.
    fn acts(rng: &mut rand::rngs::StdRng, tokens: usize, blocks: usize) -> Vec<Q8Block> {
        let x: Vec<f32> = (0..tokens * blocks * QK).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let mut xq = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; QK] }; tokens * blocks];
        for (src, dst) in x.chunks(blocks * QK).zip(xq.chunks_mut(blocks)) {
            quantize_row(Isa::Scalar, src, dst);
        }
        xq
    }

    /// Packing keeps every weight: each row dequantizes to what the file's blocks do.
    #[test]
    fn packed_rows_dequantize_to_the_file_rows() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (rows, cols) in [(1, 32), (16, 64), (37, 96), (48, 32)] {
            let file = crate::quant::random_blocks(DType::Q8_0, rows * cols / QK, &mut rng);
            let packed = pack(&file, rows, cols)?;
            assert_eq!(packed.len(), packed_len(rows, cols));
            let mut want = vec![0f32; rows * cols];
            crate::quant::dequantize(DType::Q8_0, &file, &mut want);
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                dequantize_row(&packed, cols, r, &mut got);
                assert!(got == want[r * cols..(r + 1) * cols], "{rows}x{cols}: row {r}");
            }
        }
        assert!(pack(&[0; 33], 1, 32).is_err(), "a short block is refused");
        Ok(())
    }

    /// The reference is the dot product of the dequantized weights and activations (exact here: the integer
    /// sums are, and each block adds one rounded product).
    #[test]
    fn scalar_is_the_dequantized_dot() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (rows, blocks) = (20, 6);
        let file = crate::quant::random_blocks(DType::Q8_0, rows * blocks, &mut rng);
        let packed = pack(&file, rows, blocks * QK)?;
        let a = acts(&mut rng, 1, blocks);
        let mut w = vec![0f32; blocks * QK];
        for r in 0..rows {
            dequantize_row(&packed, blocks * QK, r, &mut w);
            let group = &packed[(r / ROWS) * blocks * BLOCK..][..blocks * BLOCK];
            let got = scalar(group, &a)[r % ROWS];
            let want: f64 =
                w.iter().enumerate().map(|(l, &v)| f64::from(v * a[l / QK].d) * f64::from(a[l / QK].qs[l % QK])).sum();
            let mass: f64 = w.iter().enumerate().map(|(l, &v)| f64::from((v * a[l / QK].d).abs()) * 127.0).sum();
            assert!((f64::from(got) - want).abs() <= 1e-6 * mass, "row {r}: {got} vs {want}");
        }
        Ok(())
    }

    /// Every level this CPU has gives the reference's bits, for every tile width and partial row groups, with
    /// the extreme weights (-128, 127) and activations (±127) that could overflow a 16-bit pair.
    #[test]
    fn every_level_gives_the_scalar_bits() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let blocks = 5;
        let cols = blocks * QK;
        for isa in Isa::X86 {
            if !isa.supported() {
                report_not_run(isa, "every_level_gives_the_scalar_bits");
                continue;
            }
            for rows in [1, 7, 8, 9, 16, 21, 40] {
                let mut file = crate::quant::random_blocks(DType::Q8_0, rows * blocks, &mut rng);
                // Row 0's first block: -128 and 127 weights against ±127 activations.
                for (l, q) in file[2..FILE_BLOCK].iter_mut().enumerate() {
                    *q = if l % 2 == 0 { 0x80 } else { 0x7f };
                }
                let packed = pack(&file, rows, cols)?;
                for tokens in [1, 2, 3, 4, 5, 8, 9, 17] {
                    let mut a = acts(&mut rng, tokens, blocks);
                    a[0].qs = std::array::from_fn(|l| if l % 4 < 2 { 127 } else { -127 });
                    let sums = Acts::new(&a, tokens, blocks);
                    let stride = rows + 3;
                    let mut out = vec![f32::NAN; tokens * stride];
                    // SAFETY: tokens × stride outputs, rows of them per token.
                    unsafe { rows_by_tokens(isa, &packed, rows, &sums, out.as_mut_ptr(), stride) };
                    for t in 0..tokens {
                        for r in 0..rows {
                            let group = &packed[(r / ROWS) * blocks * BLOCK..][..blocks * BLOCK];
                            let want = scalar(group, &a[t * blocks..(t + 1) * blocks])[r % ROWS];
                            let got = out[t * stride + r];
                            assert_eq!(got.to_bits(), want.to_bits(), "{} {rows}x{tokens} at ({r},{t})", isa.name());
                        }
                        assert!(
                            out[t * stride + rows..(t + 1) * stride].iter().all(|v| v.is_nan()),
                            "wrote past row {rows}"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
