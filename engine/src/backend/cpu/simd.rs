//! Dot-product kernels: a portable scalar version of each (the oracle) and x86 versions picked at runtime (AVX2/
//! FMA/F16C; the quantized ones also at the VNNI levels of [`Isa::X86`]).

pub use super::isa::Isa;
use super::kernels::kernels;
use crate::quant::QK;
use crate::tensor::DType;

/// An activation block quantized to 8 bits for integer dot products with quantized weights.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct Q8Block {
    /// Scale: value ≈ `d * qs[i]`.
    pub d: f32,
    /// `d * Σ qs`, used by the offset terms of the formats with a minimum per block (Q4_1, Q5_1; the K-quants'
    /// take integer sums per sub-block or half instead).
    pub s: f32,
    /// Quantized values.
    pub qs: [i8; QK],
}

/// Quantizes a row (length a multiple of 32) into 8-bit blocks, each under its own scale, with the same bits on
/// every level: [`quantize_row_spans`] with spans of one block.
pub fn quantize_row(isa: Isa, x: &[f32], out: &mut [Q8Block]) {
    quantize_row_spans(isa, x, out, 1);
}

/// Quantizes a row (length a multiple of `32 · span`) into 8-bit blocks, each run of `span` blocks under one scale
/// (the largest |x| of the run over 127; the K-quants' kernels take one per 256 elements, as llama.cpp's Q8_K), with
/// the same bits on every level (the AVX2 version does the scalar one's float operations lane by lane; max and
/// integer sums do not depend on order).
pub fn quantize_row_spans(isa: Isa, x: &[f32], out: &mut [Q8Block], span: usize) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: see dot_f32.
        return unsafe { x86::quantize_row(x, out, span) };
    }
    let _ = isa;
    quantize_row_scalar(x, out, span);
}

/// The portable reference for [`quantize_row_spans`].
fn quantize_row_scalar(x: &[f32], out: &mut [Q8Block], span: usize) {
    for (run, blocks) in x.chunks_exact(QK * span).zip(out.chunks_exact_mut(span)) {
        let amax = run.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (chunk, b) in run.chunks_exact(QK).zip(blocks) {
            let mut sum = 0i32;
            for (q, &v) in b.qs.iter_mut().zip(chunk) {
                // Round to nearest (ties to even) with the 1.5·2²³ trick: plain arithmetic the compiler
                // vectorizes, unlike a call to `roundf`. |v·id| ≤ 127, far inside the trick's range.
                const MAGIC: f32 = 12_582_912.0;
                let r = ((v * id + MAGIC) - MAGIC) as i32;
                *q = r.clamp(-127, 127) as i8;
                sum += *q as i32;
            }
            b.d = d;
            b.s = d * sum as f32;
        }
    }
}

/// Σ a·b over f32.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: every x86 instruction set is only chosen after runtime detection of avx2, fma and f16c.
        return unsafe { x86::dot_f32(a, b) };
    }
    let _ = isa;
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += a·x`.
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: see dot_f32.
        return unsafe { x86::axpy(a, x, y) };
    }
    let _ = isa;
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Dot products of one quantized weight row (raw GGML blocks of `dtype`) with `out.len()` activation rows, one
/// at a time. `xq` holds the rows' blocks back to back, `blocks` per row. The reference arithmetic of the AVX2
/// kernels: `dot_quant_rows` (one token) and `qgemm` (several) reproduce it bit for bit.
pub fn dot_quant(isa: Isa, dtype: DType, w: &[u8], xq: &[Q8Block], blocks: usize, out: &mut [f32]) {
    let k = kernels(dtype);
    for (t, o) in out.iter_mut().enumerate() {
        let a = &xq[t * blocks..(t + 1) * blocks];
        #[cfg(target_arch = "x86_64")]
        if let Some(x) = k.x86(isa) {
            // SAFETY: an x86 instruction set is only chosen after runtime detection of its features; `w` holds
            // `blocks` blocks of `dtype` and `a` holds `blocks` blocks (checked by the caller's shapes).
            *o = unsafe { (x.dot_one)(w, a, blocks) };
            continue;
        }
        let _ = isa;
        *o = (k.scalar_dot)(w, a);
    }
}

/// Dot products of `out.len()` consecutive quantized weight rows (`row_bytes` apart) with ONE activation row,
/// each computed exactly as [`dot_quant`] computes it: the decode path.
///
/// Row after row, each by the one-row kernel, which prefetches `x86::PREFETCH_BYTES` ahead: decode streams
/// every weight from memory once per step, and one ordered stream is what the prefetchers follow best. Kernels
/// that took 4 or 8 rows at a time (loading each activation block once for all of them) were faster with the
/// weights in cache but 1.2× slower in SmolLM2's batch-1 decode (docs/performance.md, 2026-12-03).
pub fn dot_quant_rows(
    isa: Isa,
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    xq: &[Q8Block],
    blocks: usize,
    out: &mut [f32],
) {
    let rows = w.chunks_exact(row_bytes).zip(out.iter_mut());
    #[cfg(target_arch = "x86_64")]
    if let Some(x) = kernels(dtype).x86(isa) {
        for (row, o) in rows {
            // SAFETY: as in `dot_quant`: the level was detected; each row holds `blocks` blocks of `dtype`.
            *o = unsafe { (x.dot_one)(row, xq, blocks) };
        }
        return;
    }
    for (row, o) in rows {
        dot_quant(isa, dtype, row, xq, blocks, std::slice::from_mut(o));
    }
}

/// Says, on the test binary's own stderr (which the test harness does not capture), that `test` skipped the
/// kernels of `isa` because this CPU lacks their features: a path the CPU cannot run is reported by name, never
/// passed in silence.
#[cfg(test)]
pub(super) fn report_not_run(isa: Isa, test: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "not run: {} kernels in {test}: this CPU lacks {}", isa.name(), isa.needs());
}

/// The portable reference for [`dot_quant`], one activation row.
pub fn dot_quant_scalar(dtype: DType, w: &[u8], a: &[Q8Block]) -> f32 {
    (kernels(dtype).scalar_dot)(w, a)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{Q8Block, QK};
    use crate::backend::cpu::unpack::{Sub, block_bytes, sub_offset, subs, unpack};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::backend::cpu) fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads within 0..n of both slices.
        unsafe {
            while i + 32 <= n {
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc =
                        _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8 * j)), _mm256_loadu_ps(pb.add(i + 8 * j)), *acc);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
                i += 8;
            }
        }
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        for k in i..n {
            s += a[k] * b[k];
        }
        s
    }

    /// [`super::quantize_row_spans`] eight lanes at a time: the scalar version's operations (|v| max, `v·id`
    /// rounded by adding and subtracting 1.5·2²³, the clamp, a NaN cast to 0), so the same bits. Prefill quantizes
    /// every linear layer's input rows; the scalar loop's saturating casts did not vectorize.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_row(x: &[f32], out: &mut [Q8Block], span: usize) {
        const MAGIC: f32 = 12_582_912.0;
        let (sign, magic) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(MAGIC));
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        // packs_epi32 then packs_epi16 interleave 4-byte groups across the 128-bit halves; this restores order.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (run, blocks) in x.chunks_exact(QK * span).zip(out.chunks_exact_mut(span)) {
            // As `m.max(|v|)`: a NaN |v| leaves m (max_ps returns its second operand then).
            let mut m = _mm256_setzero_ps();
            for v in run.chunks_exact(8) {
                // SAFETY: `v` holds 8 floats.
                m = _mm256_max_ps(_mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(v.as_ptr()) }), m);
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            for (chunk, b) in run.chunks_exact(QK).zip(blocks) {
                // SAFETY: `chunk` holds 32 floats and `b.qs` 32 bytes.
                unsafe {
                    let q: [__m256i; 4] = std::array::from_fn(|i| {
                        let v = _mm256_loadu_ps(chunk.as_ptr().add(8 * i));
                        let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, id), magic), magic);
                        // Clamped as floats: cvttps gives i32::MIN for ±inf (a subnormal amax makes `id` infinite)
                        // and for NaN, where Rust's saturating `as` gives i32::MAX, MIN and 0.
                        let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
                        let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
                        _mm256_and_si256(_mm256_cvttps_epi32(r), ordered)
                    });
                    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                    _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, _mm256_permutevar8x32_epi32(bytes, order));
                    let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
                    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
                    b.d = d;
                    b.s = d * sum as f32;
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is within 0..n of both slices.
        unsafe {
            while i + 8 <= n {
                let yv = _mm256_loadu_ps(y.as_ptr().add(i));
                _mm256_storeu_ps(y.as_mut_ptr().add(i), _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), yv));
                i += 8;
            }
        }
        for k in i..n {
            y[k] += a * x[k];
        }
    }

    /// The x86 instruction-set levels the quantized kernels are instantiated for, a const parameter of the
    /// shared kernel bodies: the 8-bit dot product is `maddubs` + `madd` on AVX2, one `vpdpbusd` with VNNI.
    pub(in crate::backend::cpu) const AVX2: u8 = 0;
    pub(in crate::backend::cpu) const AVX_VNNI: u8 = 1;
    pub(in crate::backend::cpu) const AVX512_VNNI: u8 = 2;

    /// How far ahead of the sub-block it reads the one-row kernel prefetches (into the next rows: prefetches
    /// never fault, even past the matrix).
    pub(in crate::backend::cpu) const PREFETCH_BYTES: usize = 4096;

    /// `Σ w·a` over each group of 4 bytes (unsigned `w`, signed `a`) as eight i32 lanes: the same integers on every
    /// level, since `maddubs`' 16-bit pairs cannot saturate with the kernels' operands (|w| ≤ 128, |a| ≤ 127).
    ///
    /// # Safety
    /// The CPU has level `V`'s features (the callers are inlined into entry points that enable them).
    #[inline(always)]
    unsafe fn dot4<const V: u8>(w: __m256i, a: __m256i) -> __m256i {
        // SAFETY: forwarded.
        unsafe {
            match V {
                AVX512_VNNI => _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a),
                AVX_VNNI => _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, a),
                _ => _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)),
            }
        }
    }

    /// One token's share of one sub-block in 256-bit lanes: `acc += cvt(Σ w·a)·scale`; `a` is the token's
    /// activations as loaded. The one-token kernels and the tile (`qgemm::x86`) both take this path, so their
    /// results agree bit for bit.
    ///
    /// # Safety
    /// As for [`dot4`].
    #[inline(always)]
    pub(in crate::backend::cpu) unsafe fn accumulate<const V: u8, const Q: u8>(
        w: &Sub,
        a: __m256i,
        scale: __m256,
        acc: &mut __m256,
    ) {
        // SAFETY: forwarded.
        unsafe {
            // maddubs needs an unsigned operand: move the weights' signs onto a.
            let a = _mm256_sign_epi8(a, w.wq);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4::<V>(w.wabs, a)), scale, *acc);
        }
    }

    /// One sub-block's contribution: `acc += d·da·Σ(w·a)`.
    ///
    /// # Safety
    /// As for [`dot4`].
    #[inline(always)]
    unsafe fn block_dot<const V: u8, const Q: u8>(w: Sub, ab: &Q8Block, acc: &mut __m256) {
        // SAFETY: level V's features are present; activation blocks hold 32 i8.
        unsafe {
            let av = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            accumulate::<V, Q>(&w, av, _mm256_set1_ps(w.d * ab.d), acc);
        }
    }

    /// One activation row against one weight row: `acc += cvt(Σ w·a) · (d_w·d_a)` per sub-block, then
    /// `hsum(acc)`.
    ///
    /// # Safety
    /// As for [`dot4`].
    #[inline(always)]
    unsafe fn dot_quant_one<const V: u8, const Q: u8>(w: &[u8], a: &[Q8Block], blocks: usize) -> f32 {
        assert!(w.len() >= blocks / subs::<Q>() * block_bytes::<Q>() && a.len() >= blocks);
        // SAFETY (whole body): level V's features are present; the assert above keeps every sub-block `b`, and
        // so its block, inside `w` (prefetches may point past it: they never fault).
        unsafe {
            let mut acc = _mm256_setzero_ps();
            for (b, ab) in a.iter().take(blocks).enumerate() {
                _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(sub_offset::<Q>(b) + PREFETCH_BYTES) as *const i8);
                let sub = unpack::<Q>(w.as_ptr(), b);
                block_dot::<V, Q>(sub, ab, &mut acc);
            }
            hsum(acc)
        }
    }

    /// The entry points of one instruction-set level: the shared kernel bodies inlined under that level's
    /// `target_feature`s (a feature enabled on a function lets the compiler use it anywhere inside, so each
    /// level is its own instance, called only once its features are detected).
    macro_rules! level {
        ($module:ident, $level:expr, $features:literal) => {
            pub mod $module {
                use super::*;

                /// [`dot_quant_one`](super) at this level.
                ///
                /// # Safety
                /// The CPU has this level's features; `w` holds `blocks` sub-blocks of layout `Q`.
                #[target_feature(enable = $features)]
                pub unsafe fn dot_one<const Q: u8>(w: &[u8], a: &[Q8Block], blocks: usize) -> f32 {
                    // SAFETY: this function's features are the level's.
                    unsafe { dot_quant_one::<{ $level }, Q>(w, a, blocks) }
                }
            }
        };
    }
    crate::backend::cpu::isa::for_each_level!(level);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `n` values uniform in [-1, 1).
    pub(in crate::backend::cpu) fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn simd_float_dots_match_scalar() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let isa = Isa::detect();
        for n in [1, 7, 8, 33, 100, 576] {
            let (a, b) = (rand_vec(&mut rng, n), rand_vec(&mut rng, n));
            let tol = 1e-4 * n as f32;
            assert!((dot_f32(isa, &a, &b) - dot_f32(Isa::Scalar, &a, &b)).abs() < tol);
        }
    }

    /// Activations of `blocks` 8-bit blocks from random values.
    fn acts(rng: &mut rand::rngs::StdRng, blocks: usize) -> Vec<Q8Block> {
        let mut xq = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; 32] }; blocks];
        quantize_row(Isa::detect(), &rand_vec(rng, blocks * 32), &mut xq);
        xq
    }

    /// Every level quantizes activations to the scalar version's bits: random rows over many magnitudes, rows of
    /// zeros, and rows with NaN and infinities (a broken model's, which must not differ by CPU either).
    #[test]
    fn quantize_row_equals_scalar_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let blocks = 6;
        let mut rows: Vec<Vec<f32>> = (0..40)
            .map(|i| rand_vec(&mut rng, blocks * 32).iter().map(|v| v * 10f32.powi(i % 9 - 4)).collect())
            .collect();
        rows.push(vec![0.0; blocks * 32]);
        rows.push((0..blocks * 32).map(|i| if i % 5 == 0 { -0.0 } else { 1e-40 }).collect());
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut row = rand_vec(&mut rng, blocks * 32);
            for v in row.iter_mut().step_by(7) {
                *v = special;
            }
            rows.push(row);
        }
        let bits = |xq: &[Q8Block]| xq.iter().map(|b| (b.d.to_bits(), b.s.to_bits(), b.qs)).collect::<Vec<_>>();
        for isa in Isa::X86 {
            if !isa.supported() {
                report_not_run(isa, "quantize_row_equals_scalar_bit_for_bit");
                continue;
            }
            for (i, row) in rows.iter().enumerate() {
                let mut want = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; 32] }; blocks];
                let mut got = want.clone();
                for span in [1, 2, 3] {
                    quantize_row_scalar(row, &mut want, span);
                    quantize_row_spans(isa, row, &mut got, span);
                    assert_eq!(bits(&got), bits(&want), "{} row {i}, spans of {span}", isa.name());
                }
            }
        }
    }

    /// Every x86 level this CPU has gives the AVX2 kernels' bits on every format, one row and many (VNNI's
    /// `vpdpbusd` forms the same integer sums as `maddubs` + `madd`); the tile is checked against the one-row
    /// kernel per level in `qgemm`. The levels this CPU lacks are reported as not run.
    #[test]
    fn every_x86_level_equals_avx2_bit_for_bit() {
        if !Isa::Avx2.supported() {
            report_not_run(Isa::Avx2, "every_x86_level_equals_avx2_bit_for_bit");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (blocks, rows) = (24, 13);
        for isa in Isa::X86 {
            if !isa.supported() {
                report_not_run(isa, "every_x86_level_equals_avx2_bit_for_bit");
                continue;
            }
            for f in crate::backend::cpu::kernels::formats() {
                for _ in 0..4 {
                    // Extreme activations too: ±127 everywhere is where 16-bit pair sums come closest to saturating.
                    let mut xq = acts(&mut rng, blocks);
                    for b in xq.iter_mut().step_by(3) {
                        b.qs.iter_mut().enumerate().for_each(|(i, q)| *q = if i % 2 == 0 { 127 } else { -127 });
                    }
                    let w = crate::quant::random_blocks(f.dtype, rows * blocks * 32 / f.block_elems, &mut rng);
                    let row_bytes = w.len() / rows;
                    let (mut want, mut got) = (vec![0f32; rows], vec![0f32; rows]);
                    dot_quant_rows(Isa::Avx2, f.dtype, &w, row_bytes, &xq, blocks, &mut want);
                    dot_quant_rows(isa, f.dtype, &w, row_bytes, &xq, blocks, &mut got);
                    for r in 0..rows {
                        let mut one = [0f32];
                        dot_quant(isa, f.dtype, &w[r * row_bytes..(r + 1) * row_bytes], &xq, blocks, &mut one);
                        let at = format!("{} {} row {r}", isa.name(), f.name);
                        assert_eq!(
                            (got[r].to_bits(), one[0].to_bits()),
                            (want[r].to_bits(), want[r].to_bits()),
                            "{at}"
                        );
                    }
                }
            }
        }
    }

    /// The AVX2 one-row kernel against the scalar oracle (itself checked against the dequantizer in
    /// `kernels`): the same integer sums, so only the float accumulation order differs.
    #[test]
    fn simd_quant_dots_match_scalar() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let isa = Isa::detect();
        let blocks = 24;
        for f in crate::backend::cpu::kernels::formats() {
            for _ in 0..8 {
                let xq = acts(&mut rng, blocks);
                let w = crate::quant::random_blocks(f.dtype, blocks * 32 / f.block_elems, &mut rng);
                let mut fast = [0f32; 1];
                dot_quant(isa, f.dtype, &w, &xq, blocks, &mut fast);
                let slow = dot_quant_scalar(f.dtype, &w, &xq);
                let mut wf = vec![0f32; blocks * 32];
                crate::quant::dequantize(f.dtype, &w, &mut wf);
                let mass: f32 =
                    wf.iter().enumerate().map(|(i, w)| (w * xq[i / 32].d * xq[i / 32].qs[i % 32] as f32).abs()).sum();
                assert!((fast[0] - slow).abs() <= 1e-5 * mass + 1e-6, "{}: simd {} vs scalar {slow}", f.name, fast[0]);
            }
        }
    }
}
