//! The 32-element block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and the K-quants (Q2_K to Q6_K) as the CPU backend
//! keeps them: 16 rows side by side ([`pack`]; the K-quants' super-blocks in [`kquant`]), so a 4-byte group of 16 rows fills one 512-bit register and one `vpdpbusd` against a token's 4
//! activation bytes, broadcast, advances 16 rows' sums. Each row's block is summed as integers (exact, in any
//! order), then `acc = fma(Σ q·a, d_w·d_a, acc)` (and `acc = fma(m_w, s_a, acc)` for the formats with a minimum)
//! block by block: [`scalar`]'s arithmetic, so every level, token count and thread split gives the same bits. The
//! file's layout costs a conversion and a multiply-add per 8 products (float lane sums per block, `qgemm`), as
//! llama.cpp's tinyBLAS does; this one costs them per 512 (16 rows × 32), which lets prefill run at the speed of
//! the 8-bit dot products. The layout holds the file's bits (the same bytes per block, [`file_row`] gives them
//! back), so it takes the same memory.

use super::simd::{Isa, Q8Block};
use crate::quant::{self, QK, QK_K};
use crate::tensor::{DType, f16_at};
use crate::{Error, Result};
use rayon::prelude::*;

/// Rows side by side.
pub const ROWS: usize = 16;
/// Activation blocks under one scale for the K-quants' kernels: a super-block's (llama.cpp's Q8_K).
pub const SUPER_SPAN: usize = QK_K / QK;
/// Tokens per tile call: the 512-bit tile keeps 8 sums and 8 accumulators in its 32 registers, the 256-bit ones
/// (16 registers) 4.
const TOKENS_512: usize = 8;
const TOKENS_256: usize = 4;
/// Activation bytes (blocks and their sums) one run of tokens may occupy: half of a 32 KiB L1 data cache.
const L1_ACT_BYTES: usize = 16 * 1024;
/// Tokens from which the 256-bit levels unpack a 5-bit row group's values once for all of them (`x86::expand`),
/// not in each tile of 4.
const EXPAND_TOKENS: usize = 16;

/// A format this layout holds, as a const parameter of the kernels.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q8_0 = 0,
    Q4_0 = 1,
    Q4_1 = 2,
    Q5_0 = 3,
    Q5_1 = 4,
    Q4_K = 5,
    Q6_K = 6,
    Q5_K = 7,
    Q2_K = 8,
    Q3_K = 9,
}

const Q8_0: u8 = Format::Q8_0 as u8;
const Q4_1: u8 = Format::Q4_1 as u8;
const Q5_0: u8 = Format::Q5_0 as u8;
const Q5_1: u8 = Format::Q5_1 as u8;
const Q4_K: u8 = Format::Q4_K as u8;
const Q6_K: u8 = Format::Q6_K as u8;
const Q5_K: u8 = Format::Q5_K as u8;
const Q2_K: u8 = Format::Q2_K as u8;
const Q3_K: u8 = Format::Q3_K as u8;

impl Format {
    /// Activation blocks under one scale that this format's kernels take: [`SUPER_SPAN`] for the K-quants, else 1.
    pub fn act_span(self) -> usize {
        if is_k(self as u8) { SUPER_SPAN } else { 1 }
    }

    /// The format of `dtype`, if this layout holds it.
    pub fn of(dtype: DType) -> Option<Format> {
        match dtype {
            DType::Q8_0 => Some(Format::Q8_0),
            DType::Q4_0 => Some(Format::Q4_0),
            DType::Q4_1 => Some(Format::Q4_1),
            DType::Q5_0 => Some(Format::Q5_0),
            DType::Q5_1 => Some(Format::Q5_1),
            DType::Q4_K => Some(Format::Q4_K),
            DType::Q5_K => Some(Format::Q5_K),
            DType::Q6_K => Some(Format::Q6_K),
            DType::Q2_K => Some(Format::Q2_K),
            DType::Q3_K => Some(Format::Q3_K),
            _ => None,
        }
    }

    fn dtype(self) -> DType {
        match self {
            Format::Q8_0 => DType::Q8_0,
            Format::Q4_0 => DType::Q4_0,
            Format::Q4_1 => DType::Q4_1,
            Format::Q5_0 => DType::Q5_0,
            Format::Q5_1 => DType::Q5_1,
            Format::Q4_K => DType::Q4_K,
            Format::Q5_K => DType::Q5_K,
            Format::Q6_K => DType::Q6_K,
            Format::Q2_K => DType::Q2_K,
            Format::Q3_K => DType::Q3_K,
        }
    }
}

/// Whether format `f` is a K-quant (256-element super-blocks, [`kquant`]).
const fn is_k(f: u8) -> bool {
    f == Q4_K || f == Q5_K || f == Q6_K || f == Q2_K || f == Q3_K
}

/// Weights per row of one block of format `f`.
const fn elems(f: u8) -> usize {
    if is_k(f) { QK_K } else { QK }
}

/// Whether format `f`'s blocks have a minimum (`w = d·q + m`) rather than an offset (`w = d·(q + bias)`).
const fn has_min(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

/// Whether format `f`'s values have a fifth bit.
const fn five(f: u8) -> bool {
    f == Q5_0 || f == Q5_1
}

/// `bias` in `w = d·(q + bias)`, `q` the unsigned value the layout stores (Q8_0 stores `w + 128`).
const fn bias(f: u8) -> i32 {
    match f {
        Q8_0 => -128,
        Q5_0 => -16,
        Q4_1 | Q5_1 => 0,
        _ => -8,
    }
}

/// Bytes of one block of a row group (a K-quant's: 16 file blocks, [`kquant`]): 16 f16 scales, 16 f16 minimums (formats with one), then the values: Q8_0's
/// as `[4-byte group][row][4]`; the 4/5-bit formats' low nibbles as 4 lines of `[row][4]` bytes, line `j` holding
/// group `j` in its low and group `j + 4` in its high nibbles, then (Q5) the fifth bits, 8 bytes per group, bit
/// `4·row + k` for the group's byte k of that row.
const fn block_bytes(f: u8) -> usize {
    if is_k(f) {
        return ROWS * kquant::file_bytes(f);
    }
    let scales = if has_min(f) { 4 * ROWS } else { 2 * ROWS };
    let values = if f == Q8_0 { ROWS * QK } else { ROWS * QK / 2 };
    scales + values + if five(f) { ROWS * QK / 8 } else { 0 }
}

/// Where a block's values start.
const fn values_at(f: u8) -> usize {
    if has_min(f) { 4 * ROWS } else { 2 * ROWS }
}

/// Where a block's fifth bits start.
const fn high_bits_at(f: u8) -> usize {
    values_at(f) + ROWS * QK / 2
}

/// One row's block, whatever the format: f16 scale and minimum bits, and the 32 unsigned values.
#[derive(Clone, Copy)]
struct Parts {
    d: [u8; 2],
    m: [u8; 2],
    q: [u8; QK],
}

/// A block in the file's layout, taken apart.
fn parts(f: u8, blk: &[u8]) -> Parts {
    let mut p = Parts { d: [blk[0], blk[1]], m: [0; 2], q: [0; QK] };
    let qs = match f {
        Q8_0 => {
            for (q, &w) in p.q.iter_mut().zip(&blk[2..2 + QK]) {
                *q = w ^ 0x80;
            }
            return p;
        }
        Q4_1 | Q5_1 => {
            p.m = [blk[2], blk[3]];
            &blk[4..]
        }
        _ => &blk[2..],
    };
    if five(f) {
        for (l, q) in p.q.iter_mut().enumerate() {
            *q = quant::five_bit(qs, l);
        }
    } else {
        for (j, &byte) in qs[..QK / 2].iter().enumerate() {
            (p.q[j], p.q[j + QK / 2]) = (byte & 0x0f, byte >> 4);
        }
    }
    p
}

/// [`parts`]' inverse: appends the block in the file's layout to `out`.
fn push_file_block(f: u8, p: &Parts, out: &mut Vec<u8>) {
    out.extend_from_slice(&p.d);
    if has_min(f) {
        out.extend_from_slice(&p.m);
    }
    if f == Q8_0 {
        out.extend(p.q.iter().map(|&q| q ^ 0x80));
    } else if five(f) {
        quant::push_five_bit(p.q.iter().copied(), out);
    } else {
        out.extend((0..QK / 2).map(|j| (p.q[j] & 0x0f) | (p.q[j + QK / 2] << 4)));
    }
}

/// Where byte `v` of row `i`'s values goes when each 4-byte group of the 16 rows is one 64-byte line: line `v / 4`,
/// the row's 4 bytes of it (every format of this layout stores its value bytes so).
const fn line_byte(i: usize, v: usize) -> usize {
    (v / 4) * 4 * ROWS + 4 * i + v % 4
}

/// Byte of value `l` of row `i` in a block's values, and (4/5-bit formats) whether it sits in the high nibble.
fn value_at(f: u8, i: usize, l: usize) -> (usize, bool) {
    if f == Q8_0 { (line_byte(i, l), false) } else { (line_byte(i, l % (QK / 2)), l >= QK / 2) }
}

/// Bit of value `l` of row `i` among a block's fifth bits (Q5): group `l / 4`'s 64, byte `l % 4` of the row.
fn fifth_bit_at(i: usize, l: usize) -> usize {
    (l / 4) * 64 + 4 * i + l % 4
}

/// Row `i`'s block `p` into a row group's block `blk` (zeroed before the first row).
fn put(f: u8, blk: &mut [u8], i: usize, p: &Parts) {
    blk[2 * i..2 * i + 2].copy_from_slice(&p.d);
    if has_min(f) {
        blk[2 * ROWS + 2 * i..2 * ROWS + 2 * i + 2].copy_from_slice(&p.m);
    }
    for (l, &q) in p.q.iter().enumerate() {
        let (at, high) = value_at(f, i, l);
        let v = &mut blk[values_at(f) + at];
        *v |= if f == Q8_0 {
            q
        } else if high {
            (q & 0x0f) << 4
        } else {
            q & 0x0f
        };
        if five(f) && q & 0x10 != 0 {
            let bit = fifth_bit_at(i, l);
            blk[high_bits_at(f) + bit / 8] |= 1 << (bit % 8);
        }
    }
}

/// Row `i`'s block from a row group's block.
fn get(f: u8, blk: &[u8], i: usize) -> Parts {
    let mut p = Parts { d: [blk[2 * i], blk[2 * i + 1]], m: [0; 2], q: [0; QK] };
    if has_min(f) {
        p.m = [blk[2 * ROWS + 2 * i], blk[2 * ROWS + 2 * i + 1]];
    }
    for (l, q) in p.q.iter_mut().enumerate() {
        let (at, high) = value_at(f, i, l);
        let v = blk[values_at(f) + at];
        *q = if f == Q8_0 {
            v
        } else if high {
            v >> 4
        } else {
            v & 0x0f
        };
        if five(f) {
            let bit = fifth_bit_at(i, l);
            *q |= ((blk[high_bits_at(f) + bit / 8] >> (bit % 8)) & 1) << 4;
        }
    }
    p
}

/// Bytes of a `rows × cols` matrix of format `f` in this layout: whole groups of 16 rows, each block as many bytes
/// as the file's 16 blocks.
pub fn packed_len(f: Format, rows: usize, cols: usize) -> usize {
    rows.div_ceil(ROWS) * (cols / elems(f as u8)) * block_bytes(f as u8)
}

/// Repacks `rows` rows of `cols` weights of format `f` from the file's layout into `out` ([`packed_len`] bytes);
/// the last group's missing rows are zeros.
pub fn pack_into(f: Format, file: &[u8], rows: usize, cols: usize, out: &mut [u8]) -> Result<()> {
    let (blocks, fb, bb) = (cols / elems(f as u8), f.dtype().block_bytes(), block_bytes(f as u8));
    if !cols.is_multiple_of(elems(f as u8))
        || file.len() != rows * blocks * fb
        || out.len() != packed_len(f, rows, cols)
    {
        return Err(Error::Shape {
            op: "repack",
            reason: format!("{} bytes are not {rows} rows of {cols} {} weights", file.len(), f.dtype()),
        });
    }
    // Each byte's place, as `base + stride · row` (the layouts below are affine in the row), and what flips it.
    let moves: Option<Vec<(usize, usize, u8)>> = (0..fb)
        .map(|byte| {
            let base = moved_to(f as u8, 0, byte)?;
            let flip = if f == Format::Q8_0 && byte >= 2 { 0x80 } else { 0 };
            Some((base, moved_to(f as u8, 1, byte)? - base, flip))
        })
        .collect();
    // Missing rows are blocks of zeros: scale 0 (and Q8_0's 0 stored as 128).
    let zeros = vec![0u8; fb];
    out.par_chunks_exact_mut((blocks * bb).max(1)).enumerate().for_each(|(group, dst)| {
        dst.fill(0);
        for i in 0..ROWS {
            let r = group * ROWS + i;
            for (b, blk) in dst.chunks_exact_mut(bb).enumerate() {
                let src = if r < rows { &file[(r * blocks + b) * fb..][..fb] } else { &zeros[..] };
                match &moves {
                    Some(moves) => {
                        for (&(base, stride, flip), &v) in moves.iter().zip(src) {
                            blk[base + stride * i] = v ^ flip;
                        }
                    }
                    None => put(f as u8, blk, i, &parts(f as u8, src)),
                }
            }
        }
    });
    Ok(())
}

/// Where byte `byte` of row `i`'s file block goes in its row group's block, for the formats whose layout moves the
/// file's bytes rather than regrouping their bits (all but Q5_0 and Q5_1): a 4-bit format's byte `j` of values
/// holds values `j` and `j + 16`, which [`value_at`] puts in the low and high nibbles of one byte, and Q8_0's
/// value `j` (flipped by `0x80`) is that value's byte.
fn moved_to(f: u8, i: usize, byte: usize) -> Option<usize> {
    if is_k(f) {
        return Some(kquant::position(f, i, byte));
    }
    if five(f) {
        return None;
    }
    Some(match byte {
        0..2 => 2 * i + byte,
        2..4 if has_min(f) => 2 * ROWS + 2 * i + byte - 2,
        // The file block's values follow its scale (and minimum): as many bytes as a row group's take per row.
        _ => values_at(f) + value_at(f, i, byte - values_at(f) / ROWS).0,
    })
}

/// [`pack_into`] a new buffer.
pub fn pack(f: Format, file: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; packed_len(f, rows, cols)];
    pack_into(f, file, rows, cols, &mut out)?;
    Ok(out)
}

/// Row `r` in the file's layout (its blocks, back to back).
pub fn file_row(f: Format, packed: &[u8], cols: usize, r: usize) -> Vec<u8> {
    let (blocks, bb) = (cols / elems(f as u8), block_bytes(f as u8));
    let group = &packed[(r / ROWS) * blocks * bb..][..blocks * bb];
    let mut row = Vec::with_capacity(blocks * f.dtype().block_bytes());
    for blk in group.chunks_exact(bb) {
        if is_k(f as u8) {
            row.extend(kquant::file_block(f as u8, blk, r % ROWS));
            continue;
        }
        push_file_block(f as u8, &get(f as u8, blk, r % ROWS), &mut row);
    }
    row
}

/// Row `r`'s weights as floats (`cols` of them): what the format's own dequantizer makes of the file's row.
pub fn dequantize_row(f: Format, packed: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    quant::dequantize(f.dtype(), &file_row(f, packed, cols, r), out);
}

/// `out[t · stride + r] = w_r · x_t` for the `rows` rows held by the row groups in `w` (whole groups of format `f`
/// from [`pack`]) and every token `t` of `acts`, with the kernels of `isa`, an instruction set this CPU has.
///
/// # Safety
/// Those output elements must be valid for writes and not accessed by anyone else during the call.
pub unsafe fn rows_by_tokens(
    isa: Isa,
    f: Format,
    w: &[u8],
    rows: usize,
    acts: &Acts<'_>,
    out: *mut f32,
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    let gfni = std::arch::is_x86_feature_detected!("gfni");
    #[cfg(not(target_arch = "x86_64"))]
    let gfni = false;
    // SAFETY: forwarded; `gfni` is what this CPU has.
    unsafe { rows_by_tokens_with(isa, gfni, f, w, rows, acts, out, stride) }
}

/// [`rows_by_tokens`], with the GFNI tiles where `gfni` (which this CPU must then have: the tests take both).
///
/// # Safety
/// As for [`rows_by_tokens`]; `gfni` only where this CPU has GFNI.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_by_tokens_with(
    isa: Isa,
    gfni: bool,
    f: Format,
    w: &[u8],
    rows: usize,
    acts: &Acts<'_>,
    out: *mut f32,
    stride: usize,
) {
    let _ = gfni;
    let blocks = acts.blocks;
    let group_bytes = packed_len(f, ROWS, blocks * QK);
    // These bounds are what every raw-pointer access below relies on.
    assert!(
        w.len() == rows.div_ceil(ROWS) * group_bytes
            && isa.supported()
            && acts.q.len() == acts.tokens * blocks
            && (acts.one_scale || !is_k(f as u8)),
        "row-group operands do not match"
    );
    #[cfg(target_arch = "x86_64")]
    if reads_words(isa, f, acts.tokens) {
        let aw = acts.words();
        // Written by `widen` before the tiles read it (through pointers), so not zeroed first.
        let mut scratch = Vec::with_capacity(words::group_words(blocks));
        let tiles = acts.tokens.div_ceil(words::TOKENS);
        // Each row group widened once, then against every token.
        for (g, wg) in w.chunks_exact(group_bytes.max(1)).enumerate() {
            // SAFETY: AVX2 was detected; the group holds `blocks` blocks (asserted above).
            unsafe { words::widen(wg.as_ptr(), blocks, scratch.spare_capacity_mut()) };
            let next = w.get((g + 1) * group_bytes..(g + 2) * group_bytes);
            for (tile, first) in (0..acts.tokens).step_by(words::TOKENS).enumerate() {
                if let Some(next) = next {
                    words::prefetch_part(next, tile, tiles);
                }
                let operands = words::Operands {
                    w: wg.as_ptr(),
                    words: scratch.as_ptr(),
                    a: acts.q[first * blocks..].as_ptr(),
                    aw: aw[first * blocks * QK..].as_ptr(),
                    blocks,
                    out: out.wrapping_add(first * stride + g * ROWS),
                    stride,
                    rows: (rows - g * ROWS).min(ROWS),
                };
                // SAFETY: as for the tiles below; `scratch` holds this group's words and `aw` every token's.
                unsafe { words::tile((acts.tokens - first).min(words::TOKENS), operands) }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some((tile, per_tile)) = x86::tile_with(isa, f, gfni) {
        // `values`: a row group's expanded values (`x86::expand`), or null where the tiles read the group itself.
        let operands = |g: usize, wg: &[u8], first: usize, values: *const u8| x86::Operands {
            w: wg.as_ptr(),
            values,
            a: acts.q[first * blocks..].as_ptr(),
            sums: acts.sums[first * blocks..].as_ptr(),
            pairs: acts.pairs[first * blocks..].as_ptr(),
            sub_pairs: acts.sub_pairs[first * blocks..].as_ptr(),
            q3k_starts: acts.q3k_starts[first * blocks..].as_ptr(),
            q6k_starts: acts.q6k_starts[first * blocks..].as_ptr(),
            blocks,
            out: out.wrapping_add(first * stride + g * ROWS),
            stride,
            rows: (rows - g * ROWS).min(ROWS),
        };
        if matches!(isa, Isa::Avx2 | Isa::AvxVnni) && five(f as u8) && acts.tokens >= EXPAND_TOKENS {
            // As the words above: written before it is read.
            let mut values = Vec::with_capacity(x86::expanded_len(blocks));
            // Each row group unpacked once, then against every token.
            for (g, wg) in w.chunks_exact(group_bytes.max(1)).enumerate() {
                // SAFETY: AVX2 was detected (both levels have it); the group holds `blocks` blocks of `f`.
                unsafe { x86::expand(f, wg.as_ptr(), blocks, values.spare_capacity_mut()) };
                for first in (0..acts.tokens).step_by(per_tile) {
                    // SAFETY: as below; `values` holds this group's values, expanded.
                    unsafe { tile((acts.tokens - first).min(per_tile), operands(g, wg, first, values.as_ptr())) }
                }
            }
            return;
        }
        let tiles = acts.tokens.div_ceil(per_tile);
        // Token tiles are visited in runs that fit in L1, all row groups per run (see `qgemm::rows_by_tokens`).
        let tile_bytes = per_tile * blocks * (std::mem::size_of::<Q8Block>() + 4);
        let run = (L1_ACT_BYTES / tile_bytes.max(1)).clamp(1, tiles.max(1));
        for t0 in (0..tiles).step_by(run) {
            for (g, wg) in w.chunks_exact(group_bytes.max(1)).enumerate() {
                for tile_index in t0..(t0 + run).min(tiles) {
                    let first = tile_index * per_tile;
                    // SAFETY: the level was detected; the group holds `blocks` blocks of `f`, tokens from `first`
                    // have `blocks` blocks and sums each (asserted above), and the caller vouches for the outputs
                    // (first + t, 16g + r) for r below the group's rows.
                    unsafe { tile((acts.tokens - first).min(per_tile), operands(g, wg, first, std::ptr::null())) }
                }
            }
        }
        return;
    }
    for (g, wg) in w.chunks_exact(group_bytes.max(1)).enumerate() {
        for t in 0..acts.tokens {
            let sums = scalar(f, wg, &acts.q[t * blocks..(t + 1) * blocks]);
            for (r, v) in sums.iter().enumerate().take((rows - g * ROWS).min(ROWS)) {
                // SAFETY: the caller vouches for output (t, 16g + r).
                unsafe { *out.add(t * stride + g * ROWS + r) = *v };
            }
        }
    }
}

/// The reference: one row group (format `f`) against one token, row by row.
pub fn scalar(f: Format, group: &[u8], a: &[Q8Block]) -> [f32; ROWS] {
    if is_k(f as u8) {
        return kquant::scalar(f as u8, group, a);
    }
    let f = f as u8;
    let mut acc = [0f32; ROWS];
    for (blk, ab) in group.chunks_exact(block_bytes(f)).zip(a) {
        let sum: i32 = ab.qs.iter().map(|&v| i32::from(v)).sum();
        for (i, acc) in acc.iter_mut().enumerate() {
            let p = get(f, blk, i);
            let isum = p.q.iter().zip(&ab.qs).map(|(&q, &x)| i32::from(q) * i32::from(x)).sum::<i32>() + bias(f) * sum;
            *acc = (isum as f32).mul_add(f16_at(&p.d, 0) * ab.d, *acc);
            if has_min(f) {
                *acc = f16_at(&p.m, 0).mul_add(ab.s, *acc);
            }
        }
    }
    acc
}

mod acts;
mod kquant;
pub use acts::Acts;
#[cfg(test)]
use acts::PARALLEL_BLOCKS;
#[cfg(target_arch = "x86_64")]
use acts::reads_words;

#[cfg(target_arch = "x86_64")]
mod kquant_x86;
#[cfg(target_arch = "x86_64")]
mod words;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
