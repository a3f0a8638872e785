//! Causal grouped-query attention over a paged KV cache. An f32 cache is read in place, and so are f16 and bf16
//! ones where the CPU converts them in registers (AVX2 with F16C); q8_0 is first converted to f32 one head at a
//! time (see [`HEAD_KV`]). All run the same f32 arithmetic, so a cache's type decides the bits, not the path.

use std::cell::RefCell;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use half::{bf16, f16};

use super::exp;
use super::simd::{self, Isa};
use super::{CpuKvLayer, CpuTensor};
use crate::backend::{AttnSeq, AttnShape};

/// Query rows of one sequence handled by one task: long prompts split over the threads, decode rows stay whole.
const ROWS_PER_TASK: usize = 16;

thread_local! {
    /// One head's keys and values converted to f32 (positions × head width each) when the cache stores another
    /// type; kept per thread so decode steps reuse it instead of allocating.
    static HEAD_KV: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// One sequence's keys and values for one KV head (f32, or f16/bf16 read in place), addressed by position
/// through a block table.
struct KvView<'a, T = f32> {
    k: &'a [T],
    v: &'a [T],
    blocks: &'a [u32],
    block_size: usize,
    /// Elements from one cached row to the next.
    stride: usize,
    /// Offset of the head inside a cached row.
    head: usize,
}

impl<'a, T> KvView<'a, T> {
    /// The head's rows in a cache read in place.
    fn paged(cache: &'a CpuKvLayer, k: &'a [T], v: &'a [T], blocks: &'a [u32], head: usize) -> Self {
        KvView { k, v, blocks, block_size: cache.block_size, stride: cache.kv_dim, head }
    }
}

impl<'a> KvView<'a> {
    /// Rows of `head_dim` back to back, position `j` at `j × head_dim`: one block as long as any context.
    fn dense(k: &'a [f32], v: &'a [f32], head_dim: usize) -> Self {
        KvView { k, v, blocks: &[0], block_size: usize::MAX, stride: head_dim, head: 0 }
    }
}

impl<T> KvView<'_, T> {
    /// Indices in `k`/`v` of the head's rows for positions 0, 1, 2, ... in order, walking the block table: the
    /// kernels read every cached row, and finding each one by dividing its position by the block size cost more
    /// than its arithmetic.
    fn rows(&self) -> RowOffsets<'_> {
        let KvView { blocks, block_size, stride, head, .. } = *self;
        RowOffsets { blocks, block_size, stride, head, block: 0, within: 0 }
    }
}

/// [`KvView::rows`]: ends where the block table does.
struct RowOffsets<'a> {
    blocks: &'a [u32],
    block_size: usize,
    stride: usize,
    head: usize,
    block: usize,
    within: usize,
}

impl Iterator for RowOffsets<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.within == self.block_size {
            self.block += 1;
            self.within = 0;
        }
        let slot = *self.blocks.get(self.block)? as usize * self.block_size + self.within;
        self.within += 1;
        Some(slot * self.stride + self.head)
    }
}

/// A run of up to [`ROWS_PER_TASK`] query rows of sequence `si`, for the query heads `g0..` of KV head `kvh`.
#[derive(Clone, Copy)]
struct AttnTask {
    si: usize,
    kvh: usize,
    t0: usize,
    rows: usize,
    g0: usize,
}

/// Runs attention for every (sequence, query head); the cache must already hold the new keys/values.
/// Each output row depends only on its query and the cached rows it attends to, computed the same way whatever
/// else is in the batch or how a prompt is chunked.
pub fn attend(isa: Isa, q: &CpuTensor, cache: &CpuKvLayer, seqs: &[AttnSeq<'_>], shape: AttnShape) -> CpuTensor {
    let AttnShape { num_heads, num_kv_heads, head_dim, .. } = shape;
    let group = num_heads / num_kv_heads;
    let q_dim = num_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    // One task per (sequence, KV head, run of query rows): the query heads sharing a KV head read its rows while
    // they are in cache. With fewer such tasks than twice the threads (decoding a small batch: SmolLM2 has 3 KV
    // heads, so 2 threads would split 2 + 1) a cache read in place gives its query heads a task each instead; any
    // other keeps them together, as each task converts its KV head's rows first.
    let runs: usize = seqs.iter().map(|s| s.len.div_ceil(ROWS_PER_TASK)).sum::<usize>() * num_kv_heads;
    let half_in_place = half_in_place(isa, head_dim);
    let in_place = cache.as_f32().is_some() || half_in_place && (cache.as_f16().is_some() || cache.as_bf16().is_some());
    let heads_per_task = if runs < 2 * rayon::current_num_threads() && in_place { 1 } else { group };
    let tasks: Vec<AttnTask> = seqs
        .iter()
        .enumerate()
        .flat_map(|(si, s)| {
            (0..num_kv_heads).flat_map(move |kvh| {
                (0..s.len).step_by(ROWS_PER_TASK).flat_map(move |t0| {
                    let rows = (s.len - t0).min(ROWS_PER_TASK);
                    (0..group).step_by(heads_per_task).map(move |g0| AttnTask { si, kvh, t0, rows, g0 })
                })
            })
        })
        .collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&AttnTask { si, kvh, t0, rows: n, g0 }| {
            let s = &seqs[si];
            let rows = |kv: Src<'_>| {
                let mut out = vec![0f32; n * heads_per_task * head_dim];
                let mut scores = Vec::with_capacity(s.start_pos + s.len);
                for t in 0..n {
                    let ctx = s.start_pos + t0 + t + 1;
                    for g in 0..heads_per_task {
                        let h = kvh * group + g0 + g;
                        let qrow = &q.data[(s.row + t0 + t) * q_dim + h * head_dim..][..head_dim];
                        let o = &mut out[(t * heads_per_task + g) * head_dim..][..head_dim];
                        match &kv {
                            Src::F32(kv) => one_head(isa, qrow, kv, ctx, scale, &mut scores, o),
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: a view of f16 is only made where `half_in_place` found AVX2 and F16C.
                            Src::F16(kv) => unsafe { one_head_in_registers(qrow, kv, ctx, scale, &mut scores, o) },
                            #[cfg(target_arch = "x86_64")]
                            // SAFETY: as for f16.
                            Src::Bf16(kv) => unsafe { one_head_in_registers(qrow, kv, ctx, scale, &mut scores, o) },
                        }
                    }
                }
                out
            };
            if let Some((k, v)) = cache.as_f32() {
                return rows(Src::F32(KvView::paged(cache, k, v, s.blocks, kvh * head_dim)));
            }
            #[cfg(target_arch = "x86_64")]
            if half_in_place {
                if let Some((k, v)) = cache.as_f16() {
                    return rows(Src::F16(KvView::paged(cache, k, v, s.blocks, kvh * head_dim)));
                }
                if let Some((k, v)) = cache.as_bf16() {
                    return rows(Src::Bf16(KvView::paged(cache, k, v, s.blocks, kvh * head_dim)));
                }
            }
            HEAD_KV.with_borrow_mut(|(k, v)| {
                cache.read_head(s.blocks, kvh * head_dim, head_dim, s.start_pos + t0 + n, k, v);
                rows(Src::F32(KvView::dense(k, v, head_dim)))
            })
        })
        .collect();
    let mut data = vec![0f32; q.rows * q_dim];
    for (&AttnTask { si, kvh, t0, rows: n, g0 }, out) in tasks.iter().zip(results) {
        let row0 = seqs[si].row + t0;
        for t in 0..n {
            let dst = &mut data[(row0 + t) * q_dim + (kvh * group + g0) * head_dim..][..heads_per_task * head_dim];
            dst.copy_from_slice(&out[t * heads_per_task * head_dim..][..heads_per_task * head_dim]);
        }
    }
    CpuTensor { data, rows: q.rows, cols: q_dim }
}

/// Softmax-weighted sum of the first `ctx` value rows for one query row of one head.
fn one_head(isa: Isa, qrow: &[f32], kv: &KvView<'_>, ctx: usize, scale: f32, scores: &mut Vec<f32>, o: &mut [f32]) {
    let head_dim = qrow.len();
    scores.clear();
    scores.resize(ctx, 0.0);
    #[cfg(target_arch = "x86_64")]
    let fast = isa.avx2() && head_dim.is_multiple_of(8);
    #[cfg(not(target_arch = "x86_64"))]
    let fast = false;
    if fast {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2/FMA were detected; every position below ctx has a row of head_dim floats (a paged view's
        // block table covers start_pos + len positions, checked by `CpuKvLayer::write`; a dense view holds ctx).
        unsafe {
            x86::scores(qrow, kv, scale, scores)
        };
    } else {
        for (sc, at) in scores.iter_mut().zip(kv.rows()) {
            *sc = simd::dot_f32(isa, qrow, &kv.k[at..][..head_dim]) * scale;
        }
    }
    softmax(isa, scores);
    if fast {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as for `scores`.
        unsafe {
            x86::weighted_sum(scores, kv, o)
        };
    } else {
        o.fill(0.0);
        for (&p, at) in scores.iter().zip(kv.rows()) {
            simd::axpy(isa, p, &kv.v[at..][..head_dim], o);
        }
    }
}

/// Scores into probabilities, in place.
fn softmax(isa: Isa, scores: &mut [f32]) {
    exp::exp_from_max(isa, scores);
    let mut denom = 0f32;
    for sc in scores.iter() {
        denom += *sc;
    }
    for sc in scores.iter_mut() {
        *sc /= denom;
    }
}

/// [`one_head`]'s fast path over an f16 or bf16 cache, converting keys and values in registers: the same f32
/// arithmetic on the same (exactly converted) values as converting the head first, so the same bits.
///
/// # Safety
/// AVX2, FMA and F16C available; `qrow.len()` a multiple of 8; every position below `ctx` cached.
#[cfg(target_arch = "x86_64")]
unsafe fn one_head_in_registers<T: x86::Elem>(
    qrow: &[f32],
    kv: &KvView<'_, T>,
    ctx: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    scores.clear();
    scores.resize(ctx, 0.0);
    // SAFETY: forwarded from the caller.
    unsafe { x86::scores(qrow, kv, scale, scores) };
    softmax(Isa::Avx2, scores);
    // SAFETY: as above.
    unsafe { x86::weighted_sum(scores, kv, o) };
}

/// Whether an f16 or bf16 cache can be read in place: [`one_head_in_registers`]'s conditions.
fn half_in_place(isa: Isa, head_dim: usize) -> bool {
    cfg!(target_arch = "x86_64") && isa.avx2() && head_dim.is_multiple_of(8)
}

/// The cache a task reads: f32 (in place or converted), or f16/bf16 in place.
enum Src<'a> {
    F32(KvView<'a>),
    #[cfg(target_arch = "x86_64")]
    F16(KvView<'a, f16>),
    #[cfg(target_arch = "x86_64")]
    Bf16(KvView<'a, bf16>),
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::KvView;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// A cache element type the kernels below read, eight values at a time as f32.
    pub trait Elem: Copy {
        /// # Safety
        /// AVX2 and F16C available; `p` points at eight readable values.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Elem for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: forwarded.
            unsafe { _mm256_loadu_ps(p) }
        }
    }

    impl Elem for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const f16) -> __m256 {
            // SAFETY: forwarded; f16 → f32 is exact, as `half`'s conversion is.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
    }

    impl Elem for bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const bf16) -> __m256 {
            // SAFETY: forwarded. A bf16 is the high half of the f32 with the same bits: widen, shift, reinterpret
            // (exact, as `half`'s conversion is).
            unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))) }
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
                let rows: [*const T; 8] = std::array::from_fn(|i| {
                    if j + i < ctx {
                        at = offsets.next().unwrap_or(at);
                    }
                    k.add(at)
                });
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
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(sums, sc));
                let n = (ctx - j).min(8);
                scores[j..j + n].copy_from_slice(&lanes[..n]);
                j += 8;
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
}

#[cfg(test)]
mod tests {
    use super::super::kv::KvStore;
    use super::*;
    use crate::KvDtype;
    use half::{bf16, f16};
    use rand::{Rng, SeedableRng};

    /// A cache of `blocks` blocks of random keys/values and a shuffled block table covering all of them.
    fn setup(rng: &mut rand::rngs::StdRng, shape: AttnShape, blocks: usize) -> (CpuKvLayer, Vec<u32>) {
        let kv_dim = shape.num_kv_heads * shape.head_dim;
        let n = blocks * shape.block_size * kv_dim;
        let mut rand = |n| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<f32>>();
        let cache =
            CpuKvLayer { k: KvStore::F32(rand(n)), v: KvStore::F32(rand(n)), kv_dim, block_size: shape.block_size };
        let mut table: Vec<u32> = (0..blocks as u32).collect();
        table.reverse();
        table.swap(0, blocks / 2);
        (cache, table)
    }

    fn queries(rng: &mut rand::rngs::StdRng, rows: usize, shape: AttnShape) -> CpuTensor {
        let cols = shape.num_heads * shape.head_dim;
        CpuTensor { data: (0..rows * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect(), rows, cols }
    }

    #[test]
    fn simd_attention_matches_scalar() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        // 64 (SmolLM2), 128 (two column passes), 24 (a partial pass); GQA groups of 3 and 1.
        for (heads, kv_heads, head_dim) in [(9, 3, 64), (4, 2, 128), (2, 2, 24)] {
            let shape = AttnShape { num_heads: heads, num_kv_heads: kv_heads, head_dim, block_size: 16 };
            let (cache, table) = setup(&mut rng, shape, 6);
            // A 37-token prefill (three row runs) after 20 cached positions, and a one-token decode step.
            let seqs = [
                AttnSeq { row: 0, len: 37, start_pos: 20, blocks: &table[..4] },
                AttnSeq { row: 37, len: 1, start_pos: 90, blocks: &table },
            ];
            let q = queries(&mut rng, 38, shape);
            let fast = attend(Isa::detect(), &q, &cache, &seqs, shape);
            let slow = attend(Isa::Scalar, &q, &cache, &seqs, shape);
            for (i, (a, b)) in fast.data.iter().zip(&slow.data).enumerate() {
                assert!((a - b).abs() < 1e-5, "head_dim {head_dim}, element {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn query_heads_split_over_threads_give_the_bits_of_whole_groups() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
        let (cache, table) = setup(&mut rng, shape, 6);
        let q = queries(&mut rng, 2, shape);
        // Two decode rows: 6 (sequence, KV head) tasks, fewer than twice 4 threads (split), not than twice 1.
        let seqs = [
            AttnSeq { row: 0, len: 1, start_pos: 40, blocks: &table },
            AttnSeq { row: 1, len: 1, start_pos: 70, blocks: &table },
        ];
        let on = |threads| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| attend(Isa::detect(), &q, &cache, &seqs, shape))
        };
        assert!(on(4).data == on(1).data, "splitting a KV head's query heads changed the output");
    }

    #[test]
    fn a_row_does_not_depend_on_batch_or_chunking() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
        let (cache, table) = setup(&mut rng, shape, 4);
        let q = queries(&mut rng, 43, shape);
        let isa = Isa::detect();
        let width = q.cols;
        // Rows 0..40 as one prefill beside another sequence...
        let other = AttnSeq { row: 40, len: 3, start_pos: 5, blocks: &table[2..] };
        let prefill =
            attend(isa, &q, &cache, &[AttnSeq { row: 0, len: 40, start_pos: 0, blocks: &table }, other], shape);
        // ...equal each row computed alone as a decode step at its position.
        for t in [0usize, 7, 15, 16, 31, 39] {
            let one = CpuTensor { data: q.data[t * width..(t + 1) * width].to_vec(), rows: 1, cols: width };
            let alone = attend(isa, &one, &cache, &[AttnSeq { row: 0, len: 1, start_pos: t, blocks: &table }], shape);
            assert!(alone.data == prefill.data[t * width..(t + 1) * width], "row {t} differs");
        }
    }

    /// An f16 or bf16 cache read in place gives, bit for bit, what an f32 cache holding the same (rounded) values
    /// gives: the in-register conversion is exact and the arithmetic is the f32 path's. Prefill rows and decode
    /// rows, with query heads split over threads and kept whole.
    #[test]
    fn a_half_cache_read_in_place_gives_the_bits_of_its_values_in_f32() -> crate::Result<()> {
        let isa = Isa::detect();
        if !half_in_place(isa, 64) {
            simd::report_not_run(Isa::Avx2, "a_half_cache_read_in_place_gives_the_bits_of_its_values_in_f32");
            return Ok(());
        }
        let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
        let (kv_dim, positions) = (3 * 64, 6 * 16);
        let round_f16 = |x: f32| f16::from_f32(x).to_f32();
        let round_bf16 = |x: f32| bf16::from_f32(x).to_f32();
        for (dtype, round) in [(KvDtype::F16, &round_f16 as &dyn Fn(f32) -> f32), (KvDtype::Bf16, &round_bf16)] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(15);
            let mut rand = || {
                let data = (0..positions * kv_dim).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
                CpuTensor { data, rows: positions, cols: kv_dim }
            };
            let (k, v) = (rand(), rand());
            let mut table: Vec<u32> = (0..6).rev().collect();
            table.swap(0, 3);
            let all = [AttnSeq { row: 0, len: positions, start_pos: 0, blocks: &table }];
            let q = queries(&mut rng, 38, shape);
            let cache = |dtype| -> crate::Result<CpuKvLayer> {
                let mut cache = CpuKvLayer::new(6, 16, kv_dim, dtype)?;
                cache.write(&k, &v, &all)?;
                Ok(cache)
            };
            let (half, full) = (cache(dtype)?, cache(KvDtype::F32)?);
            assert!(half.as_f16().is_some() || half.as_bf16().is_some());
            let prefill_and_decode = [
                AttnSeq { row: 0, len: 37, start_pos: 20, blocks: &table[..4] },
                AttnSeq { row: 37, len: 1, start_pos: 90, blocks: &table },
            ];
            let decode = [AttnSeq { row: 0, len: 1, start_pos: 70, blocks: &table }];
            for seqs in [&prefill_and_decode[..], &decode[..]] {
                for threads in [1, 4] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
                    let (a, b) =
                        pool.install(|| (attend(isa, &q, &half, seqs, shape), attend(isa, &q, &full, seqs, shape)));
                    assert!(
                        a.data == b.data,
                        "{dtype}, {} rows on {threads} threads: {}",
                        seqs.len(),
                        max_diff(&a, &b)
                    );
                }
            }
        }
        Ok(())
    }

    /// Largest |a - b| over two outputs.
    fn max_diff(a: &CpuTensor, b: &CpuTensor) -> f32 {
        a.data.iter().zip(&b.data).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    #[test]
    fn each_kv_dtype_stays_within_its_bound_of_f32() -> crate::Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        // Heads of 64 (one Q8_0 block pair each) and of 16 (four heads share a block).
        for (heads, kv_heads, head_dim) in [(9, 3, 64), (4, 2, 16)] {
            let shape = AttnShape { num_heads: heads, num_kv_heads: kv_heads, head_dim, block_size: 16 };
            let kv_dim = kv_heads * head_dim;
            let positions = 6 * shape.block_size;
            let rand = |rng: &mut rand::rngs::StdRng| {
                let data = (0..positions * kv_dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                CpuTensor { data, rows: positions, cols: kv_dim }
            };
            let (k, v) = (rand(&mut rng), rand(&mut rng));
            let mut table: Vec<u32> = (0..6).rev().collect();
            table.swap(0, 3);
            let seqs = [
                AttnSeq { row: 0, len: 37, start_pos: 20, blocks: &table[..4] },
                AttnSeq { row: 37, len: 1, start_pos: 90, blocks: &table },
            ];
            let q = queries(&mut rng, 38, shape);
            let all = [AttnSeq { row: 0, len: positions, start_pos: 0, blocks: &table }];
            let run = |dtype: KvDtype, isa: Isa| -> crate::Result<CpuTensor> {
                let mut cache = CpuKvLayer::new(6, shape.block_size, kv_dim, dtype)?;
                cache.write(&k, &v, &all)?;
                Ok(attend(isa, &q, &cache, &seqs, shape))
            };
            let exact = run(KvDtype::F32, Isa::detect())?;
            // Measured 1.3e-4, 1.3e-3 and 2.4e-3 (head widths 64 and 16 alike) on outputs within ±1.
            for (dtype, bound) in
                [(KvDtype::F32, 0.0), (KvDtype::F16, 4e-4), (KvDtype::Bf16, 4e-3), (KvDtype::Q8_0, 6e-3)]
            {
                let got = run(dtype, Isa::detect())?;
                let d = max_diff(&got, &exact);
                eprintln!("head_dim {head_dim} {dtype}: max |diff| {d}");
                assert!(d <= bound, "head_dim {head_dim}, {dtype}: {d} > {bound}");
                assert!(max_diff(&got, &run(dtype, Isa::Scalar)?) < 1e-5, "{dtype}: SIMD and scalar agree");
            }
        }
        Ok(())
    }
}
