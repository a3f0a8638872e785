//! The K-quant formats of the [`super::BlockFormat`] table: 256-element super-blocks of eight 32-element
//! sub-blocks (sixteen of 16 for Q6_K) with their own quantized scales. strata reads and runs them; it does not
//! write them (llama.cpp's quantizers search for the scales, `llama-quantize` makes these files).
//! Layouts follow ggml-common.h's `block_q2_K`, `block_q3_K`, `block_q4_K`, `block_q5_K`, `block_q6_K` and
//! `block_q8_K`.

use super::BlockFormat;
use crate::tensor::{DType, f16_at};

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// Sub-block `j`'s 6-bit scale and minimum from the 12 packed bytes of a Q4_K/Q5_K block: the first four
/// sub-blocks keep theirs in the low 6 bits of bytes `j` and `j + 4`; the last four in the nibbles of byte
/// `j + 4`, with their top 2 bits in the spare top bits of bytes `j - 4` (scale) and `j` (minimum).
#[inline]
pub fn k4_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        ((scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))
    }
}

/// The 4-bit value of element `i` of a Q4_K block (bytes 16..144 hold 64 elements per 32 bytes: low nibbles
/// the first sub-block of the pair, high nibbles the second).
#[inline]
pub fn q4k_value(blk: &[u8], i: usize) -> u8 {
    let (j, l) = (i / 32, i % 32);
    (blk[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f
}

/// The 5-bit value of element `i` of a Q5_K block: nibbles as Q4_K's at bytes 48..176, bit 4 of sub-block `j`'s
/// element `l` is bit `j` of byte `16 + l`.
#[inline]
pub fn q5k_value(blk: &[u8], i: usize) -> u8 {
    let (j, l) = (i / 32, i % 32);
    let nibble = (blk[48 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
    nibble | (((blk[16 + l] >> j) & 1) << 4)
}

/// The signed 6-bit value (−32..32) of element `i` of a Q6_K block. Each half of 128 elements has 64 bytes of
/// low nibbles (`ql`, 32 bytes serving two quarters, low then high nibbles) and 32 bytes of 2-bit tops (`qh`,
/// quarter `c` at bits `2c`). Its scale is the i8 at `192 + i / 16`.
#[inline]
pub fn q6k_value(blk: &[u8], i: usize) -> i32 {
    let (n, c, l) = (i / 128, (i % 128) / 32, i % 32);
    let low = (blk[64 * n + 32 * (c % 2) + l] >> (4 * (c / 2))) & 0x0f;
    let high = (blk[128 + 32 * n + l] >> (2 * c)) & 3;
    (low | (high << 4)) as i32 - 32
}

/// The 2-bit field of element `i` in the 64 bytes at `qs` that Q2_K and Q3_K share: each half of 128 elements
/// has 32 bytes, quarter `c` of the half in bits `2c..2c + 2` (as Q6_K's tops).
#[inline]
fn two_bit(qs: &[u8], i: usize) -> u8 {
    let (n, c, l) = (i / 128, (i % 128) / 32, i % 32);
    (qs[32 * n + l] >> (2 * c)) & 3
}

/// The 2-bit value (0..4) of element `i` of a Q2_K block (bytes 16..80). Its scale and minimum are the low and
/// high nibbles of byte `i / 16`.
#[inline]
pub fn q2k_value(blk: &[u8], i: usize) -> u8 {
    two_bit(&blk[16..80], i)
}

/// The signed 3-bit value (−4..4) of element `i` of a Q3_K block: the 2-bit field at bytes 32..96, minus 4 unless
/// bit `i / 32` of `hmask[i % 32]` (bytes 0..32) is set.
#[inline]
pub fn q3k_value(blk: &[u8], i: usize) -> i32 {
    let high = (blk[i % 32] >> (i / 32)) & 1;
    i32::from(two_bit(&blk[32..96], i) | (high << 2)) - 4
}

/// Q3_K's sixteen 6-bit scales (offset 32) from the 12 bytes at 96..108: scale `k` takes its low 4 bits from
/// byte `k % 8` (low nibble for `k < 8`, high nibble after) and its top 2 bits from byte `8 + k % 4`, bits
/// `2·(k / 4)`.
#[inline]
pub fn q3k_scale(scales: &[u8], k: usize) -> i32 {
    let low = (scales[k % 8] >> (4 * (k / 8))) & 0x0f;
    let high = (scales[8 + k % 4] >> (2 * (k / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

/// GGML Q2_K: 256 × 2-bit in sixteen sub-blocks of 16, each with a 4-bit scale and a 4-bit minimum under f16
/// super-scales `d` and `dmin` stored last: `x = d·sc·q − dmin·m` (2.625 bits per weight).
pub static Q2_K: BlockFormat = BlockFormat {
    dtype: DType::Q2_K,
    name: "q2_k",
    ggml_type: 10,
    block_elems: QK_K,
    block_bytes: 84,
    dequantize: |blk, dst| {
        let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
        for (k, sub) in dst.chunks_exact_mut(16).enumerate() {
            // The scale products rounded to f32 first, as ggml's dequantizer does.
            let (dl, ml) = (d * (blk[k] & 0x0f) as f32, dmin * (blk[k] >> 4) as f32);
            for (l, o) in sub.iter_mut().enumerate() {
                *o = dl * q2k_value(blk, 16 * k + l) as f32 - ml;
            }
        }
    },
    quantize: None,
};

/// GGML Q3_K: 256 × 3-bit (offset 4: a high bit in `hmask`, two low bits in `qs`) in sixteen sub-blocks of 16
/// with 6-bit scales (offset 32) under an f16 `d` stored last (3.4375 bits per weight).
pub static Q3_K: BlockFormat = BlockFormat {
    dtype: DType::Q3_K,
    name: "q3_k",
    ggml_type: 11,
    block_elems: QK_K,
    block_bytes: 110,
    dequantize: |blk, dst| {
        let d = f16_at(blk, 108);
        for (k, sub) in dst.chunks_exact_mut(16).enumerate() {
            let dl = d * q3k_scale(&blk[96..108], k) as f32;
            for (l, o) in sub.iter_mut().enumerate() {
                *o = dl * q3k_value(blk, 16 * k + l) as f32;
            }
        }
    },
    quantize: None,
};

/// Q4_K/Q5_K: `x = d·sc_j·q − dmin·m_j`, the scale products rounded to f32 first as ggml does.
fn dequantize_k(blk: &[u8], dst: &mut [f32], value: fn(&[u8], usize) -> u8) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    for (j, sub) in dst.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k4_scale_min(&blk[4..16], j);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        for (l, o) in sub.iter_mut().enumerate() {
            *o = d1 * value(blk, 32 * j + l) as f32 - m1;
        }
    }
}

/// GGML Q4_K: 256 × 4-bit in eight sub-blocks, each with a 6-bit scale and minimum under f16 super-scales
/// `d` and `dmin` (4.5 bits per weight).
pub static Q4_K: BlockFormat = BlockFormat {
    dtype: DType::Q4_K,
    name: "q4_k",
    ggml_type: 12,
    block_elems: QK_K,
    block_bytes: 144,
    dequantize: |blk, dst| dequantize_k(blk, dst, q4k_value),
    quantize: None,
};

/// GGML Q5_K: Q4_K with a fifth bit per element (5.5 bits per weight).
pub static Q5_K: BlockFormat = BlockFormat {
    dtype: DType::Q5_K,
    name: "q5_k",
    ggml_type: 13,
    block_elems: QK_K,
    block_bytes: 176,
    dequantize: |blk, dst| dequantize_k(blk, dst, q5k_value),
    quantize: None,
};

/// GGML Q6_K: 256 × 6-bit (offset 32) in sixteen sub-blocks of 16 with i8 scales under an f16 `d` stored last
/// (6.5625 bits per weight).
pub static Q6_K: BlockFormat = BlockFormat {
    dtype: DType::Q6_K,
    name: "q6_k",
    ggml_type: 14,
    block_elems: QK_K,
    block_bytes: 210,
    dequantize: |blk, dst| {
        let d = f16_at(blk, 208);
        for (i, o) in dst.iter_mut().enumerate() {
            *o = d * (blk[192 + i / 16] as i8) as f32 * q6k_value(blk, i) as f32;
        }
    },
    quantize: None,
};

/// GGML Q8_K: 256 × i8 with an f32 scale, then sixteen i16 sums of 16 (ggml's activation format for K-quant
/// dot products; a file may store it too).
pub static Q8_K: BlockFormat = BlockFormat {
    dtype: DType::Q8_K,
    name: "q8_k",
    ggml_type: 15,
    block_elems: QK_K,
    block_bytes: 292,
    dequantize: |blk, dst| {
        let d = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
        for (o, &q) in dst.iter_mut().zip(&blk[4..4 + QK_K]) {
            *o = d * (q as i8) as f32;
        }
    },
    quantize: None,
};

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// A Q4_K block worked out by hand from ggml's `dequantize_row_q4_K` and `get_scale_min_k4`.
    #[test]
    fn q4_k_block_dequantizes_as_ggml() {
        let mut blk = vec![0u8; 144];
        blk[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        blk[2..4].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let scales = &mut blk[4..16];
        scales[1] = 3; // sub-block 1: scale 3
        scales[5] = 2; // sub-block 1: min 2
        // Sub-block 6: scale 0b01_0101 (low nibble 5 in byte 10, top bits 01 in byte 2),
        // min 0b10_0011 (high nibble 3 in byte 10, top bits 10 in byte 6).
        scales[10] = 0x35;
        scales[2] = 0b01 << 6;
        scales[6] = 0b10 << 6;
        assert_eq!(k4_scale_min(scales, 6), (21, 35));
        blk[16 + 7] = 0x90; // element 7 of sub-block 0 (low nibble 0), element 39 (sub-block 1, high nibble 9)
        blk[16 + 96 + 4] = 0x0b; // element 196: sub-block 6 (low nibbles of bytes 96..128), value 11
        let mut out = [0f32; QK_K];
        (Q4_K.dequantize)(&blk, &mut out);
        assert_eq!(out[39], 0.5 * 3.0 * 9.0 - 0.25 * 2.0);
        assert_eq!(out[38], -0.25 * 2.0);
        assert_eq!(out[196], 0.5 * 21.0 * 11.0 - 0.25 * 35.0);
        assert_eq!(out[7], 0.0);
    }

    /// Q5_K's fifth bit and Q6_K's element order and scales, by hand from ggml's dequantizers.
    #[test]
    fn q5_k_and_q6_k_place_their_high_bits_as_ggml() {
        let mut blk = vec![0u8; 176];
        blk[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        blk[4 + 3] = 1; // sub-block 3: scale 1, min 0
        blk[16 + 5] = 1 << 3; // bit 3 of qh[5]: element 5 of sub-block 3 gets +16
        blk[48 + 32 + 5] = 0x20; // its nibble (high, pair 1): 2
        let mut out = [0f32; QK_K];
        (Q5_K.dequantize)(&blk, &mut out);
        assert_eq!(out[3 * 32 + 5], 18.0);
        assert_eq!(out[2 * 32 + 5], 0.0, "sub-block 2 has scale 0");

        let mut blk = vec![0u8; 210];
        blk[208..210].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for (k, s) in blk[192..208].iter_mut().enumerate() {
            *s = (k as i8 - 8) as u8;
        }
        // Element 128 + 64 + 20 (second half, quarter 2, l = 20): high nibble of ql[64 + 20], qh[128 + 32 + 20]
        // bits 4..6; scale index 8 + 4 + 1 = 13 = (212) / 16.
        blk[64 + 20] = 0x70;
        blk[128 + 32 + 20] = 0b10 << 4;
        let i = 128 + 64 + 20;
        assert_eq!(q6k_value(&blk, i), (7 | (2 << 4)) - 32);
        let mut out = [0f32; QK_K];
        (Q6_K.dequantize)(&blk, &mut out);
        assert_eq!(out[i], 0.5 * 5.0 * 7.0);
        assert_eq!(out[0], 0.5 * -8.0 * -32.0, "a zero byte is -32 under scale -8");
    }

    /// Q2_K's and Q3_K's element order, scales and Q3_K's high bit, by hand from ggml's `dequantize_row_q2_K` and
    /// `dequantize_row_q3_K`.
    #[test]
    fn q2_k_and_q3_k_place_bits_and_scales_as_ggml() {
        let mut blk = vec![0u8; 84];
        blk[80..82].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        blk[82..84].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        // Element 128 + 64 + 20 = 212: second half (qs bytes 32..64), quarter 2 (bits 4..6), l = 20; its
        // sub-block is 212 / 16 = 13: scale 3 (low nibble), minimum 5 (high nibble).
        blk[16 + 32 + 20] = 0b10 << 4;
        blk[13] = 0x53;
        let mut out = [0f32; QK_K];
        (Q2_K.dequantize)(&blk, &mut out);
        assert_eq!(q2k_value(&blk, 212), 2);
        assert_eq!(out[212], 0.5 * 3.0 * 2.0 - 0.25 * 5.0);
        assert_eq!(out[213], -0.25 * 5.0, "same sub-block, value 0");
        assert_eq!(out[0], 0.0, "scale and minimum 0");

        let mut blk = vec![0u8; 110];
        blk[108..110].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        // Scales: k = 13 takes the high nibble of byte 96 + 5 and bits 6..8 of byte 96 + 8 + 1: 0b01_0111 = 23,
        // minus 32 is -9. k = 2: low nibble of byte 96 + 2, bits 0..2 of byte 96 + 10: 0b10_0001 = 33 -> 1.
        blk[96 + 5] = 0x70;
        blk[96 + 9] = 0b01 << 6;
        blk[96 + 2] = 0x01;
        blk[96 + 10] = 0b10;
        assert_eq!((q3k_scale(&blk[96..108], 13), q3k_scale(&blk[96..108], 2)), (-9, 1));
        // Element 212 (sub-block 13): low bits 3 at quarter 2 of the second half, high bit = bit 212 / 32 = 6 of
        // hmask[212 % 32 = 20]: 3 + 4 - 4 = 3. Element 213: low bits 0, high bit clear: -4.
        blk[32 + 32 + 20] = 0b11 << 4;
        blk[20] = 1 << 6;
        // Element 40 (sub-block 2, quarter 1 of the first half, l = 8): low bits 1, high bit (1 of hmask[8]) set.
        blk[32 + 8] = 0b01 << 2;
        blk[8] = 1 << 1;
        let mut out = [0f32; QK_K];
        (Q3_K.dequantize)(&blk, &mut out);
        assert_eq!((q3k_value(&blk, 212), q3k_value(&blk, 213), q3k_value(&blk, 40)), (3, -4, 1));
        assert_eq!(out[212], 0.5 * -9.0 * 3.0);
        assert_eq!(out[213], 0.5 * -9.0 * -4.0);
        assert_eq!(out[40], 0.5 * 1.0 * 1.0);
        assert_eq!(out[0], 0.5 * -32.0 * -4.0, "a zero block is -4 under scale -32");
    }
}
