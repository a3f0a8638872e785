//! Causal grouped-query attention over a paged KV cache.

use rayon::prelude::*;

use super::simd::{self, Isa};
use super::{CpuKvLayer, CpuTensor};
use crate::backend::{AttnSeq, AttnShape};
use crate::{Error, Result};

/// Scatters new keys/values into their cache slots.
pub fn write_kv(cache: &mut CpuKvLayer, k: &CpuTensor, v: &CpuTensor, seqs: &[AttnSeq<'_>]) -> Result<()> {
    let kv_dim = cache.kv_dim;
    for s in seqs {
        for t in 0..s.len {
            let pos = s.start_pos + t;
            let block = *s.blocks.get(pos / cache.block_size).ok_or_else(|| Error::Shape {
                op: "attention",
                reason: format!("position {pos} has no KV block ({} blocks)", s.blocks.len()),
            })? as usize;
            let slot = (block * cache.block_size + pos % cache.block_size) * kv_dim;
            let row = s.row + t;
            cache.k[slot..slot + kv_dim].copy_from_slice(&k.data[row * kv_dim..(row + 1) * kv_dim]);
            cache.v[slot..slot + kv_dim].copy_from_slice(&v.data[row * kv_dim..(row + 1) * kv_dim]);
        }
    }
    Ok(())
}

/// Runs attention for every (sequence, query head); the cache must already hold the new keys/values.
pub fn attend(isa: Isa, q: &CpuTensor, cache: &CpuKvLayer, seqs: &[AttnSeq<'_>], shape: AttnShape) -> CpuTensor {
    let AttnShape { num_heads, num_kv_heads, head_dim, block_size } = shape;
    let group = num_heads / num_kv_heads;
    let q_dim = num_heads * head_dim;
    let kv_dim = num_kv_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let rows = q.rows;
    // One task per (sequence, head); each returns that head's output rows.
    let tasks: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..num_heads).map(move |h| (s, h))).collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(si, h)| {
            let s = &seqs[si];
            let kvh = h / group;
            let mut out = vec![0f32; s.len * head_dim];
            let mut scores = Vec::with_capacity(s.start_pos + s.len);
            for t in 0..s.len {
                let qrow = &q.data[(s.row + t) * q_dim + h * head_dim..][..head_dim];
                let ctx = s.start_pos + t + 1;
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for j in 0..ctx {
                    let slot = (s.blocks[j / block_size] as usize * block_size + j % block_size) * kv_dim;
                    let krow = &cache.k[slot + kvh * head_dim..][..head_dim];
                    let sc = simd::dot_f32(isa, qrow, krow) * scale;
                    max = max.max(sc);
                    scores.push(sc);
                }
                let mut denom = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    denom += *sc;
                }
                let o = &mut out[t * head_dim..(t + 1) * head_dim];
                for (j, &p) in scores.iter().enumerate() {
                    let slot = (s.blocks[j / block_size] as usize * block_size + j % block_size) * kv_dim;
                    let vrow = &cache.v[slot + kvh * head_dim..][..head_dim];
                    simd::axpy(isa, p / denom, vrow, o);
                }
            }
            out
        })
        .collect();
    let mut data = vec![0f32; rows * q_dim];
    for (&(si, h), out) in tasks.iter().zip(results) {
        let s = &seqs[si];
        for t in 0..s.len {
            data[(s.row + t) * q_dim + h * head_dim..][..head_dim].copy_from_slice(&out[t * head_dim..][..head_dim]);
        }
    }
    CpuTensor { data, rows, cols: q_dim }
}
