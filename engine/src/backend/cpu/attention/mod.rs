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
    /// The head's width: elements of a row the head owns.
    width: usize,
    /// Whether the kernels of a KV head's query heads together prefetch rows ahead of the one they read: where a
    /// task reads each row once (a decode step; +11 % at a 3,072-token depth), not where its next query rows find
    /// them in cache (-6 % in a long prefill).
    prefetch: bool,
}

impl<'a, T> KvView<'a, T> {
    /// The head's rows in a cache read in place.
    fn paged(
        cache: &'a CpuKvLayer,
        k: &'a [T],
        v: &'a [T],
        blocks: &'a [u32],
        head: usize,
        width: usize,
        prefetch: bool,
    ) -> Self {
        KvView { k, v, blocks, block_size: cache.block_size, stride: cache.kv_dim, head, width, prefetch }
    }
}

impl<'a> KvView<'a> {
    /// Rows of `head_dim` back to back, position `j` at `j × head_dim`: one block as long as any context.
    fn dense(k: &'a [f32], v: &'a [f32], head_dim: usize) -> Self {
        KvView {
            k,
            v,
            blocks: &[0],
            block_size: usize::MAX,
            stride: head_dim,
            head: 0,
            width: head_dim,
            prefetch: false,
        }
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

    /// [`Self::rows`] from `ahead` positions on, for the kernels to prefetch, if `prefetch` asks for it.
    #[cfg(target_arch = "x86_64")]
    fn lookahead(&self, ahead: usize) -> Option<std::iter::Skip<RowOffsets<'_>>> {
        self.prefetch.then(|| self.rows().skip(ahead))
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
    attend_grouped(isa, q, cache, seqs, shape, Grouping::Auto)
}

/// How the query heads sharing a KV head are computed; the bits are the same every way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grouping {
    /// As [`attend`] chooses.
    Auto,
    /// A task per query head (a cache read in place) or one after another in a task.
    Apart,
    /// In one task, in one pass over the rows where [`group_heads`] takes the group.
    Together,
    /// Together, with decode rows' passes split over tasks by runs of `positions` (whole KV blocks) and by
    /// columns ([`spread`]); where that does not apply (a prompt's rows, a cache converted first), as `Together`.
    Spread { positions: usize },
}

/// [`attend`], with the query heads of a KV head computed as `grouping` says.
fn attend_grouped(
    isa: Isa,
    q: &CpuTensor,
    cache: &CpuKvLayer,
    seqs: &[AttnSeq<'_>],
    shape: AttnShape,
    grouping: Grouping,
) -> CpuTensor {
    let AttnShape { num_heads, num_kv_heads, head_dim, .. } = shape;
    let (group, scale) = (shape.group(), shape.scale());
    let q_dim = num_heads * head_dim;
    // One task per (sequence, KV head, run of query rows): the query heads sharing a KV head read its rows while
    // they are in cache, and where `group_heads` takes the group, in one pass for all of them (a 3,072-token
    // prefill +40 %). With fewer such tasks than twice the threads (decoding a small batch: SmolLM2 has 3 KV heads,
    // so 2 threads would split 2 + 1) a cache read in place gives its query heads a task each instead, unless
    // the context is long enough that reading the rows once per group pays for spreading the group's pass over
    // the threads in two more parallel steps (SmolLM2's batch-1 decode on 2 threads, spread against apart: -5 %
    // from a 128-token prompt, -12 % from 512, +13 % from 1,024, +35 % from 2,048, +50 % from 3,072). Any other
    // keeps them together, as each task converts its KV head's rows first.
    let runs: usize = seqs.iter().map(|s| s.len.div_ceil(ROWS_PER_TASK)).sum::<usize>() * num_kv_heads;
    let half_in_place = half_in_place(isa, head_dim);
    let direct = InPlace::of(cache, half_in_place);
    let can_fuse = half_in_place && group >= 2;
    let longest = seqs.iter().map(|s| s.start_pos + s.len).max().unwrap_or(0);
    let grouping = match grouping {
        Grouping::Auto if direct.is_none() || runs >= 2 * rayon::current_num_threads() => Grouping::Together,
        Grouping::Auto if can_fuse && longest >= SPREAD_CONTEXT => Grouping::Spread { positions: SPREAD_POSITIONS },
        Grouping::Auto => Grouping::Apart,
        chosen => chosen,
    };
    #[cfg(target_arch = "x86_64")]
    if let (Grouping::Spread { positions }, Some(direct)) = (grouping, direct)
        && can_fuse
        && seqs.iter().all(|s| s.len == 1)
    {
        // SAFETY: `can_fuse` holds only where `half_in_place` found AVX2, FMA and F16C and the group is one the
        // grouped kernels take.
        return unsafe { spread::attend(isa, q, cache, direct, seqs, shape, positions) };
    }
    let apart = grouping == Grouping::Apart;
    let heads_per_task = if apart && direct.is_some() { 1 } else { group };
    let fused = can_fuse && !apart;
    let wide = isa.avx512();
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
    // One task per job (see `matmul::linear_many`): a prompt's later rows attend over more positions.
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .with_max_len(1)
        .map(|&AttnTask { si, kvh, t0, rows: n, g0 }| {
            let s = &seqs[si];
            let rows = |kv: Src<'_>| {
                let mut out = vec![0f32; n * heads_per_task * head_dim];
                let mut scores = Vec::with_capacity(s.start_pos + s.len);
                for t in 0..n {
                    let ctx = s.start_pos + t0 + t + 1;
                    if fused {
                        let h = kvh * group;
                        let qrows = &q.data[(s.row + t0 + t) * q_dim + h * head_dim..][..group * head_dim];
                        let o = &mut out[t * group * head_dim..][..group * head_dim];
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `fused` holds only where `half_in_place` found AVX2, FMA and F16C (f32 views
                        // included) and the group is one `group_heads` takes; the block table covers ctx.
                        unsafe {
                            match &kv {
                                Src::F32(kv) => group_heads(isa, wide, qrows, kv, ctx, scale, &mut scores, o),
                                Src::F16(kv) => group_heads(Isa::Avx2, wide, qrows, kv, ctx, scale, &mut scores, o),
                                Src::Bf16(kv) => group_heads(Isa::Avx2, wide, qrows, kv, ctx, scale, &mut scores, o),
                            }
                        }
                        continue;
                    }
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
            if let Some(direct) = direct {
                // A task of one query row (a decode step) reads each cached row once: prefetch ahead.
                return rows(direct.view(cache, s.blocks, kvh * head_dim, head_dim, n == 1));
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

/// Context length from which a small decode batch spreads each group's pass over the threads (see [`attend`]).
const SPREAD_CONTEXT: usize = 1024;

/// Positions per task of a spread pass's scores.
const SPREAD_POSITIONS: usize = 512;

/// Every query head of one KV head for one query row (`q` and `o`: the group's heads back to back), reading each
/// cached key and value once for all of them (once per pass of up to four heads in larger groups, `x86::passes`)
/// where [`one_head`] reads them once per head: its arithmetic head by head, so the same bits. `isa` is the
/// softmax's level, as `one_head` or `one_head_in_registers` would use; `wide`: whether the kernels may use
/// AVX-512 ([`wide`]).
///
/// # Safety
/// AVX2, FMA and F16C available (and AVX-512 F with `wide`); the head width a multiple of 8; `o.len()` / width at
/// least 2; every position below `ctx` cached.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn group_heads<T: x86::Elem>(
    isa: Isa,
    wide: bool,
    q: &[f32],
    kv: &KvView<'_, T>,
    ctx: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    let group = o.len() / kv.width;
    scores.clear();
    scores.resize(group * ctx, 0.0);
    // SAFETY (both calls): forwarded from the caller.
    unsafe { x86::group_scores(wide, group, q, kv, scale, scores) };
    for head in scores.chunks_exact_mut(ctx) {
        softmax(isa, head);
    }
    unsafe { x86::group_weighted_sum(wide, group, scores, kv, o) };
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

/// Scores into probabilities, in place: times the sum's reciprocal (as llama.cpp's softmax does), as a division
/// per score was ~1 % of a 1,536-token prefill.
fn softmax(isa: Isa, scores: &mut [f32]) {
    exp::exp_from_max(isa, scores);
    let inv = 1.0 / exp::sum_of(scores);
    for sc in scores.iter_mut() {
        *sc *= inv;
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

/// A cache's keys and values where the kernels read them in place: f32, or f16/bf16 where the CPU converts them
/// in registers ([`half_in_place`]).
#[derive(Clone, Copy)]
enum InPlace<'a> {
    F32(&'a [f32], &'a [f32]),
    #[cfg(target_arch = "x86_64")]
    F16(&'a [f16], &'a [f16]),
    #[cfg(target_arch = "x86_64")]
    Bf16(&'a [bf16], &'a [bf16]),
}

impl<'a> InPlace<'a> {
    /// `cache` read in place, if it can be; `half_in_place`: whether f16 and bf16 can.
    fn of(cache: &'a CpuKvLayer, half_in_place: bool) -> Option<Self> {
        if let Some((k, v)) = cache.as_f32() {
            return Some(InPlace::F32(k, v));
        }
        #[cfg(target_arch = "x86_64")]
        if half_in_place {
            if let Some((k, v)) = cache.as_f16() {
                return Some(InPlace::F16(k, v));
            }
            if let Some((k, v)) = cache.as_bf16() {
                return Some(InPlace::Bf16(k, v));
            }
        }
        let _ = half_in_place;
        None
    }

    /// The rows of the head at `head` (`width` wide) for the positions of `blocks`, from their first on.
    fn view(self, cache: &'a CpuKvLayer, blocks: &'a [u32], head: usize, width: usize, prefetch: bool) -> Src<'a> {
        match self {
            InPlace::F32(k, v) => Src::F32(KvView::paged(cache, k, v, blocks, head, width, prefetch)),
            #[cfg(target_arch = "x86_64")]
            InPlace::F16(k, v) => Src::F16(KvView::paged(cache, k, v, blocks, head, width, prefetch)),
            #[cfg(target_arch = "x86_64")]
            InPlace::Bf16(k, v) => Src::Bf16(KvView::paged(cache, k, v, blocks, head, width, prefetch)),
        }
    }
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
mod spread;
#[cfg(target_arch = "x86_64")]
mod wide;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
