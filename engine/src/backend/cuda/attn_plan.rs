//! Host-side planning of one attention call on the GPU: where each new token's key/value goes in the paged
//! cache, and which kernel reads it back. Pure functions over the batch description, tested without a GPU.
//!
//! A batch where every sequence starts at position 0 runs `attention_prefill_*` on the fresh, packed k/v. Any
//! batch with cached context runs `paged_attention_decode_*` with one query row per "sequence": a chunk of `n`
//! new tokens at position `p` becomes `n` rows whose context lengths are `p + 1 .. p + n` over the same block
//! table, so decode steps, chunked prefill and mixed batches all take one path. (The prefill kernel cannot read
//! earlier context; a tensor-core paged prefill is future work, see docs/kernels.md.)

use strata_kernels::{DECODE_MAX_PARTITION, SUPPORTED_HEAD_DIMS, decode_heads_per_cta};

use crate::backend::{AttnSeq, AttnShape};
use crate::{Error, Result};

/// Which kernel reads the cache, with its index arrays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttnMode {
    /// Causal attention within each packed sequence (no earlier context).
    Prefill {
        /// Row offsets of the sequences, `num_seqs + 1` entries.
        cu_seqlens: Vec<i32>,
        /// Longest sequence.
        max_len: usize,
    },
    /// One query row per batch row over the paged cache.
    Decode {
        /// Block table per row, `rows × max_blocks`, padded with 0.
        block_tables: Vec<i32>,
        /// Context length per row (its own position + 1).
        context_lens: Vec<i32>,
        /// Width of a block-table row.
        max_blocks: usize,
        /// Longest context.
        max_context: usize,
    },
}

/// Everything the attention launches need besides the tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttnPlan {
    /// Cache slot of each row's key/value (`block * block_size + offset`).
    pub slots: Vec<i32>,
    /// The reading kernel.
    pub mode: AttnMode,
}

fn shape_err(reason: String) -> Error {
    Error::Shape { op: "attention", reason }
}

fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape_err(format!("{what} {v} does not fit the kernels' 32-bit indices")))
}

/// Checks the head layout against what the kernels implement.
pub fn check_shape(shape: &AttnShape) -> Result<()> {
    if !SUPPORTED_HEAD_DIMS.contains(&shape.head_dim) {
        return Err(shape_err(format!(
            "head_dim {} is not supported by the CUDA attention kernels (supported: {SUPPORTED_HEAD_DIMS:?})",
            shape.head_dim
        )));
    }
    if decode_heads_per_cta(shape.num_heads, shape.num_kv_heads).is_none() {
        return Err(shape_err(format!(
            "{} query heads are not a multiple of {} kv heads",
            shape.num_heads, shape.num_kv_heads
        )));
    }
    if shape.block_size == 0 {
        return Err(shape_err("KV block size is 0".into()));
    }
    Ok(())
}

/// Plans a call over `rows` batch rows for `seqs`, on a cache of `num_blocks` blocks of `block_size` tokens.
pub fn plan(seqs: &[AttnSeq<'_>], rows: usize, num_blocks: usize, block_size: usize) -> Result<AttnPlan> {
    let mut slots = vec![-1i32; rows];
    let mut covered = 0usize;
    for s in seqs {
        if s.row + s.len > rows {
            return Err(shape_err(format!("sequence rows {}..{} exceed the batch's {rows}", s.row, s.row + s.len)));
        }
        covered += s.len;
        for t in 0..s.len {
            let pos = s.start_pos + t;
            let block = *s
                .blocks
                .get(pos / block_size)
                .ok_or_else(|| shape_err(format!("position {pos} has no KV block ({} blocks)", s.blocks.len())))?
                as usize;
            if block >= num_blocks {
                return Err(shape_err(format!("KV block {block} is outside the cache's {num_blocks}")));
            }
            slots[s.row + t] = to_i32(block * block_size + pos % block_size, "cache slot")?;
        }
    }
    // Packed prefill needs every row covered, in order, by sequences without earlier context.
    let packed = covered == rows && seqs.iter().all(|s| s.start_pos == 0) && {
        let mut next = 0;
        seqs.iter().all(|s| {
            let ok = s.row == next;
            next += s.len;
            ok
        })
    };
    if packed {
        let mut cu = Vec::with_capacity(seqs.len() + 1);
        cu.push(0);
        for s in seqs {
            cu.push(to_i32(s.row + s.len, "row")?);
        }
        let max_len = seqs.iter().map(|s| s.len).max().unwrap_or(0);
        return Ok(AttnPlan { slots, mode: AttnMode::Prefill { cu_seqlens: cu, max_len } });
    }
    let max_blocks = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0).max(1);
    let mut block_tables = vec![0i32; rows * max_blocks];
    // Rows no sequence covers get context 0: the kernels write zeros there (as the CPU backend leaves them).
    let mut context_lens = vec![0i32; rows];
    let mut max_context = 0;
    for s in seqs {
        let table: Vec<i32> = s.blocks.iter().map(|&b| to_i32(b as usize, "block")).collect::<Result<_>>()?;
        for t in 0..s.len {
            let row = s.row + t;
            block_tables[row * max_blocks..row * max_blocks + table.len()].copy_from_slice(&table);
            let ctx = s.start_pos + t + 1;
            context_lens[row] = to_i32(ctx, "context length")?;
            max_context = max_context.max(ctx);
        }
    }
    Ok(AttnPlan { slots, mode: AttnMode::Decode { block_tables, context_lens, max_blocks, max_context } })
}

/// Context tokens per decode CTA: 512 (the kernels' maximum) unless that leaves the GPU with fewer than about
/// two CTAs per SM, then halved down to 64 (docs/kernels.md: a single long sequence needs more partitions).
pub fn partition_size(max_context: usize, ctas_per_partition: usize, sm_count: usize) -> usize {
    let mut ps = DECODE_MAX_PARTITION;
    while ps > 64 && max_context.div_ceil(ps) * ctas_per_partition < 2 * sm_count {
        ps /= 2;
    }
    ps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(row: usize, len: usize, start_pos: usize, blocks: &[u32]) -> AttnSeq<'_> {
        AttnSeq { row, len, start_pos, blocks }
    }

    #[test]
    fn fresh_packed_sequences_use_prefill() -> Result<()> {
        let (a, b) = ([3u32, 1], [0u32]);
        let p = plan(&[seq(0, 5, 0, &a), seq(5, 2, 0, &b)], 7, 4, 4)?;
        assert_eq!(p.slots, [12, 13, 14, 15, 4, 0, 1]);
        assert_eq!(p.mode, AttnMode::Prefill { cu_seqlens: vec![0, 5, 7], max_len: 5 });
        Ok(())
    }

    #[test]
    fn cached_context_uses_one_decode_row_per_token() -> Result<()> {
        // Sequence 0 decodes one token at position 6; sequence 1 prefills 2 tokens from scratch.
        let (a, b) = ([2u32, 0], [1u32]);
        let p = plan(&[seq(0, 1, 6, &a), seq(1, 2, 0, &b)], 3, 4, 4)?;
        assert_eq!(p.slots, [2, 4, 5], "position 6 is offset 2 of its second block (0)");
        let AttnMode::Decode { block_tables, context_lens, max_blocks, max_context } = p.mode else {
            panic!("expected decode");
        };
        assert_eq!((max_blocks, max_context), (2, 7));
        assert_eq!(block_tables, [2, 0, 1, 0, 1, 0]);
        assert_eq!(context_lens, [7, 1, 2]);
        Ok(())
    }

    #[test]
    fn bad_tables_are_errors() {
        let short = [0u32];
        assert!(plan(&[seq(0, 1, 4, &short)], 1, 4, 4).is_err(), "position 4 needs a second block");
        let outside = [9u32];
        assert!(plan(&[seq(0, 1, 0, &outside)], 1, 4, 4).is_err(), "block 9 of 4");
        assert!(plan(&[seq(1, 1, 0, &short)], 1, 4, 4).is_err(), "row past the batch");
    }

    #[test]
    fn shapes_outside_the_kernels_are_rejected() {
        let ok = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
        assert!(check_shape(&ok).is_ok());
        assert!(check_shape(&AttnShape { head_dim: 16, ..ok }).is_err());
        assert!(check_shape(&AttnShape { num_kv_heads: 2, ..ok }).is_err());
        assert!(check_shape(&AttnShape { block_size: 0, ..ok }).is_err());
    }

    #[test]
    fn partitions_shrink_only_when_the_grid_is_small() {
        // 64 seqs x 8 head groups at 4k context: plenty of CTAs at 512.
        assert_eq!(partition_size(4096, 64 * 8, 132), 512);
        // One sequence with 8 head groups at 4k context: 64 CTAs at 512, still 256 < 264 at 128, so 64.
        assert_eq!(partition_size(4096, 8, 132), 64);
        // 32 groups: 512 CTAs at 256 is enough.
        assert_eq!(partition_size(4096, 32, 132), 256);
        assert_eq!(partition_size(10, 1, 132), 64, "never below 64");
    }
}
