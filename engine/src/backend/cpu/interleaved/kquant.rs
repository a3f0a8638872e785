//! Q4_K, Q5_K and Q6_K in the interleaved layout: a row group's super-block is the 16 rows' file blocks with their
//! bytes moved, not changed ([`position`]), so that each 4-byte group of values of the 16 rows is one 64-byte
//! line, as the 32-element formats' are, and each per-row field (scales, sub-block scales) sits 16 rows side by
//! side. The kernels sum each 32-element sub-block as integers (Q6_K: each 16-element half, times its 8-bit scale,
//! also as integers), then, per sub-block, Q4_K and Q5_K `acc = fma(Σ q·a, (d·sc)·d_a, acc)` and
//! `acc = fma(-(dmin·m), s_a, acc)`, Q6_K `acc = fma(Σ sc·(q - 32)·a, d·d_a, acc)`: [`scalar`]'s arithmetic.

use super::{Q5_K, Q6_K, ROWS, line_byte};
use crate::backend::cpu::simd::Q8Block;
use crate::quant::{QK, QK_K, k4_scale_min, q4k_value, q5k_value, q6k_value};
use crate::tensor::f16_at;

/// Bytes of K-quant `f`'s file block: Q4_K d, dmin (f16), 12 bytes of 6-bit scales and minimums, 128 bytes of
/// nibbles; Q5_K the same with 32 bytes of fifth bits before the nibbles; Q6_K 128 bytes of low nibbles, 64 of
/// top bits, 16 signed scales, d (f16).
pub(super) const fn file_bytes(f: u8) -> usize {
    match f {
        Q5_K => 176,
        Q6_K => 210,
        _ => 144,
    }
}

/// Bytes of values per row: every byte of the file block but its per-row fields.
const fn values(f: u8) -> usize {
    file_bytes(f) - if f == Q6_K { 18 } else { 16 }
}

/// Where a row group's super-block holds each field of the 16 rows (after the values' lines): d (16 f16), Q4_K
/// and Q5_K's dmin and 12 scale bytes, Q6_K's 16 scales, each byte as 16 rows' bytes.
pub(super) const fn d_at(f: u8) -> usize {
    values(f) * ROWS + if f == Q6_K { 16 * ROWS } else { 0 }
}
pub(super) const fn dmin_at(f: u8) -> usize {
    d_at(f) + 2 * ROWS
}
pub(super) const fn scales_at(f: u8) -> usize {
    if f == Q6_K { values(f) * ROWS } else { dmin_at(f) + 2 * ROWS }
}
/// Line of the first of Q5_K's fifth bits and Q6_K's top bits: the 32 lines of nibbles come first.
pub(super) const HIGH_LINE: usize = 32;

/// Where byte `byte` of row `i`'s file block goes in the row group's super-block of K-quant `f`: value byte `v`
/// (the nibbles, then Q5_K's fifth bits or Q6_K's top bits, as one run) to line `v / 4`, row `i`'s 4 bytes of it;
/// each per-row field's byte `k` beside the other rows' byte `k`.
pub(super) fn position(f: u8, i: usize, byte: usize) -> usize {
    let line = |v: usize| line_byte(i, v);
    let field = |at: usize, k: usize| at + k * ROWS + i;
    if f == Q6_K {
        return match byte {
            0..192 => line(byte),
            192..208 => field(scales_at(f), byte - 192),
            _ => d_at(f) + 2 * i + (byte - 208),
        };
    }
    match byte {
        0..2 => d_at(f) + 2 * i + byte,
        2..4 => dmin_at(f) + 2 * i + (byte - 2),
        4..16 => field(scales_at(f), byte - 4),
        // Q5_K's fifth bits, after its 128 bytes of nibbles.
        16..48 if f == Q5_K => line(128 + byte - 16),
        _ => line(byte - (file_bytes(f) - 128)),
    }
}

/// Row `i`'s file block from a row group's super-block of K-quant `f`.
pub(super) fn file_block(f: u8, blk: &[u8], i: usize) -> Vec<u8> {
    (0..file_bytes(f)).map(|byte| blk[position(f, i, byte)]).collect()
}

/// The reference for one row group of K-quant `f` against one token's 8-bit blocks `a`.
pub(super) fn scalar(f: u8, group: &[u8], a: &[Q8Block]) -> [f32; ROWS] {
    let mut acc = [0f32; ROWS];
    for (blk, a) in group.chunks_exact(ROWS * file_bytes(f)).zip(a.chunks_exact(QK_K / QK)) {
        for (i, acc) in acc.iter_mut().enumerate() {
            let file = file_block(f, blk, i);
            for (j, ab) in a.iter().enumerate() {
                let x = |l: usize| i32::from(ab.qs[l]);
                if f == Q6_K {
                    let half = |h: usize| -> i32 {
                        let scale = i32::from(file[192 + 2 * j + h] as i8);
                        scale * (16 * h..16 * h + 16).map(|l| q6k_value(&file, QK * j + l) * x(l)).sum::<i32>()
                    };
                    *acc = ((half(0) + half(1)) as f32).mul_add(f16_at(&file, 208) * ab.d, *acc);
                } else {
                    let value = if f == Q5_K { q5k_value } else { q4k_value };
                    let (sc, m) = k4_scale_min(&file[4..16], j);
                    let isum: i32 = (0..QK).map(|l| i32::from(value(&file, QK * j + l)) * x(l)).sum();
                    *acc = (isum as f32).mul_add(f16_at(&file, 0) * f32::from(sc) * ab.d, *acc);
                    *acc = (-(f16_at(&file, 2) * f32::from(m))).mul_add(ab.s, *acc);
                }
            }
        }
    }
    acc
}
