//! The grouped attention kernels of [`super::x86`] with AVX-512's 512-bit registers: the scores of two query heads
//! side by side (a key's 8 columns in both halves of a register, the two heads' queries in its halves), and the
//! weighted sums 16 columns per register. Every lane runs the FMA chain the 256-bit kernels run on it, and the
//! scores are reduced by the same additions (`hadd` as the sum of its even and odd lanes, which is the same
//! addition), so the bits are the 256-bit kernels' — with half the multiply-adds' instructions.

use super::KvView;
use super::x86::{Elem, FourKeys, columns_in, store_run};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// The widest head [`scores`] takes: its packed queries live on the stack.
pub(super) const MAX_WIDTH: usize = 256;

/// Columns (in runs of 8) per pass of [`columns`]: 4 registers of 16 per head, 16 accumulators for 4 heads.
pub(super) const CHUNKS_PER_PASS: usize = 8;

/// `hadd_ps` on each 128-bit lane of two 512-bit registers: `[a0 + a1, a2 + a3, b0 + b1, b2 + b3]`.
///
/// # Safety
/// AVX-512 F.
#[inline(always)]
unsafe fn hadd(a: __m512, b: __m512) -> __m512 {
    // SAFETY: forwarded.
    unsafe { _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(a, b), _mm512_shuffle_ps::<0b11_01_11_01>(a, b)) }
}

/// `x86::group_scores` for a pass of `G` (2 to 4) heads, prefetching rows ahead if `P`: heads `2i` and `2i + 1`
/// in the halves of pair `i`'s registers (an odd last head twice), four keys per pass.
///
/// # Safety
/// AVX-512 F with AVX2, FMA and F16C; as for `x86::group_scores`, with the head width at most [`MAX_WIDTH`].
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn scores<T: Elem, const G: usize, const P: bool>(
    q: &[f32],
    kv: &KvView<'_, T>,
    scale: f32,
    scores: &mut [f32],
) {
    let width = kv.width;
    let (ctx, chunks, pairs) = (scores.len() / G, width / 8, G.div_ceil(2));
    assert!(
        (2..=4).contains(&G) && width <= MAX_WIDTH && q.len() == G * width && scores.len() == G * ctx,
        "group_scores operands do not match"
    );
    let sc = _mm512_set1_ps(scale);
    let mut packed = MaybeUninit::<[__m512; 2 * MAX_WIDTH / 8]>::uninit();
    let qp = packed.as_mut_ptr() as *mut __m512;
    let (mut j, mut keys) = (0, FourKeys::<T, P>::new(kv));
    // SAFETY (whole body): key rows come from the block table and stay inside `k`; q reads stay below q.len();
    // `qp` is written at every index below pairs · chunks before it is read.
    unsafe {
        for i in 0..pairs {
            let (h0, h1) = (2 * i, (2 * i + 1).min(G - 1));
            for c in 0..chunks {
                let lo = _mm256_loadu_pd(q.as_ptr().add(h0 * width + 8 * c).cast());
                let hi = _mm256_loadu_pd(q.as_ptr().add(h1 * width + 8 * c).cast());
                let both = _mm512_insertf64x4::<1>(_mm512_castpd256_pd512(lo), hi);
                qp.add(i * chunks + c).write(_mm512_castpd_ps(both));
            }
        }
        while j < ctx {
            let rows = keys.next(j, ctx);
            let mut acc = [[_mm512_setzero_ps(); 2]; 4];
            for c in 0..chunks {
                // No `array::from_fn` in these loops: it was left a call.
                let mut qc = [_mm512_setzero_ps(); 2];
                for (i, qc) in qc.iter_mut().enumerate().take(pairs) {
                    *qc = *qp.add(i * chunks + c);
                }
                for (a, row) in acc.iter_mut().zip(&rows) {
                    let kc = T::load8x2(row.add(8 * c));
                    for (a, qc) in a.iter_mut().zip(&qc).take(pairs) {
                        *a = _mm512_fmadd_ps(*qc, kc, *a);
                    }
                }
            }
            let n = (ctx - j).min(4);
            for h in (0..G).step_by(2) {
                // `x86`'s reduction of each head's four keys: lanes 0..4 (head h) and 8..12 (head h + 1).
                let i = h / 2;
                let u = hadd(hadd(acc[0][i], acc[1][i]), hadd(acc[2][i], acc[3][i]));
                let sums = _mm512_mul_ps(_mm512_add_ps(u, _mm512_shuffle_f32x4::<0b10_11_00_01>(u, u)), sc);
                store_run(scores, h * ctx + j, n, _mm512_castps512_ps128(sums));
                if h + 1 < G {
                    store_run(scores, (h + 1) * ctx + j, n, _mm512_extractf32x4_ps::<2>(sums));
                }
            }
            j += 4;
        }
    }
}

/// [`columns`] over `pairs` (1 to 4) runs of 16 columns, prefetching as the view asks.
///
/// # Safety
/// As for [`columns`], with `N` = `pairs`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn columns_of<T: Elem, const G: usize>(
    pairs: usize,
    p: &[f32],
    kv: &KvView<'_, T>,
    c0: usize,
    o: &mut [f32],
) {
    // SAFETY: forwarded.
    unsafe {
        match (pairs, kv.prefetch) {
            (1, false) => columns::<T, G, 1, false>(p, kv, c0, o),
            (2, false) => columns::<T, G, 2, false>(p, kv, c0, o),
            (3, false) => columns::<T, G, 3, false>(p, kv, c0, o),
            (_, false) => columns::<T, G, 4, false>(p, kv, c0, o),
            (1, true) => columns::<T, G, 1, true>(p, kv, c0, o),
            (2, true) => columns::<T, G, 2, true>(p, kv, c0, o),
            (3, true) => columns::<T, G, 3, true>(p, kv, c0, o),
            (_, true) => columns::<T, G, 4, true>(p, kv, c0, o),
        }
    }
}

/// `x86::group_weighted_columns` for a pass of `G` (2 to 4) heads over columns `c0..c0 + 16·N`, prefetching rows
/// ahead if `P`: per column the same sequential FMA chain over the positions.
///
/// # Safety
/// AVX-512 F with AVX2, FMA and F16C; as for `x86::group_weighted_columns`, with `c0 + 16·N` within the head.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn columns<T: Elem, const G: usize, const N: usize, const P: bool>(
    p: &[f32],
    kv: &KvView<'_, T>,
    c0: usize,
    o: &mut [f32],
) {
    // SAFETY: forwarded; this function's features are the 512-bit registers'.
    unsafe { columns_in::<__m512, T, G, N, P>(p, kv, c0, o) }
}
