//! `eˣ` and SiLU over slices, eight lanes at a time where the CPU has AVX2. One polynomial (Cephes' `expf`) is
//! evaluated with the same fused multiply-adds on every instruction set, so the AVX2 lanes and the portable loop
//! give the same bits, and an element's result does not depend on where it sits in its slice (a tail is padded
//! to a full register, never sent down another path). libm's `expf`, one call per element, was the serial part
//! of every decode step's SiLU and a tenth of attention's softmax.

use super::simd::Isa;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cephes' C1 and C2), so `x − n·ln 2` keeps its low bits for large `n`.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// ln(f32::MAX): above it `eˣ` is infinite.
const HI: f32 = 88.722_83;
/// Below it the result is 0. e⁻⁸⁶ ≈ 4·10⁻³⁸ is near the smallest normal f32; the cut keeps `2ⁿ⁻¹` normal.
const LO: f32 = -86.0;
/// Cephes' minimax coefficients of `(eʳ − 1 − r)/r²` on |r| ≤ ln 2 / 2, highest degree first (the last, 0.5000000120
/// in Cephes, is 0.5 in f32).
const P: [f32; 6] = [1.987_569_2e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// `eˣ` for one value, as every lane of the vector version computes it.
#[inline(always)]
fn exp1(x: f32) -> f32 {
    // NaN passes through, as `min`/`max` with it second do in the vector version.
    let c = x.clamp(LO, HI);
    let n = (c * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, c);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = P[0];
    for k in &P[1..] {
        p = p.mul_add(r, *k);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // 2ⁿ⁻¹ from its exponent bits (n ∈ [−124, 128] after the clamp), then ×2: 2¹²⁸ itself is not a finite f32.
    let scale = f32::from_bits(((n as i32).wrapping_add(126) as u32) << 23);
    let e = y * scale * 2.0;
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        e
    }
}

/// `x ← e^(x − max)` for every element, `max` the slice's largest: softmax's numerators (attention's, and
/// sampling's weights), each in [0, 1].
pub fn exp_from_max(isa: Isa, xs: &mut [f32]) {
    let max = max_of(xs);
    exp_less(isa, xs, max);
}

/// The largest value, NaNs ignored (−∞ for none): in 16 independent lanes, which the compiler vectorizes, where
/// one running maximum waits on the last at every step (a sampled token's 49,152 logits: ~25 µs).
pub(crate) fn max_of(xs: &[f32]) -> f32 {
    let pick = |m: f32, x: f32| if x > m { x } else { m };
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| pick(m, x));
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = pick(*m, x);
        }
    }
    lanes.iter().fold(tail, |m, &x| pick(m, x))
}

/// The sum of the values, in 16 independent lanes (which the compiler vectorizes) added pairwise at the end, then
/// the tail: one running sum would wait on the last addition at every step (a 1,536-token context's softmax: 3.6 %
/// of a TinyLlama-shape prefill). Every level sums the same way, so the same bits.
pub(crate) fn sum_of(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += x;
        }
    }
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    tail.iter().fold(lanes[0], |s, &x| s + x)
}

/// `x ← e^(x − m)` for every element, the subtraction in the same pass (`x − 0` is `x`, even for -0 and NaN).
fn exp_less(isa: Isa, xs: &mut [f32], m: f32) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: AVX2 and FMA were detected (every x86 level has them).
        unsafe { x86::exp_slice(xs, m) };
        return;
    }
    let _ = isa;
    xs.iter_mut().for_each(|x| *x = exp1(*x - m));
}

/// `out = g / (1 + e⁻ᵍ) · u` elementwise (SiLU of the gate times the up projection); the slices have one length.
pub fn silu_mul(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        out.copy_from_slice(gate);
        // SAFETY: AVX2 and FMA were detected; `up` is as long as `out`, read at the offset `map` passes.
        unsafe { x86::silu_mul_slice(out, up) };
        return;
    }
    let _ = isa;
    for (o, (&g, &u)) in out.iter_mut().zip(gate.iter().zip(up)) {
        *o = g / (1.0 + exp1(-g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{HI, LN2_HI, LN2_LO, LO, LOG2E, P};
    use std::arch::x86_64::*;

    /// [`super::exp1`] in eight lanes, operation for operation.
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        // SAFETY: forwarded.
        unsafe {
            let (hi, lo) = (_mm256_set1_ps(HI), _mm256_set1_ps(LO));
            // With x second, a NaN lane stays NaN.
            let c = _mm256_max_ps(lo, _mm256_min_ps(hi, x));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                c,
                _mm256_set1_ps(LOG2E),
            ));
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), c);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut p = _mm256_set1_ps(P[0]);
            for k in &P[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*k));
            }
            let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)));
            let e = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), _mm256_set1_ps(2.0));
            let e = _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi));
            _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo))
        }
    }

    /// `g / (1 + e⁻ᵍ) · u` in eight lanes, as the portable loop computes it.
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[inline(always)]
    unsafe fn silu_mul(g: __m256, u: __m256) -> __m256 {
        // SAFETY: forwarded.
        unsafe {
            let neg = _mm256_xor_ps(g, _mm256_set1_ps(-0.0));
            _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), exp(neg))), u)
        }
    }

    /// `x ← e^(x − m)` over a slice.
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_slice(xs: &mut [f32], m: f32) {
        // SAFETY: this function's features are the kernels'; the closure inherits them.
        unsafe {
            let m = _mm256_set1_ps(m);
            map(xs, |v| exp(_mm256_sub_ps(v, m)))
        }
    }

    /// `g ← silu(g)·u` over two slices of one length.
    ///
    /// # Safety
    /// AVX2 and FMA available; `up.len() == g.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul_slice(g: &mut [f32], up: &[f32]) {
        // SAFETY: as for `exp_slice`.
        unsafe { map_with(g, up, |g, u| silu_mul(g, u)) }
    }

    /// `x ← f(x)` eight at a time; a tail goes through `f` padded to eight lanes.
    ///
    /// # Safety
    /// AVX2 and FMA available.
    #[inline(always)]
    unsafe fn map(xs: &mut [f32], f: impl Fn(__m256) -> __m256) {
        let mut chunks = xs.chunks_exact_mut(8);
        // SAFETY: each chunk holds eight floats; the tail is copied through a full register's worth.
        unsafe {
            for c in &mut chunks {
                _mm256_storeu_ps(c.as_mut_ptr(), f(_mm256_loadu_ps(c.as_ptr())));
            }
            let tail = chunks.into_remainder();
            if !tail.is_empty() {
                let mut pad = [0f32; 8];
                pad[..tail.len()].copy_from_slice(tail);
                _mm256_storeu_ps(pad.as_mut_ptr(), f(_mm256_loadu_ps(pad.as_ptr())));
                tail.copy_from_slice(&pad[..tail.len()]);
            }
        }
    }

    /// `x ← f(x, y)` eight at a time over two slices of one length, padded as [`map`] pads.
    ///
    /// # Safety
    /// AVX2 and FMA available; `ys.len() == xs.len()`.
    #[inline(always)]
    unsafe fn map_with(xs: &mut [f32], ys: &[f32], f: impl Fn(__m256, __m256) -> __m256) {
        assert_eq!(xs.len(), ys.len());
        let whole = xs.len() / 8 * 8;
        // SAFETY: indices below `whole` step by eight inside both slices; the tail is copied through a full
        // register's worth.
        unsafe {
            for i in (0..whole).step_by(8) {
                let v = f(_mm256_loadu_ps(xs.as_ptr().add(i)), _mm256_loadu_ps(ys.as_ptr().add(i)));
                _mm256_storeu_ps(xs.as_mut_ptr().add(i), v);
            }
            let n = xs.len() - whole;
            if n > 0 {
                let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
                a[..n].copy_from_slice(&xs[whole..]);
                b[..n].copy_from_slice(&ys[whole..]);
                _mm256_storeu_ps(a.as_mut_ptr(), f(_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr())));
                xs[whole..].copy_from_slice(&a[..n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd;
    use rand::{Rng, SeedableRng};

    /// Inputs over the whole range, the edges and the special values.
    fn inputs() -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(31);
        let mut xs: Vec<f32> = (0..20_000).map(|_| rng.random_range(-100.0f32..100.0)).collect();
        xs.extend((0..4_000).map(|_| rng.random_range(-1.0f32..1.0)));
        for e in [HI, LO, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, 1e-30, -1e-30] {
            xs.extend([e, f32::from_bits(e.to_bits() + 1), f32::from_bits(e.to_bits().saturating_sub(1))]);
        }
        xs
    }

    /// Within 2 ulp of the exact value where the result is normal; infinite above ln(f32::MAX), 0 below −86,
    /// NaN for NaN.
    #[test]
    fn exp_is_within_two_ulp_of_the_exact_value() {
        let mut xs = inputs();
        xs.push(f32::NAN);
        let mut got = xs.clone();
        exp_less(Isa::Scalar, &mut got, 0.0);
        for (&x, &e) in xs.iter().zip(&got) {
            if x.is_nan() {
                assert!(e.is_nan());
            } else if x > HI {
                assert_eq!(e, f32::INFINITY, "e^{x}");
            } else if x < LO {
                assert_eq!(e, 0.0, "e^{x}");
            } else {
                let exact = (x as f64).exp();
                let ulp = (exact as f32).to_bits().abs_diff(e.to_bits());
                assert!(ulp <= 2, "e^{x}: {e} vs {exact} ({ulp} ulp)");
            }
        }
    }

    /// The same bits, or both NaN (whose payloads the portable loop's software FMA may choose differently).
    fn same(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan())
    }

    /// Every instruction set gives the portable loop's bits, at every offset in a slice and every tail length.
    #[test]
    fn every_isa_gives_the_portable_bits_wherever_the_element_sits() {
        let isa = Isa::detect();
        if isa == Isa::Scalar {
            simd::report_not_run(Isa::Avx2, "every_isa_gives_the_portable_bits_wherever_the_element_sits");
            return;
        }
        let xs = inputs();
        let mut scalar = xs.clone();
        exp_less(Isa::Scalar, &mut scalar, 0.0);
        for len in [1, 7, 8, 9, 23, xs.len() - 3] {
            for start in [0, 3] {
                let mut v = xs[start..start + len].to_vec();
                exp_less(isa, &mut v, 0.0);
                let want = &scalar[start..start + len];
                assert!(same(&v, want), "{len} from {start}");
            }
        }
        let up: Vec<f32> = xs.iter().rev().map(|x| x.clamp(-3.0, 3.0)).collect();
        for len in [5, 16, 37, xs.len()] {
            let (mut fast, mut slow) = (vec![0f32; len], vec![0f32; len]);
            silu_mul(isa, &xs[..len], &up[..len], &mut fast);
            silu_mul(Isa::Scalar, &xs[..len], &up[..len], &mut slow);
            assert!(same(&fast, &slow), "silu, {len}");
        }
    }

    /// The lanes' maximum is the running `f32::max`'s, bit for bit, NaNs and tails included.
    #[test]
    fn the_lanes_maximum_is_the_running_one() {
        for xs in [
            vec![],
            vec![f32::NAN],
            vec![1.0, f32::NAN, 3.0],
            vec![-5.0; 17],
            (0..1000).map(|i| ((i * 7919) % 997) as f32 - 500.0).collect(),
            (0..49_155u64).map(|i| if i % 100 == 3 { f32::NAN } else { ((i * 104_729) % 65_521) as f32 }).collect(),
        ] {
            let running = xs.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            assert_eq!(max_of(&xs).to_bits(), running.to_bits(), "{} values", xs.len());
        }
    }

    #[test]
    fn the_lanes_sum_is_the_sum() {
        // Small integers add exactly in any order: every element counted once, tails included.
        for n in [0, 1, 15, 16, 17, 33, 1000] {
            let xs: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32).collect();
            let running = xs.iter().fold(0f32, |s, &x| s + x);
            assert_eq!(sum_of(&xs).to_bits(), running.to_bits(), "{n} values");
        }
        // Probabilities of a long context: as close to the exact sum as a running sum is.
        let xs: Vec<f32> = (0..1537u64).map(|i| ((i * 104_729) % 65_521) as f32 / 65_521.0).collect();
        let exact: f64 = xs.iter().map(|&x| f64::from(x)).sum();
        assert!((f64::from(sum_of(&xs)) - exact).abs() < 1e-6 * exact, "{} against {exact}", sum_of(&xs));
    }

    /// SiLU stays within a few ulp of its value in f64 (or 1e-30 of it, where a gate below −88.7 gives 0 for a
    /// value of at most 1e-36), the finite edges included.
    #[test]
    fn silu_matches_its_definition() {
        let xs = inputs();
        let up: Vec<f32> = xs.iter().map(|x| x.clamp(-2.0, 2.0)).collect();
        let mut out = vec![0f32; xs.len()];
        silu_mul(Isa::detect(), &xs, &up, &mut out);
        for ((&g, &u), &o) in xs.iter().zip(&up).zip(&out) {
            let want = (g as f64 / (1.0 + (-g as f64).exp()) * u as f64) as f32;
            if want.is_finite() && g.is_finite() {
                assert!((o - want).abs() <= 6.0 * f32::EPSILON * want.abs() + 1e-30, "{g}·{u}: {o} vs {want}");
            }
        }
    }
}
