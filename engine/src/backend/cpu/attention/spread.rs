//! Decode rows at a long context with a KV head's query heads together, spread over the threads: a task per run
//! of positions for the scores, then a task per run of columns for the weighted sums. With SmolLM2's 3 KV heads on
//! 2 threads, a task per KV head would leave one thread idle a third of the time. Every score, probability and
//! output column is computed as the one-task pass computes it (keys and columns are independent of one another
//! there), so the same bits.

use rayon::prelude::*;

use super::{InPlace, Src, softmax, x86};
use crate::backend::cpu::simd::Isa;
use crate::backend::cpu::{CpuKvLayer, CpuTensor};
use crate::backend::{AttnSeq, AttnShape};

/// Attention for `seqs`, one query row each, reading `direct` (`cache`'s rows in place), with the scores in tasks
/// of `positions` positions (rounded to whole KV blocks).
///
/// # Safety
/// AVX2, FMA and F16C available (AVX-512 F too where `isa` is that level); the head width a multiple of 8 and the group of query heads per KV head one the
/// grouped kernels take (at least 2); every sequence one row long.
pub(super) unsafe fn attend(
    isa: Isa,
    q: &CpuTensor,
    cache: &CpuKvLayer,
    direct: InPlace<'_>,
    seqs: &[AttnSeq<'_>],
    shape: AttnShape,
    positions: usize,
) -> CpuTensor {
    let AttnShape { num_heads, num_kv_heads, head_dim, .. } = shape;
    let (group, scale) = (shape.group(), shape.scale());
    let q_dim = num_heads * head_dim;
    let block = cache.block_size;
    let wide = isa.avx512();
    let run = block * (positions / block).max(1);
    assert!(seqs.iter().all(|s| s.len == 1), "spread attention takes decode rows");
    // (sequence, KV head) pairs and their contexts; pair i is sequence i / num_kv_heads.
    let pairs: Vec<(usize, usize)> =
        (0..seqs.len()).flat_map(|si| (0..num_kv_heads).map(move |kvh| (si, kvh))).collect();
    let ctx = |si: usize| seqs[si].start_pos + 1;
    let view = |si: usize, kvh: usize, from: usize| {
        direct.view(cache, &seqs[si].blocks[from / block..], kvh * head_dim, head_dim, true)
    };
    let queries = |si: usize, kvh: usize| &q.data[seqs[si].row * q_dim + kvh * group * head_dim..][..group * head_dim];

    // Scores of every head of the group, a run of positions per task.
    let runs: Vec<(usize, usize)> =
        (0..pairs.len()).flat_map(|pi| (0..ctx(pairs[pi].0)).step_by(run).map(move |p0| (pi, p0))).collect();
    let parts: Vec<Vec<f32>> = runs
        .par_iter()
        .map(|&(pi, p0)| {
            let (si, kvh) = pairs[pi];
            let mut out = vec![0f32; group * (ctx(si) - p0).min(run)];
            // SAFETY: the caller's features and group; the sequence's blocks cover its context from p0 on.
            unsafe {
                match view(si, kvh, p0) {
                    Src::F32(kv) => x86::group_scores(wide, group, queries(si, kvh), &kv, scale, &mut out),
                    Src::F16(kv) => x86::group_scores(wide, group, queries(si, kvh), &kv, scale, &mut out),
                    Src::Bf16(kv) => x86::group_scores(wide, group, queries(si, kvh), &kv, scale, &mut out),
                }
            }
            out
        })
        .collect();
    let mut probs: Vec<Vec<f32>> = pairs.iter().map(|&(si, _)| vec![0f32; group * ctx(si)]).collect();
    for (&(pi, p0), part) in runs.iter().zip(&parts) {
        let (c, n) = (ctx(pairs[pi].0), part.len() / group);
        for (g, scores) in part.chunks_exact(n).enumerate() {
            probs[pi][g * c + p0..][..n].copy_from_slice(scores);
        }
    }
    probs.par_iter_mut().zip(&pairs).for_each(|(p, &(si, _))| {
        for head in p.chunks_exact_mut(ctx(si)) {
            softmax(isa, head);
        }
    });

    // Weighted sums of every head of the group, a pass of columns per task.
    let per_pass = x86::columns_per_pass(wide, group);
    // (pair, first column, columns / 8)
    let passes: Vec<(usize, usize, usize)> = (0..pairs.len())
        .flat_map(|pi| (0..head_dim).step_by(8 * per_pass).map(move |c0| (pi, c0, ((head_dim - c0) / 8).min(per_pass))))
        .collect();
    let sums: Vec<Vec<f32>> = passes
        .par_iter()
        .map(|&(pi, c0, chunks)| {
            let (si, kvh) = pairs[pi];
            let mut o = vec![0f32; group * head_dim];
            // SAFETY: as above; columns c0..c0 + 8·chunks lie in the head.
            unsafe {
                match view(si, kvh, 0) {
                    Src::F32(kv) => x86::group_weighted_columns(wide, group, &probs[pi], &kv, c0, chunks, &mut o),
                    Src::F16(kv) => x86::group_weighted_columns(wide, group, &probs[pi], &kv, c0, chunks, &mut o),
                    Src::Bf16(kv) => x86::group_weighted_columns(wide, group, &probs[pi], &kv, c0, chunks, &mut o),
                }
            }
            o
        })
        .collect();
    let mut data = vec![0f32; q.rows * q_dim];
    for (&(pi, c0, chunks), o) in passes.iter().zip(&sums) {
        let (si, kvh) = pairs[pi];
        let width = 8 * chunks;
        for g in 0..group {
            let dst = seqs[si].row * q_dim + (kvh * group + g) * head_dim + c0;
            data[dst..][..width].copy_from_slice(&o[g * head_dim + c0..][..width]);
        }
    }
    CpuTensor { data, rows: q.rows, cols: q_dim }
}
