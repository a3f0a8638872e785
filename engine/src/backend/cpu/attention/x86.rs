//! The AVX2 kernels of attention: scores and weighted sums over a head's cached rows, for one query head or
//! for all query heads of a KV head at once, over f32, f16 or bf16 caches.

use super::{KvView, wide};
use half::{bf16, f16};
use std::arch::x86_64::*;

/// A cache element type the kernels below read, eight values at a time as f32.
pub trait Elem: Copy {
    /// # Safety
    /// AVX2 and F16C available; `p` points at eight readable values.
    unsafe fn load8(p: *const Self) -> __m256;

    /// [`Self::load8`] in both 256-bit halves of a 512-bit register.
    ///
    /// # Safety
    /// AVX-512 F and F16C available; `p` points at eight readable values.
    unsafe fn load8x2(p: *const Self) -> __m512;

    /// Sixteen values as f32, converted as [`Self::load8`] converts them.
    ///
    /// # Safety
    /// AVX-512 F available; `p` points at sixteen readable values.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: forwarded.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load8x2(p: *const f32) -> __m512 {
        // SAFETY: forwarded.
        unsafe { _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(p.cast()))) }
    }

    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: forwarded.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Elem for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: forwarded; f16 → f32 is exact, as `half`'s conversion is.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    #[inline(always)]
    unsafe fn load8x2(p: *const f16) -> __m512 {
        // SAFETY: forwarded; the 8 halves in both 128-bit lanes, then converted at once.
        unsafe { _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()))) }
    }

    #[inline(always)]
    unsafe fn load16(p: *const f16) -> __m512 {
        // SAFETY: forwarded.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

impl Elem for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        // SAFETY: forwarded. A bf16 is the high half of the f32 with the same bits: widen, shift, reinterpret
        // (exact, as `half`'s conversion is).
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))) }
    }

    #[inline(always)]
    unsafe fn load8x2(p: *const bf16) -> __m512 {
        // SAFETY: forwarded; as `load8`, on the 8 values in both halves.
        unsafe { bf16_bits(_mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()))) }
    }

    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> __m512 {
        // SAFETY: forwarded.
        unsafe { bf16_bits(_mm256_loadu_si256(p.cast())) }
    }
}

/// Sixteen bf16 as the f32 with the same high bits.
///
/// # Safety
/// AVX-512 F.
#[inline(always)]
unsafe fn bf16_bits(v: __m256i) -> __m512 {
    // SAFETY: forwarded.
    unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v))) }
}

/// Positions ahead of the one being read whose rows are prefetched: rows of one head are a few cache lines
/// spread a cached row's width apart (and a block apart at block edges), which the hardware prefetchers do not
/// follow far enough ahead; without this the kernels below wait on memory at long contexts.
pub(super) const AHEAD: usize = 16;

/// Asks for the cache lines of `bytes` bytes from `p` (any alignment) to be brought into L1.
#[inline(always)]
pub(super) unsafe fn prefetch(p: *const u8, bytes: usize) {
    let first = p as usize & !63;
    let mut line = first;
    while line < p as usize + bytes {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
        line += 64;
    }
}

/// `scores[j] = (q · k_j) · scale` for every position, eight keys at a time: eight independent FMA chains
/// instead of one (a 64-wide dot is otherwise one long dependency chain) and one shared reduction.
///
/// # Safety
/// AVX2/FMA available, `q.len()` a multiple of 8, every position below `scores.len()` cached.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scores<T: Elem>(q: &[f32], kv: &KvView<'_, T>, scale: f32, scores: &mut [f32]) {
    let ctx = scores.len();
    let k = kv.k.as_ptr();
    let sc = _mm256_set1_ps(scale);
    let (mut j, mut offsets, mut at) = (0, kv.rows(), 0);
    // SAFETY (whole body): offsets come from the block table and stay inside `k`; q reads stay below q.len().
    unsafe {
        while j < ctx {
            // Past the end, the last key is reused; those lanes are dropped.
            let mut rows = [k; 8];
            for (i, row) in rows.iter_mut().enumerate() {
                if j + i < ctx {
                    at = offsets.next().unwrap_or(at);
                }
                *row = k.add(at);
            }
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..q.len()).step_by(8) {
                let qc = _mm256_loadu_ps(q.as_ptr().add(c));
                for (a, row) in acc.iter_mut().zip(&rows) {
                    *a = _mm256_fmadd_ps(qc, T::load8(row.add(c)), *a);
                }
            }
            // Horizontal sums of the eight accumulators, lane i = key j + i. Every key goes through the same
            // additions whichever lane it lands in.
            let u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            let u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
            let sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            let n = (ctx - j).min(8);
            if n == 8 {
                _mm256_storeu_ps(scores.as_mut_ptr().add(j), _mm256_mul_ps(sums, sc));
            } else {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(sums, sc));
                scores[j..j + n].copy_from_slice(&lanes[..n]);
            }
            j += 8;
        }
    }
}

/// [`scores`] for the `group` query heads of one KV head at once (`q`: their rows back to back; `scores`:
/// `group` runs of the context's length), four keys per pass so that the heads' accumulators stay in registers:
/// a group of more than [`HEADS_PER_PASS`] heads in passes of at most that many ([`passes`]); with `wide`, two
/// heads per 512-bit register ([`super::wide::scores`]). Each key's dot product is the same FMA chain over the
/// columns, reduced by the same additions (the pairs of `hadd` and the halves' sum that [`scores`] gives every
/// lane), and scaled the same: the bits of [`scores`] head by head.
///
/// # Safety
/// As for [`scores`], with `q.len()` = `group` · the head width and `group` at least 2; with `wide`, AVX-512 F.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_scores<T: Elem>(
    wide: bool,
    group: usize,
    q: &[f32],
    kv: &KvView<'_, T>,
    scale: f32,
    scores: &mut [f32],
) {
    let (width, ctx) = (kv.width, scores.len() / group.max(1));
    assert!(
        group >= 2 && q.len() == group * width && scores.len() == group * ctx,
        "group_scores operands do not match"
    );
    let wide = wide && width <= wide::MAX_WIDTH;
    for heads in passes(group) {
        let q = &q[heads.start * width..heads.end * width];
        let scores = &mut scores[heads.start * ctx..heads.end * ctx];
        // SAFETY: forwarded (AVX-512 F with `wide`).
        unsafe {
            match (wide, heads.len(), kv.prefetch) {
                (false, 2, false) => scores_of::<T, 2, false>(q, kv, scale, scores),
                (false, 3, false) => scores_of::<T, 3, false>(q, kv, scale, scores),
                (false, _, false) => scores_of::<T, 4, false>(q, kv, scale, scores),
                (false, 2, true) => scores_of::<T, 2, true>(q, kv, scale, scores),
                (false, 3, true) => scores_of::<T, 3, true>(q, kv, scale, scores),
                (false, _, true) => scores_of::<T, 4, true>(q, kv, scale, scores),
                (true, 2, false) => wide::scores::<T, 2, false>(q, kv, scale, scores),
                (true, 3, false) => wide::scores::<T, 3, false>(q, kv, scale, scores),
                (true, _, false) => wide::scores::<T, 4, false>(q, kv, scale, scores),
                (true, 2, true) => wide::scores::<T, 2, true>(q, kv, scale, scores),
                (true, 3, true) => wide::scores::<T, 3, true>(q, kv, scale, scores),
                (true, _, true) => wide::scores::<T, 4, true>(q, kv, scale, scores),
            }
        }
    }
}

/// Query heads one pass of the grouped kernels holds in registers.
const HEADS_PER_PASS: usize = 4;

/// A group of query heads in passes of 2 to [`HEADS_PER_PASS`] heads, as even as possible (5 as 2 + 3, 7 as 3 +
/// 4, 8 as 4 + 4): GQA groups of 5 to 8 (Llama 2 and 3 70B, TinyLlama, Qwen2.5 7B) read each cached row twice
/// instead of once per head.
pub fn passes(group: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let n = group.div_ceil(HEADS_PER_PASS);
    (0..n).map(move |i| i * group / n..(i + 1) * group / n)
}

/// A head's cached key rows four positions at a time, for the grouped scores: past the context's end the last row
/// again (those lanes are dropped), and with `P` the rows [`AHEAD`] positions on prefetched.
pub(super) struct FourKeys<'a, T, const P: bool> {
    k: *const T,
    offsets: super::RowOffsets<'a>,
    later: Option<std::iter::Skip<super::RowOffsets<'a>>>,
    at: usize,
    row_bytes: usize,
}

impl<'a, T, const P: bool> FourKeys<'a, T, P> {
    pub(super) fn new(kv: &'a KvView<'a, T>) -> Self {
        let later = if P { kv.lookahead(AHEAD) } else { None };
        let row_bytes = kv.width * std::mem::size_of::<T>();
        FourKeys { k: kv.k.as_ptr(), offsets: kv.rows(), later, at: 0, row_bytes }
    }

    /// The rows of positions `j..j + 4` (`j` a multiple of 4, walked in order), `ctx` the context's length.
    ///
    /// # Safety
    /// Every position below `ctx` cached (the block table's offsets stay inside the keys).
    #[inline(always)]
    pub(super) unsafe fn next(&mut self, j: usize, ctx: usize) -> [*const T; 4] {
        // A loop, not `array::from_fn`, which was left a call in the kernels' hot loop.
        let mut rows = [self.k; 4];
        for (i, row) in rows.iter_mut().enumerate() {
            if j + i < ctx {
                self.at = self.offsets.next().unwrap_or(self.at);
                if P && let Some(later) = self.later.as_mut()
                    && let Some(next) = later.next()
                {
                    // SAFETY: a prefetch never faults.
                    unsafe { prefetch(self.k.wrapping_add(next).cast(), self.row_bytes) };
                }
            }
            // SAFETY: the caller's; `at` is a cached row's offset.
            *row = unsafe { self.k.add(self.at) };
        }
        rows
    }
}

/// `scores[at..at + n]` from the first `n` (at most 4) lanes of `v`: one store for a full run of keys, a copy
/// through the stack for the context's last, shorter one (a copy of `n` lanes is a call to memmove, too dear for
/// every run).
#[inline(always)]
pub(super) fn store_run(scores: &mut [f32], at: usize, n: usize, v: __m128) {
    let dst = &mut scores[at..at + n];
    if n == 4 {
        // SAFETY: `dst` holds 4 floats; SSE is part of every x86-64 CPU.
        unsafe { _mm_storeu_ps(dst.as_mut_ptr(), v) };
    } else {
        let mut lanes = [0f32; 4];
        // SAFETY: as above, into a local array of 4.
        unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), v) };
        dst.copy_from_slice(&lanes[..n]);
    }
}

/// [`group_scores`] for `G` heads, prefetching rows ahead if `P`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_of<T: Elem, const G: usize, const P: bool>(
    q: &[f32],
    kv: &KvView<'_, T>,
    scale: f32,
    scores: &mut [f32],
) {
    let width = kv.width;
    let ctx = scores.len() / G;
    assert!(q.len() == G * width && scores.len() == G * ctx, "group_scores operands do not match");
    let sc = _mm_set1_ps(scale);
    let (mut j, mut keys) = (0, FourKeys::<T, P>::new(kv));
    // SAFETY (whole body): key rows come from the block table and stay inside `k`; q reads stay below q.len().
    unsafe {
        while j < ctx {
            let rows = keys.next(j, ctx);
            let mut acc = [[_mm256_setzero_ps(); 4]; G];
            for c in (0..width).step_by(8) {
                let mut qc = [_mm256_setzero_ps(); G];
                for (g, qc) in qc.iter_mut().enumerate() {
                    *qc = _mm256_loadu_ps(q.as_ptr().add(g * width + c));
                }
                for (i, row) in rows.iter().enumerate() {
                    let kc = T::load8(row.add(c));
                    for (a, qc) in acc.iter_mut().zip(&qc) {
                        a[i] = _mm256_fmadd_ps(*qc, kc, a[i]);
                    }
                }
            }
            let n = (ctx - j).min(4);
            for (g, a) in acc.iter().enumerate() {
                // Lanes 0..4 of `scores`' reduction: each key's low half plus its high half.
                let u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                let sums = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps::<1>(u)), sc);
                store_run(scores, g * ctx + j, n, sums);
            }
            j += 4;
        }
    }
}

/// [`weighted_sum`] for the `group` query heads of one KV head at once (`p`: their probabilities, runs of the
/// context's length; `o`: their outputs back to back): each value row is read once for every pass of heads
/// ([`passes`]) and of columns, and each column of each head is the same sequential FMA chain, so the same bits.
///
/// # Safety
/// As for [`weighted_sum`], with `o.len()` = `group` · the head width and `group` at least 2; with `wide`,
/// AVX-512 F.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_weighted_sum<T: Elem>(wide: bool, group: usize, p: &[f32], kv: &KvView<'_, T>, o: &mut [f32]) {
    let (width, per_pass) = (kv.width, columns_per_pass(wide, group));
    let mut c0 = 0;
    while c0 < width {
        let chunks = ((width - c0) / 8).min(per_pass);
        if chunks == 0 {
            break; // not reached: the width is a multiple of 8
        }
        // SAFETY: forwarded; columns c0..c0 + 8·chunks lie in the head.
        unsafe { group_weighted_columns(wide, group, p, kv, c0, chunks, o) };
        c0 += 8 * chunks;
    }
}

/// Columns per pass of [`group_weighted_sum`], in groups of 8: as many as twelve 256-bit accumulators hold for the
/// largest pass of heads, or with `wide` 16 of 512 bits.
pub fn columns_per_pass(wide: bool, group: usize) -> usize {
    if wide { wide::CHUNKS_PER_PASS } else { 12 / group.clamp(2, HEADS_PER_PASS) }
}

/// Columns `c0..c0 + 8·chunks` of every head of [`group_weighted_sum`] (the rest of `o` untouched), `chunks` at
/// most [`columns_per_pass`]: the same chains, so any split of the columns gives the same bits (with `wide`, the
/// pairs of runs of 8 in 512-bit registers, an odd last one in a 256-bit register).
///
/// # Safety
/// As for [`group_weighted_sum`], with `c0 + 8·chunks` within the head width.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_weighted_columns<T: Elem>(
    wide: bool,
    group: usize,
    p: &[f32],
    kv: &KvView<'_, T>,
    c0: usize,
    chunks: usize,
    o: &mut [f32],
) {
    assert!(
        group >= 2
            && o.len() == group * kv.width
            && p.len().is_multiple_of(group)
            && c0 + 8 * chunks <= kv.width
            && chunks <= columns_per_pass(wide, group),
        "group_weighted_sum operands do not match"
    );
    let (width, ctx) = (kv.width, p.len() / group);
    let (pairs, narrow) = if wide { (chunks / 2, chunks % 2) } else { (0, chunks) };
    for heads in passes(group) {
        let p = &p[heads.start * ctx..heads.end * ctx];
        let o = &mut o[heads.start * width..heads.end * width];
        // SAFETY: forwarded (AVX-512 F with `wide`); the wide columns are c0..c0 + 16·pairs, the rest after them.
        unsafe {
            if pairs > 0 {
                match heads.len() {
                    2 => wide::columns_of::<T, 2>(pairs, p, kv, c0, o),
                    3 => wide::columns_of::<T, 3>(pairs, p, kv, c0, o),
                    _ => wide::columns_of::<T, 4>(pairs, p, kv, c0, o),
                }
            }
            let c0 = c0 + 16 * pairs;
            match (heads.len(), kv.prefetch) {
                (2, false) => columns_of::<T, 2, false>(p, kv, c0, narrow, o),
                (3, false) => columns_of::<T, 3, false>(p, kv, c0, narrow, o),
                (_, false) => columns_of::<T, 4, false>(p, kv, c0, narrow, o),
                (2, true) => columns_of::<T, 2, true>(p, kv, c0, narrow, o),
                (3, true) => columns_of::<T, 3, true>(p, kv, c0, narrow, o),
                (_, true) => columns_of::<T, 4, true>(p, kv, c0, narrow, o),
            }
        }
    }
}

/// [`group_weighted_columns`] for `G` heads, prefetching rows ahead if `P`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns_of<T: Elem, const G: usize, const P: bool>(
    p: &[f32],
    kv: &KvView<'_, T>,
    c0: usize,
    chunks: usize,
    o: &mut [f32],
) {
    // SAFETY: forwarded.
    unsafe {
        match chunks {
            0 => {}
            1 => group_columns::<T, G, 1, P>(p, kv, c0, o),
            2 => group_columns::<T, G, 2, P>(p, kv, c0, o),
            3 => group_columns::<T, G, 3, P>(p, kv, c0, o),
            4 => group_columns::<T, G, 4, P>(p, kv, c0, o),
            5 => group_columns::<T, G, 5, P>(p, kv, c0, o),
            _ => group_columns::<T, G, 6, P>(p, kv, c0, o),
        }
    }
}

/// Columns `c0..c0 + 8·N` of every head of [`group_weighted_sum`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_columns<T: Elem, const G: usize, const N: usize, const P: bool>(
    p: &[f32],
    kv: &KvView<'_, T>,
    c0: usize,
    o: &mut [f32],
) {
    // SAFETY: forwarded; this function's features are the 256-bit registers'.
    unsafe { columns_in::<__m256, T, G, N, P>(p, kv, c0, o) }
}

/// A register of f32 lanes the weighted sums accumulate in: 256 bits, or 512 ([`super::wide`]).
pub(super) trait Lanes: Copy {
    /// Lanes per register.
    const LANES: usize;

    /// # Safety
    /// The register's instruction set (AVX, or AVX-512 F) available; so for every method below.
    unsafe fn zero() -> Self;

    unsafe fn splat(x: f32) -> Self;

    /// # Safety
    /// As above, and F16C; `p` points at [`Self::LANES`] readable values.
    unsafe fn load<T: Elem>(p: *const T) -> Self;

    /// `a · b + c`.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;

    /// # Safety
    /// As above; `p` points at [`Self::LANES`] writable floats.
    unsafe fn store(self, p: *mut f32);
}

impl Lanes for __m256 {
    const LANES: usize = 8;

    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY (each method): the caller's instruction set and pointers.
        unsafe { _mm256_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { _mm256_set1_ps(x) }
    }

    #[inline(always)]
    unsafe fn load<T: Elem>(p: *const T) -> Self {
        unsafe { T::load8(p) }
    }

    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm256_storeu_ps(p, self) }
    }
}

impl Lanes for __m512 {
    const LANES: usize = 16;

    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY (each method): the caller's instruction set and pointers.
        unsafe { _mm512_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { _mm512_set1_ps(x) }
    }

    #[inline(always)]
    unsafe fn load<T: Elem>(p: *const T) -> Self {
        unsafe { T::load16(p) }
    }

    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm512_storeu_ps(p, self) }
    }
}

/// Columns `c0..c0 + N·R::LANES` of `G` heads of [`group_weighted_sum`] in registers `R`: per column a sequential
/// FMA chain over the positions, whatever the register's width.
///
/// # Safety
/// `R`'s instruction set; otherwise as for [`group_weighted_columns`], with the columns within the head.
#[inline(always)]
pub(super) unsafe fn columns_in<R: Lanes, T: Elem, const G: usize, const N: usize, const P: bool>(
    p: &[f32],
    kv: &KvView<'_, T>,
    c0: usize,
    o: &mut [f32],
) {
    let (v, width, ctx) = (kv.v.as_ptr(), kv.width, p.len() / G);
    assert!(o.len() == G * width && c0 + N * R::LANES <= width, "group_weighted_sum operands do not match");
    // SAFETY (whole body): offsets come from the block table; columns stay below the head width, positions below
    // ctx; the caller's instruction set.
    unsafe {
        let mut acc = [[R::zero(); N]; G];
        let mut later = if P { kv.lookahead(AHEAD) } else { None };
        for (j, at) in kv.rows().take(ctx).enumerate() {
            if P && let Some(later) = later.as_mut()
                && let Some(next) = later.next()
            {
                prefetch(v.wrapping_add(next + c0).cast(), N * R::LANES * std::mem::size_of::<T>());
            }
            let row = v.add(at + c0);
            let mut pv = [R::zero(); G];
            for (g, pv) in pv.iter_mut().enumerate() {
                *pv = R::splat(*p.get_unchecked(g * ctx + j));
            }
            for c in 0..N {
                let vc = R::load(row.add(R::LANES * c));
                for (a, pv) in acc.iter_mut().zip(&pv) {
                    a[c] = R::fma(*pv, vc, a[c]);
                }
            }
        }
        for (g, head) in acc.iter().enumerate() {
            for (c, a) in head.iter().enumerate() {
                a.store(o.as_mut_ptr().add(g * width + c0 + R::LANES * c));
            }
        }
    }
}

/// `o = Σ_j p_j · v_j`, 64 columns at a time held in registers across all positions.
///
/// # Safety
/// As for [`scores`], with `o.len()` the head width.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn weighted_sum<T: Elem>(p: &[f32], kv: &KvView<'_, T>, o: &mut [f32]) {
    // SAFETY: forwarded; each call covers columns c0..c0 + 8·N < o.len().
    unsafe {
        let mut c0 = 0;
        while c0 < o.len() {
            match (o.len() - c0) / 8 {
                1 => columns::<T, 1>(p, kv, c0, o),
                2 => columns::<T, 2>(p, kv, c0, o),
                3 => columns::<T, 3>(p, kv, c0, o),
                4 => columns::<T, 4>(p, kv, c0, o),
                5 => columns::<T, 5>(p, kv, c0, o),
                6 => columns::<T, 6>(p, kv, c0, o),
                7 => columns::<T, 7>(p, kv, c0, o),
                _ => columns::<T, 8>(p, kv, c0, o),
            }
            c0 += 64;
        }
    }
}

/// Columns `c0..c0 + 8·N` of [`weighted_sum`]: per column, a sequential FMA chain over the positions.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns<T: Elem, const N: usize>(p: &[f32], kv: &KvView<'_, T>, c0: usize, o: &mut [f32]) {
    let v = kv.v.as_ptr();
    let mut acc = [_mm256_setzero_ps(); N];
    // SAFETY: offsets come from the block table; columns stay below the head width.
    unsafe {
        for (&pj, at) in p.iter().zip(kv.rows()) {
            let row = v.add(at + c0);
            let pv = _mm256_set1_ps(pj);
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(pv, T::load8(row.add(8 * c)), *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * c), *a);
        }
    }
}
