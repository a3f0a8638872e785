//! Q4_K and Q6_K in the interleaved layout: a row group's super-block is the 16 rows' file blocks with their
//! bytes moved, not changed ([`position`]), so that each 4-byte group of values of the 16 rows is one 64-byte
//! line, as the 32-element formats' are, and each per-row field (scales, sub-block scales) sits 16 rows side by
//! side. The kernels sum each 32-element sub-block as integers (Q6_K: each 16-element half, times its 8-bit scale,
//! also as integers), then, per sub-block, Q4_K `acc = fma(Σ q·a, (d·sc)·d_a, acc)` and
//! `acc = fma(-(dmin·m), s_a, acc)`, Q6_K `acc = fma(Σ sc·(q - 32)·a, d·d_a, acc)`: [`scalar`]'s arithmetic.

use super::ROWS;
use crate::backend::cpu::simd::Q8Block;
use crate::quant::{QK, QK_K, k4_scale_min, q4k_value, q6k_value};
use crate::tensor::f16_at;

/// Q4_K's file block: d, dmin (f16), 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles.
pub(super) const Q4K_FILE: usize = 144;
/// Q6_K's file block: 128 bytes of low nibbles, 64 of top bits, 16 signed scales, d (f16).
pub(super) const Q6K_FILE: usize = 210;

/// Where the values' lines end and the per-row fields start in a row group's super-block: Q4_K's 128 bytes of
/// nibbles and Q6_K's 192 of nibbles and top bits, 16 rows each.
pub(super) const Q4K_FIELDS: usize = 128 * ROWS;
pub(super) const Q6K_FIELDS: usize = 192 * ROWS;
/// Q4_K: d (16 f16), then dmin, then the 12 scale bytes, each as 16 rows' bytes.
pub(super) const Q4K_D: usize = Q4K_FIELDS;
pub(super) const Q4K_DMIN: usize = Q4K_D + 2 * ROWS;
pub(super) const Q4K_SCALES: usize = Q4K_DMIN + 2 * ROWS;
/// Q6_K: the 16 scales, each as 16 rows' bytes, then d (16 f16).
pub(super) const Q6K_SCALES: usize = Q6K_FIELDS;
pub(super) const Q6K_D: usize = Q6K_SCALES + 16 * ROWS;

/// Where byte `byte` of row `i`'s file block goes in the row group's super-block (`q6`: Q6_K, else Q4_K): value
/// byte `v` (Q4_K's nibbles; Q6_K's nibbles, then top bits, as one run) to line `v / 4`, row `i`'s 4 bytes of
/// it; each per-row field's byte `k` beside the other rows' byte `k`.
pub(super) fn position(q6: bool, i: usize, byte: usize) -> usize {
    let line = |v: usize| (v / 4) * 4 * ROWS + 4 * i + v % 4;
    if q6 {
        match byte {
            0..192 => line(byte),
            192..208 => Q6K_SCALES + (byte - 192) * ROWS + i,
            _ => Q6K_D + 2 * i + (byte - 208),
        }
    } else {
        match byte {
            0..2 => Q4K_D + 2 * i + byte,
            2..4 => Q4K_DMIN + 2 * i + (byte - 2),
            4..16 => Q4K_SCALES + (byte - 4) * ROWS + i,
            _ => line(byte - 16),
        }
    }
}

/// Row `i`'s file block from a row group's super-block.
pub(super) fn file_block(q6: bool, blk: &[u8], i: usize) -> Vec<u8> {
    let n = if q6 { Q6K_FILE } else { Q4K_FILE };
    (0..n).map(|byte| blk[position(q6, i, byte)]).collect()
}

/// The reference for one row group (`q6`: Q6_K, else Q4_K) against one token's 8-bit blocks `a`.
pub(super) fn scalar(q6: bool, group: &[u8], a: &[Q8Block]) -> [f32; ROWS] {
    let bytes = ROWS * if q6 { Q6K_FILE } else { Q4K_FILE };
    let mut acc = [0f32; ROWS];
    for (blk, a) in group.chunks_exact(bytes).zip(a.chunks_exact(QK_K / QK)) {
        for (i, acc) in acc.iter_mut().enumerate() {
            let file = file_block(q6, blk, i);
            for (j, ab) in a.iter().enumerate() {
                let x = |l: usize| i32::from(ab.qs[l]);
                if q6 {
                    let half = |h: usize| -> i32 {
                        let scale = i32::from(file[192 + 2 * j + h] as i8);
                        scale * (16 * h..16 * h + 16).map(|l| q6k_value(&file, QK * j + l) * x(l)).sum::<i32>()
                    };
                    *acc = ((half(0) + half(1)) as f32).mul_add(f16_at(&file, 208) * ab.d, *acc);
                } else {
                    let (sc, m) = k4_scale_min(&file[4..16], j);
                    let isum: i32 = (0..QK).map(|l| i32::from(q4k_value(&file, QK * j + l)) * x(l)).sum();
                    *acc = (isum as f32).mul_add(f16_at(&file, 0) * f32::from(sc) * ab.d, *acc);
                    *acc = (-(f16_at(&file, 2) * f32::from(m))).mul_add(ab.s, *acc);
                }
            }
        }
    }
    acc
}
