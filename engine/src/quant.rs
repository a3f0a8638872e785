//! GGML block-quantized weight formats: one [`BlockFormat`] per format gives its block geometry, GGUF type code,
//! the scalar reference dequantizer and the reference quantizer (llama.cpp's rounding). [`DType`]'s block
//! queries, GGUF type mapping and dequantization all read this table; backend kernels are selected from it by
//! format (the CPU backend's `backend::cpu::kernels`, the CUDA kernels by [`BlockFormat::name`]).

use half::f16;

use crate::tensor::{DType, f16_at};

/// Elements per block of the GGML block-quantized types.
pub const QK: usize = 32;

/// One block-quantized storage format.
#[derive(Debug)]
pub struct BlockFormat {
    /// The element type it stores.
    pub dtype: DType,
    /// Lower-case name (`q8_0`): [`DType`]'s display form and the suffix of the CUDA kernels' names.
    pub name: &'static str,
    /// Its `ggml_type` code in GGUF files.
    pub ggml_type: u32,
    /// Elements per block.
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Dequantizes one block into `block_elems` floats (the scalar reference every kernel is checked against).
    pub dequantize: fn(blk: &[u8], dst: &mut [f32]),
    /// Appends the blocks of `src` (a multiple of `block_elems` long), rounding as llama.cpp does.
    pub quantize: fn(src: &[f32], out: &mut Vec<u8>),
}

/// GGML Q8_0: blocks of 32 × i8 with an f16 scale.
pub static Q8_0: BlockFormat = BlockFormat {
    dtype: DType::Q8_0,
    name: "q8_0",
    ggml_type: 8,
    block_elems: QK,
    block_bytes: 34,
    dequantize: |blk, dst| {
        let d = f16_at(blk, 0);
        for (o, &q) in dst.iter_mut().zip(&blk[2..34]) {
            *o = d * (q as i8) as f32;
        }
    },
    quantize: |src, out| {
        for b in src.chunks_exact(QK) {
            let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            out.extend(b.iter().map(|x| ((x * id).round() as i8) as u8));
        }
    },
};

/// GGML Q4_0: blocks of 32 × 4-bit with an f16 scale, offset 8; low nibbles hold elements 0..16.
pub static Q4_0: BlockFormat = BlockFormat {
    dtype: DType::Q4_0,
    name: "q4_0",
    ggml_type: 2,
    block_elems: QK,
    block_bytes: 18,
    dequantize: |blk, dst| {
        let d = f16_at(blk, 0);
        for j in 0..16 {
            dst[j] = d * ((blk[2 + j] & 0x0f) as i32 - 8) as f32;
            dst[j + 16] = d * ((blk[2 + j] >> 4) as i32 - 8) as f32;
        }
    },
    quantize: |src, out| {
        for b in src.chunks_exact(QK) {
            let max = b.iter().fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            let q = |x: f32| ((x * id + 8.5) as i32).clamp(0, 15) as u8;
            out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
        }
    },
};

/// GGML Q4_1: blocks of 32 × 4-bit with an f16 scale and an f16 minimum; nibbles as in Q4_0.
pub static Q4_1: BlockFormat = BlockFormat {
    dtype: DType::Q4_1,
    name: "q4_1",
    ggml_type: 3,
    block_elems: QK,
    block_bytes: 20,
    dequantize: |blk, dst| {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        for j in 0..16 {
            dst[j] = d * (blk[4 + j] & 0x0f) as f32 + m;
            dst[j + 16] = d * (blk[4 + j] >> 4) as f32 + m;
        }
    },
    quantize: |src, out| {
        for b in src.chunks_exact(QK) {
            let (min, max) = b.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
            let q = |x: f32| (((x - min) * id + 0.5) as i32).clamp(0, 15) as u8;
            out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
        }
    },
};

/// Every block format, for lookups by GGUF code and for tests that cover them all.
pub static FORMATS: [&BlockFormat; 3] = [&Q8_0, &Q4_0, &Q4_1];

/// The block format of `dtype`, or `None` for float types.
pub fn format(dtype: DType) -> Option<&'static BlockFormat> {
    match dtype {
        DType::Q8_0 => Some(&Q8_0),
        DType::Q4_0 => Some(&Q4_0),
        DType::Q4_1 => Some(&Q4_1),
        DType::F32 | DType::F16 | DType::BF16 => None,
    }
}

/// GGUF `ggml_type` codes of the float types; block formats carry their own.
const FLOAT_GGML_TYPES: [(DType, u32); 3] = [(DType::F32, 0), (DType::F16, 1), (DType::BF16, 30)];

/// The `ggml_type` code GGUF files use for `dtype`.
pub fn ggml_type(dtype: DType) -> u32 {
    match format(dtype) {
        Some(f) => f.ggml_type,
        None => FLOAT_GGML_TYPES.iter().find(|(d, _)| *d == dtype).map_or(0, |(_, c)| *c),
    }
}

/// The element type of a GGUF `ggml_type` code, when strata reads it.
pub fn from_ggml_type(code: u32) -> Option<DType> {
    FLOAT_GGML_TYPES
        .iter()
        .find(|(_, c)| *c == code)
        .map(|(d, _)| *d)
        .or_else(|| FORMATS.iter().find(|f| f.ggml_type == code).map(|f| f.dtype))
}

/// Dequantizes whole blocks of `dtype` from `src` into `dst` (`block_elems` floats per block).
///
/// # Panics
/// When `dtype` is a float type (callers branch on [`DType::is_quantized`] first).
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let f = format(dtype).unwrap_or_else(|| panic!("dequantize called with float type {dtype}"));
    for (blk, d) in src.chunks_exact(f.block_bytes).zip(dst.chunks_exact_mut(f.block_elems)) {
        (f.dequantize)(blk, d);
    }
}

/// Quantizes a row-major matrix (length a multiple of the block) into blocks of `dtype`, as llama.cpp does.
///
/// # Panics
/// When `dtype` is a float type.
pub fn quantize(dtype: DType, src: &[f32]) -> Vec<u8> {
    let f = format(dtype).unwrap_or_else(|| panic!("quantize: {dtype} is not a block type"));
    let mut out = Vec::with_capacity(src.len() / f.block_elems * f.block_bytes);
    (f.quantize)(src, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent_with_dtype_and_gguf_codes() {
        for f in FORMATS {
            assert_eq!(format(f.dtype).map(|g| g.name), Some(f.name));
            assert_eq!(f.dtype.to_string(), f.name);
            assert_eq!(DType::parse(f.name), Some(f.dtype));
            assert_eq!(from_ggml_type(ggml_type(f.dtype)), Some(f.dtype));
            assert_eq!(f.dtype.bytes_for(f.block_elems), Some(f.block_bytes));
        }
        for d in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(from_ggml_type(ggml_type(d)), Some(d));
            assert!(format(d).is_none());
        }
        assert_eq!((ggml_type(DType::BF16), from_ggml_type(6)), (30, None));
    }

    #[test]
    fn q4_1_block_dequantizes_low_then_high_nibbles() {
        let mut blk = vec![0u8; 20];
        blk[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        blk[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        blk[4] = 0x3a; // low 10, high 3
        let mut out = [0f32; 32];
        dequantize(DType::Q4_1, &blk, &mut out);
        assert_eq!(out[0], 0.5 * 10.0 - 1.0);
        assert_eq!(out[16], 0.5 * 3.0 - 1.0);
        assert_eq!(out[1], -1.0);
    }

    #[test]
    fn quantize_then_dequantize_is_close_for_every_format() {
        let v: Vec<f32> = (0..4 * QK).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
        for f in FORMATS {
            let q = quantize(f.dtype, &v);
            assert_eq!(q.len(), 4 * f.block_bytes);
            let mut back = vec![0f32; v.len()];
            dequantize(f.dtype, &q, &mut back);
            // 4-bit steps over a range of 1 are about 1/15 (Q4_0 clips the end opposite its largest magnitude by
            // one step); 8-bit ones far finer.
            let worst = v.iter().zip(&back).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 1.0 / 15.0 + 1e-3, "{}: worst error {worst}", f.name);
        }
    }
}
