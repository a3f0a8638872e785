//! f16 and bf16 weight rows against f32 activations.
//!
//! Every output is computed the same way wherever it is computed (two 8-lane accumulators over alternate chunks of
//! 8, then the rest in order: see `x86::tile`). A tile of one row and several tokens ([`rows_by_tokens`]) only
//! shares the row's loads and conversions between its tokens, so a token's results do not depend on the batch it is
//! in, nor on how the rows are split between threads. Batched decode and prefill on 16-bit weights loaded and
//! converted each weight row once per token before; a tile does it once per up to 6 tokens.

use super::simd::Isa;

/// The 16-bit float format of a weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// IEEE half precision.
    F16,
    /// bfloat16: the top half of an f32.
    Bf16,
}

impl Half {
    fn to_f32(self, bits: u16) -> f32 {
        match self {
            Half::F16 => half::f16::from_bits(bits).to_f32(),
            Half::Bf16 => f32::from_bits((bits as u32) << 16),
        }
    }
}

/// `Σ x·w` with `w` as `kind` bits: the one-output case of [`rows_by_tokens`], with the same bits.
#[cfg(test)]
fn dot(isa: Isa, kind: Half, x: &[f32], w: &[u16]) -> f32 {
    let k = x.len().min(w.len());
    let mut out = 0f32;
    rows_by_tokens(isa, kind, &w[..k], &x[..k], k, |_, _, v| out = v);
    out
}

/// `store(r, t, Σ_i x[t·k + i] · w[r·k + i])` for every weight row `r` of `w` and token `t` of `x` (both
/// row-major with `k` columns).
pub fn rows_by_tokens(isa: Isa, kind: Half, w: &[u16], x: &[f32], k: usize, mut store: impl FnMut(usize, usize, f32)) {
    if k == 0 {
        return;
    }
    let (rows, tokens) = (w.len() / k, x.len() / k);
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: every x86 instruction set is only chosen after runtime detection of AVX2, FMA and F16C; `w` holds
        // `rows` rows and `x` `tokens` rows of `k` elements.
        unsafe {
            match (kind, isa == Isa::Avx512Vnni) {
                (Half::F16, false) => x86::rows_by_tokens::<false>(w, x, k, rows, tokens, &mut store),
                (Half::Bf16, false) => x86::rows_by_tokens::<true>(w, x, k, rows, tokens, &mut store),
                (Half::F16, true) => x86::rows_by_tokens_avx512::<false>(w, x, k, rows, tokens, &mut store),
                (Half::Bf16, true) => x86::rows_by_tokens_avx512::<true>(w, x, k, rows, tokens, &mut store),
            }
        }
        return;
    }
    let _ = isa;
    for r in 0..rows {
        let wr = &w[r * k..(r + 1) * k];
        for t in 0..tokens {
            let xt = &x[t * k..(t + 1) * k];
            store(r, t, xt.iter().zip(wr).map(|(a, &b)| a * kind.to_f32(b)).sum());
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Half;
    use crate::backend::cpu::simd::x86::hsum;
    use std::arch::x86_64::*;

    /// Tokens per tile: 6 × 2 accumulators and 2 converted weight chunks fit AVX2's 16 registers (the activations
    /// are FMA memory operands). Prefill of SmolLM2 in bf16 ran at 250–285 tok/s with tiles of 4, 285–300 with 6.
    const T: usize = 6;

    /// Eight weights at `p` as f32.
    ///
    /// # Safety
    /// AVX2 and F16C are present; 16 readable bytes at `p`.
    #[inline(always)]
    unsafe fn load8<const BF: bool>(p: *const u16) -> __m256 {
        // SAFETY: forwarded.
        unsafe {
            let raw = _mm_loadu_si128(p as *const __m128i);
            if BF {
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
            } else {
                _mm256_cvtph_ps(raw)
            }
        }
    }

    /// `R` weight rows `w` against `TT` tokens from `x`. Per output: two 8-lane accumulators, one over the even and
    /// one over the odd 8-element chunks of each 16, their sum's horizontal sum, then the rest in order. The rows
    /// share each activation load and nothing else, so an output has the same bits in any tile. One row × 6 tokens
    /// (12 accumulators, 2 weight chunks) fits AVX2's 16 registers; 2 rows × 6 tokens fit AVX-512's 32, with 16
    /// loads per 24 multiply-adds instead of 14 per 12.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present (and AVX-512 F/VL for the registers of 2 rows × 6 tokens); each of `w` holds
    /// one row and `x` `TT` rows of `k` elements.
    #[inline(always)]
    unsafe fn tile<const BF: bool, const R: usize, const TT: usize>(
        w: [*const u16; R],
        x: *const f32,
        k: usize,
    ) -> [[f32; TT]; R] {
        let kind = if BF { Half::Bf16 } else { Half::F16 };
        // SAFETY (whole body): every chunk and tail element read lies inside the rows the caller passed.
        unsafe {
            let mut acc = [[[_mm256_setzero_ps(); 2]; TT]; R];
            let mut i = 0;
            while i + 16 <= k {
                let wv = w.map(|w| [load8::<BF>(w.add(i)), load8::<BF>(w.add(i + 8))]);
                for t in 0..TT {
                    for j in 0..2 {
                        let xv = _mm256_loadu_ps(x.add(t * k + i + 8 * j));
                        for (acc, wv) in acc.iter_mut().zip(&wv) {
                            acc[t][j] = _mm256_fmadd_ps(xv, wv[j], acc[t][j]);
                        }
                    }
                }
                i += 16;
            }
            let mut out = [[0f32; TT]; R];
            for ((out, acc), w) in out.iter_mut().zip(acc).zip(w) {
                for (t, (o, acc)) in out.iter_mut().zip(acc).enumerate() {
                    let mut s = hsum(_mm256_add_ps(acc[0], acc[1]));
                    for i in i..k {
                        s += *x.add(t * k + i) * kind.to_f32(*w.add(i));
                    }
                    *o = s;
                }
            }
            out
        }
    }

    /// `store`s a tile's outputs for row `r` from token `t` on.
    #[inline(always)]
    fn put<const TT: usize>(store: &mut impl FnMut(usize, usize, f32), r: usize, t: usize, o: [f32; TT]) {
        o.iter().enumerate().for_each(|(j, &v)| store(r, t + j, v));
    }

    /// Weight bytes of a block of rows that every tile of tokens passes over before the next block: small enough
    /// to stay in any x86 core's L2 (512 KiB and up) beside the activations.
    const ROW_BLOCK_BYTES: usize = 192 << 10;
    /// Activation bytes that stay in any x86 core's L1 data cache: with no more, rows go one by one (each row's
    /// tiles then reuse it from L1, as batched decode wants).
    const L1_BYTES: usize = 32 << 10;

    /// The entry points: [`walk`] under one level's features.
    macro_rules! entry {
        ($(#[$doc:meta])* $name:ident, $features:literal, $pairs:literal) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const BF: bool>(
                w: &[u16],
                x: &[f32],
                k: usize,
                rows: usize,
                tokens: usize,
                store: &mut impl FnMut(usize, usize, f32),
            ) {
                // SAFETY: forwarded; this function has the features `walk` needs.
                unsafe { walk::<BF, $pairs>(w, x, k, rows, tokens, store) }
            }
        };
    }

    entry!(
        /// Blocks of rows, each against tiles of `T` tokens, then of 4, 2 and 1 for those left over, every row of
        /// the block per tile. A tile's activations stay in L1 while the block's rows pass, and the block's weights
        /// in L2 while the tiles pass: each weight is read from memory once, each activation from L2 once per
        /// block. (Row by row, every row read all the tokens' activations from L2 again: prefill was bound by it.)
        /// Tokens whose activations fit L1 go row by row.
        ///
        /// # Safety
        /// AVX2, FMA and F16C are present; `w` holds `rows` and `x` `tokens` rows of `k` elements.
        rows_by_tokens,
        "avx2,fma,f16c",
        false
    );

    entry!(
        /// [`rows_by_tokens`] with AVX-512's 32 registers: in prefill, rows in pairs against each tile of 6 tokens.
        ///
        /// # Safety
        /// As for [`rows_by_tokens`], with AVX-512 F/VL present.
        rows_by_tokens_avx512,
        "avx2,fma,f16c,avx512f,avx512vl",
        true
    );

    /// The loop of [`rows_by_tokens`]; with `PAIRS` and activations past L1 (prefill), each full tile of `T`
    /// tokens takes the block's rows two at a time.
    ///
    /// # Safety
    /// As for [`rows_by_tokens`]; AVX-512 F/VL present with `PAIRS`.
    #[inline(always)]
    unsafe fn walk<const BF: bool, const PAIRS: bool>(
        w: &[u16],
        x: &[f32],
        k: usize,
        rows: usize,
        tokens: usize,
        store: &mut impl FnMut(usize, usize, f32),
    ) {
        assert!(w.len() >= rows * k && x.len() >= tokens * k);
        let (w, x) = (w.as_ptr(), x.as_ptr());
        let fits_l1 = tokens * k * 4 <= L1_BYTES;
        let block = if fits_l1 { 1 } else { (ROW_BLOCK_BYTES / (2 * k)).max(1) };
        // Not in batched decode, whose weights come from memory: two rows at once are two streams a row apart,
        // which the prefetchers follow worse than one (8 sequences' decode ran 0.92x with pairs).
        let pairs = PAIRS && !fits_l1;
        // SAFETY (whole body): the assert above keeps every tile's rows inside `w` and `x`.
        unsafe {
            for first in (0..rows).step_by(block) {
                let mut t = 0;
                while t < tokens {
                    let n = match tokens - t {
                        T.. => T,
                        4.. => 4,
                        2.. => 2,
                        _ => 1,
                    };
                    let xt = x.add(t * k);
                    let end = (first + block).min(rows);
                    let mut r = first;
                    if pairs && n == T {
                        while r + 2 <= end {
                            let [o0, o1] = tile::<BF, 2, T>([w.add(r * k), w.add((r + 1) * k)], xt, k);
                            put(store, r, t, o0);
                            put(store, r + 1, t, o1);
                            r += 2;
                        }
                    }
                    for r in r..end {
                        let wr = w.add(r * k);
                        match n {
                            T => put(store, r, t, tile::<BF, 1, T>([wr], xt, k)[0]),
                            4 => put(store, r, t, tile::<BF, 1, 4>([wr], xt, k)[0]),
                            2 => put(store, r, t, tile::<BF, 1, 2>([wr], xt, k)[0]),
                            _ => put(store, r, t, tile::<BF, 1, 1>([wr], xt, k)[0]),
                        }
                    }
                    t += n;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::tests::rand_vec;
    use rand::SeedableRng;

    fn bits(kind: Half, v: &[f32]) -> Vec<u16> {
        v.iter()
            .map(|&x| match kind {
                Half::F16 => half::f16::from_f32(x).to_bits(),
                Half::Bf16 => half::bf16::from_f32(x).to_bits(),
            })
            .collect()
    }

    #[test]
    fn dots_match_the_scalar_oracle() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let isa = Isa::detect();
        for n in [1, 7, 8, 33, 100, 576] {
            let (a, b) = (rand_vec(&mut rng, n), rand_vec(&mut rng, n));
            for kind in [Half::F16, Half::Bf16] {
                let w = bits(kind, &b);
                let exact: f64 = a.iter().zip(&w).map(|(&x, &y)| x as f64 * kind.to_f32(y) as f64).sum();
                let tol = 1e-4 * n as f32;
                assert!((dot(isa, kind, &a, &w) - dot(Isa::Scalar, kind, &a, &w)).abs() < tol, "{kind:?} n={n}");
                assert!((dot(isa, kind, &a, &w) as f64 - exact).abs() < tol as f64, "{kind:?} n={n}");
            }
        }
    }

    /// Batch invariance: whether an output falls in a full tile (of one row or, at the AVX-512 level, two) or among
    /// the tokens left over, it has the bits of the same dot product computed alone, at every x86 level this CPU
    /// has the bits of AVX2's.
    #[test]
    fn every_tile_gives_the_bits_of_one_dot_product() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let mut levels: Vec<Isa> = Isa::X86.into_iter().filter(|i| i.supported()).collect();
        for isa in Isa::X86.into_iter().filter(|i| !i.supported()) {
            crate::backend::cpu::simd::report_not_run(isa, "every_tile_gives_the_bits_of_one_dot_product");
        }
        if levels.is_empty() {
            levels.push(Isa::detect());
        }
        // The last two: activations past L1, so rows go in blocks (of 1,024 rows of 96, the third one partial), and
        // at the AVX-512 level in pairs (3 rows: a pair and a single one).
        let shapes =
            [(1, 1, 8), (4, 2, 64), (7, 5, 100), (9, 3, 576), (5, 8, 7), (2, 9, 31), (3, 15, 576), (2100, 100, 96)];
        for (rows, tokens, k) in shapes {
            for kind in [Half::F16, Half::Bf16] {
                let w = bits(kind, &rand_vec(&mut rng, rows * k));
                let x = rand_vec(&mut rng, tokens * k);
                for &isa in &levels {
                    let mut got = vec![f32::NAN; rows * tokens];
                    rows_by_tokens(isa, kind, &w, &x, k, |r, t, v| got[t * rows + r] = v);
                    for r in 0..rows {
                        for t in 0..tokens {
                            let one = dot(levels[0], kind, &x[t * k..(t + 1) * k], &w[r * k..(r + 1) * k]);
                            assert_eq!(
                                got[t * rows + r].to_bits(),
                                one.to_bits(),
                                "{} {kind:?} {rows}x{tokens}x{k} ({r}, {t})",
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }
}
