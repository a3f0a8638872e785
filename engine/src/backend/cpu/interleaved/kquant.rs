//! The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in the interleaved layout: a row group's super-block is the 16 rows'
//! file blocks with their bytes moved, not changed ([`position`]), so that each 4-byte group of values of the 16 rows
//! is one 64-byte line, as the 32-element formats' are, and each per-row field (scales, sub-block scales) sits 16
//! rows side by side. Their kernels take activations with one scale per super-block (llama.cpp's Q8_K, which its
//! K-quant dot products take too), so a super-block's `Σ sc·Σ q·a` is gathered over its sub-blocks (or halves) before
//! one `acc = fma(s, d·d_a, acc)` per super-block (and one for the minimums): [`scalar`]'s arithmetic. A scale per
//! 32 activations cost a conversion, a multiply and an `fma` or two per sub-block and token; per super-block, the
//! 512-bit tiles ran 8-27 % faster (ns per block and token: Q3_K 0.25 → 0.20, Q2_K 0.24 → 0.19, Q4_K 0.21 → 0.16).

use super::{Q2_K, Q3_K, Q5_K, Q6_K, ROWS, line_byte};
use crate::backend::cpu::simd::Q8Block;
use crate::quant::{QK, QK_K, k4_scale_min, q2k_value, q3k_scale, q3k_value, q4k_value, q5k_value, q6k_value};
use crate::tensor::f16_at;

/// Bytes of K-quant `f`'s file block: Q2_K 16 bytes of 4-bit scales and minimums, 64 of 2-bit values, d, dmin
/// (f16); Q3_K 32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit scales, d; Q4_K d, dmin, 12 bytes of 6-bit
/// scales and minimums, 128 bytes of nibbles; Q5_K the same with 32 bytes of fifth bits before the nibbles; Q6_K
/// 128 bytes of low nibbles, 64 of top bits, 16 signed scales, d.
pub(super) const fn file_bytes(f: u8) -> usize {
    match f {
        Q2_K => 84,
        Q3_K => 110,
        Q5_K => 176,
        Q6_K => 210,
        _ => 144,
    }
}

/// Whether format `f` has a scale per 16 elements (two per sub-block) rather than per 32.
pub(super) const fn per_half(f: u8) -> bool {
    f == Q2_K || f == Q3_K || f == Q6_K
}

/// Bytes of K-quant `f`'s per-row scale fields (Q4_K/Q5_K's 12 packed bytes hold scales and minimums).
const fn scale_bytes(f: u8) -> usize {
    match f {
        Q2_K | Q6_K => 16,
        _ => 12,
    }
}

/// Bytes of values per row: every byte of the file block but its per-row fields (the scale bytes, d and dmin).
const fn values(f: u8) -> usize {
    file_bytes(f) - scale_bytes(f) - if f == Q3_K || f == Q6_K { 2 } else { 4 }
}

/// Where a row group's super-block holds each field of the 16 rows (after the values' lines): d (16 f16), Q2_K,
/// Q4_K and Q5_K's dmin, and the scale bytes, each byte as 16 rows' bytes (Q3_K and Q6_K's before d).
pub(super) const fn d_at(f: u8) -> usize {
    values(f) * ROWS + if f == Q3_K || f == Q6_K { scale_bytes(f) * ROWS } else { 0 }
}
pub(super) const fn dmin_at(f: u8) -> usize {
    d_at(f) + 2 * ROWS
}
pub(super) const fn scales_at(f: u8) -> usize {
    if f == Q3_K || f == Q6_K { values(f) * ROWS } else { dmin_at(f) + 2 * ROWS }
}
/// Line of the first of Q5_K's fifth bits and Q6_K's top bits: the 32 lines of nibbles come first.
pub(super) const HIGH_LINE: usize = 32;
/// Line of the first of Q3_K's high bits: the 16 lines of 2-bit values come first.
pub(super) const Q3K_HIGH_LINE: usize = 16;

/// Where byte `byte` of row `i`'s file block goes in the row group's super-block of K-quant `f`: value byte `v`
/// (the nibbles or 2-bit values, then Q3_K's high bits, Q5_K's fifth bits or Q6_K's top bits, as one run) to line
/// `v / 4`, row `i`'s 4 bytes of it; each per-row field's byte `k` beside the other rows' byte `k`.
pub(super) fn position(f: u8, i: usize, byte: usize) -> usize {
    let line = |v: usize| line_byte(i, v);
    let field = |at: usize, k: usize| at + k * ROWS + i;
    match f {
        Q2_K => match byte {
            0..16 => field(scales_at(f), byte),
            16..80 => line(byte - 16),
            80..82 => d_at(f) + 2 * i + (byte - 80),
            _ => dmin_at(f) + 2 * i + (byte - 82),
        },
        Q3_K => match byte {
            0..32 => line(64 + byte),
            32..96 => line(byte - 32),
            96..108 => field(scales_at(f), byte - 96),
            _ => d_at(f) + 2 * i + (byte - 108),
        },
        Q6_K => match byte {
            0..192 => line(byte),
            192..208 => field(scales_at(f), byte - 192),
            _ => d_at(f) + 2 * i + (byte - 208),
        },
        _ => match byte {
            0..2 => d_at(f) + 2 * i + byte,
            2..4 => dmin_at(f) + 2 * i + (byte - 2),
            4..16 => field(scales_at(f), byte - 4),
            // Q5_K's fifth bits, after its 128 bytes of nibbles.
            16..48 if f == Q5_K => line(128 + byte - 16),
            _ => line(byte - (file_bytes(f) - 128)),
        },
    }
}

/// Row `i`'s file block from a row group's super-block of K-quant `f`.
pub(super) fn file_block(f: u8, blk: &[u8], i: usize) -> Vec<u8> {
    (0..file_bytes(f)).map(|byte| blk[position(f, i, byte)]).collect()
}

/// The reference for one row group of K-quant `f` against one token's 8-bit blocks `a`, each super-block's 8 under
/// one scale `d_a` (as llama.cpp's Q8_K; the kernels read the first's). Per super-block and row, Q2_K, Q3_K and Q4_K
/// sum `Σ sc·Σ q·a` as integers, Q5_K and Q6_K in floats (`s = fma(Σ q·a, sc, s)` sub-block after sub-block or half
/// after half: their half sums fit in no 16-bit word for one `madd`, a `mullo` costs two instructions, and the float
/// route is exact but for the running sum's rounding past 2^24); then
/// `acc = fma(s, d·d_a, acc)`, and for the formats with minimums `acc = fma(Σ m·Σ a, -(dmin·d_a), acc)`, the
/// minimums' sum an integer.
pub(super) fn scalar(f: u8, group: &[u8], a: &[Q8Block]) -> [f32; ROWS] {
    let mut acc = [0f32; ROWS];
    for (blk, a) in group.chunks_exact(ROWS * file_bytes(f)).zip(a.chunks_exact(QK_K / QK)) {
        let d_a = a[0].d;
        for (i, acc) in acc.iter_mut().enumerate() {
            let file = file_block(f, blk, i);
            let (mut isum, mut fsum, mut msum) = (0i32, 0f32, 0i32);
            for (j, ab) in a.iter().enumerate() {
                let x = |l: usize| i32::from(ab.qs[l]);
                if per_half(f) {
                    for h in 0..2 {
                        let (k, ls) = (2 * j + h, 16 * h..16 * h + 16);
                        let dot =
                            |value: &dyn Fn(usize) -> i32| ls.clone().map(|l| value(QK * j + l) * x(l)).sum::<i32>();
                        match f {
                            Q2_K => {
                                let (sc, m) = (i32::from(file[k] & 0x0f), i32::from(file[k] >> 4));
                                isum += sc * dot(&|e| i32::from(q2k_value(&file, e)));
                                msum += m * ls.map(x).sum::<i32>();
                            }
                            Q3_K => isum += q3k_scale(&file[96..108], k) * dot(&|e| q3k_value(&file, e)),
                            _ => {
                                let sc = f32::from(file[192 + k] as i8);
                                fsum = (dot(&|e| q6k_value(&file, e)) as f32).mul_add(sc, fsum);
                            }
                        }
                    }
                } else {
                    let value = if f == Q5_K { q5k_value } else { q4k_value };
                    let (sc, m) = k4_scale_min(&file[4..16], j);
                    let dot: i32 = (0..QK).map(|l| i32::from(value(&file, QK * j + l)) * x(l)).sum();
                    if f == Q5_K {
                        fsum = (dot as f32).mul_add(f32::from(sc), fsum);
                    } else {
                        isum += i32::from(sc) * dot;
                    }
                    msum += i32::from(m) * (0..QK).map(x).sum::<i32>();
                }
            }
            let (d, dmin) = match f {
                Q2_K => (f16_at(&file, 80), f16_at(&file, 82)),
                Q3_K | Q6_K => (f16_at(&file, file_bytes(f) - 2), 0.0),
                _ => (f16_at(&file, 0), f16_at(&file, 2)),
            };
            let s = if f == Q5_K || f == Q6_K { fsum } else { isum as f32 };
            *acc = s.mul_add(d * d_a, *acc);
            if f != Q3_K && f != Q6_K {
                *acc = (msum as f32).mul_add(-(dmin * d_a), *acc);
            }
        }
    }
    acc
}
