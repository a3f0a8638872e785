//! GGML block-quantized weight formats: one [`BlockFormat`] per format gives its block geometry, GGUF type code,
//! the scalar reference dequantizer and, where strata writes the format, the reference quantizer (llama.cpp's
//! rounding). [`DType`]'s block queries, GGUF type mapping and dequantization all read this table; backend
//! kernels are selected from it by format (the CPU backend's `backend::cpu::kernels`, the CUDA kernels by
//! [`BlockFormat::name`]). The 32-element formats are here, the 256-element K-quants in `quant/kquant.rs`.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::tensor::{Bytes, DType, HostTensor, f16_at};
use crate::{Error, Result};

mod kquant;

pub use kquant::{
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, QK_K, k4_scale_min, q2k_value, q3k_scale, q3k_value, q4k_value, q5k_value,
    q6k_value,
};

/// Elements per block of the 32-element GGML formats, and per sub-block of the K-quants: the unit the CPU
/// kernels quantize activations in.
pub const QK: usize = 32;

/// Appends the blocks of `src` (a multiple of the block's elements long) to `out`.
pub type Quantizer = fn(src: &[f32], out: &mut Vec<u8>);

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
    /// Appends the blocks of `src` (a multiple of `block_elems` long), rounding as llama.cpp's reference
    /// quantizer does; `None` for formats strata reads but does not write (the K-quants, whose llama.cpp
    /// quantizers search for scales; strata leaves making them to `llama-quantize`).
    pub quantize: Option<Quantizer>,
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
    quantize: Some(quantize_q8_0),
};

/// [`Q8_0`]'s quantizer, by name for the KV cache's hot path.
pub fn quantize_q8_0(src: &[f32], out: &mut Vec<u8>) {
    for b in src.chunks_exact(QK) {
        let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(b.iter().map(|x| ((x * id).round() as i8) as u8));
    }
}

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
    quantize: Some(|src, out| {
        for b in src.chunks_exact(QK) {
            let id = push_signed_step(b, -8.0, out);
            let q = |x: f32| ((x * id + 8.5) as i32).clamp(0, 15) as u8;
            out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
        }
    }),
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
    quantize: Some(|src, out| {
        for b in src.chunks_exact(QK) {
            let (min, id) = push_min_step(b, 15.0, out);
            let q = |x: f32| (((x - min) * id + 0.5) as i32).clamp(0, 15) as u8;
            out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
        }
    }),
};

/// GGML Q5_0: blocks of 32 × 5-bit with an f16 scale, offset 16: low 4 bits as Q4_0's nibbles, bit 4 of
/// element `i` is bit `i` of a little-endian u32 stored after the scale.
pub static Q5_0: BlockFormat = BlockFormat {
    dtype: DType::Q5_0,
    name: "q5_0",
    ggml_type: 6,
    block_elems: QK,
    block_bytes: 22,
    dequantize: |blk, dst| {
        let d = f16_at(blk, 0);
        for (i, o) in dst.iter_mut().enumerate() {
            *o = d * (five_bit(&blk[2..22], i) as i32 - 16) as f32;
        }
    },
    quantize: Some(|src, out| {
        for b in src.chunks_exact(QK) {
            let id = push_signed_step(b, -16.0, out);
            // ggml truncates through an int8 before clamping: x·id + 16.5 lies in [0.5, 32.5].
            push_five_bit(b.iter().map(|x| ((x * id + 16.5) as i8 as i32).clamp(0, 31) as u8), out);
        }
    }),
};

/// GGML Q5_1: blocks of 32 × 5-bit with an f16 scale and an f16 minimum; bits as in Q5_0.
pub static Q5_1: BlockFormat = BlockFormat {
    dtype: DType::Q5_1,
    name: "q5_1",
    ggml_type: 7,
    block_elems: QK,
    block_bytes: 24,
    dequantize: |blk, dst| {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        for (i, o) in dst.iter_mut().enumerate() {
            *o = d * five_bit(&blk[4..24], i) as f32 + m;
        }
    },
    quantize: Some(|src, out| {
        for b in src.chunks_exact(QK) {
            let (min, id) = push_min_step(b, 31.0, out);
            push_five_bit(b.iter().map(|x| (((x - min) * id + 0.5) as i32).clamp(0, 31) as u8), out);
        }
    }),
};

/// ggml's Q4_0/Q5_0 scale: the element of largest magnitude, with its sign, over `bottom` (-8 or -16), so that
/// element maps to code 0 and the opposite end clips. Appends the scale as f16; returns its inverse (0 for 0).
fn push_signed_step(b: &[f32], bottom: f32, out: &mut Vec<u8>) -> f32 {
    let max = b.iter().fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
    let d = max / bottom;
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// ggml's Q4_1/Q5_1 fit: the block's range over `steps` (15 or 31) from its minimum. Appends step and minimum as
/// f16s; returns the minimum and the step's inverse (0 for 0).
fn push_min_step(b: &[f32], steps: f32, out: &mut Vec<u8>) -> (f32, f32) {
    let (min, max) = b.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let d = (max - min) / steps;
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
    (min, if d != 0.0 { 1.0 / d } else { 0.0 })
}

/// Element `i` (0..32) of a Q5 block's 5-bit values, `qhs` being the u32 of high bits then the 16 nibble bytes.
#[inline]
pub fn five_bit(qhs: &[u8], i: usize) -> u8 {
    let qh = u32::from_le_bytes([qhs[0], qhs[1], qhs[2], qhs[3]]);
    let nibble = if i < 16 { qhs[4 + i] & 0x0f } else { qhs[4 + i - 16] >> 4 };
    nibble | (((qh >> i) & 1) as u8) << 4
}

/// Appends 32 five-bit values as Q5 blocks store them: the u32 of high bits, then the nibbles.
pub(crate) fn push_five_bit(q: impl Iterator<Item = u8>, out: &mut Vec<u8>) {
    let q: Vec<u8> = q.collect();
    let qh = q.iter().enumerate().fold(0u32, |h, (i, &v)| h | (u32::from(v >> 4) << i));
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend((0..16).map(|j| (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4)));
}

/// Every block format, for lookups by GGUF code and for tests that cover them all.
pub static FORMATS: [&BlockFormat; 11] = [&Q8_0, &Q4_0, &Q4_1, &Q5_0, &Q5_1, &Q8_K, &Q2_K, &Q3_K, &Q4_K, &Q5_K, &Q6_K];

/// The block format of `dtype`, or `None` for float types.
pub fn format(dtype: DType) -> Option<&'static BlockFormat> {
    match dtype {
        DType::Q8_0 => Some(&Q8_0),
        DType::Q4_0 => Some(&Q4_0),
        DType::Q4_1 => Some(&Q4_1),
        DType::Q5_0 => Some(&Q5_0),
        DType::Q5_1 => Some(&Q5_1),
        DType::Q8_K => Some(&Q8_K),
        DType::Q2_K => Some(&Q2_K),
        DType::Q3_K => Some(&Q3_K),
        DType::Q4_K => Some(&Q4_K),
        DType::Q5_K => Some(&Q5_K),
        DType::Q6_K => Some(&Q6_K),
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
/// When `dtype` is a float type or a format strata does not write ([`BlockFormat::quantize`] is `None`).
pub fn quantize(dtype: DType, src: &[f32]) -> Vec<u8> {
    let q = format(dtype).and_then(|f| f.quantize).unwrap_or_else(|| panic!("strata does not quantize into {dtype}"));
    let mut out = Vec::with_capacity(src.len() / dtype.block_elems() * dtype.block_bytes());
    q(src, &mut out);
    out
}

/// Rows quantized per parallel task: enough work to amortise scheduling, little enough f32 scratch per thread.
const ROWS_PER_TASK: usize = 16;

/// Quantizes a float matrix into `to` the way llama.cpp's `llama-quantize` does without an importance matrix,
/// converting a few rows at a time, so the only extra memory is the quantized result (no f32 copy of the whole
/// tensor). Errors when the tensor is already quantized (requantizing would compound the rounding error) or its
/// rows are not whole blocks.
pub fn quantize_tensor(name: &str, t: &HostTensor, to: DType) -> Result<HostTensor> {
    let f = format(to).ok_or_else(|| Error::Config(format!("{to} is not a block-quantized type")))?;
    let quantize = f.quantize.ok_or_else(|| {
        Error::Config(format!("strata reads {to} but does not quantize into it (use llama-quantize)"))
    })?;
    if t.dtype.is_quantized() {
        return Err(Error::Config(format!("{name} is already {}; strata does not requantize", t.dtype)));
    }
    let cols = t.shape.last().copied().unwrap_or(0);
    if t.shape.len() != 2 || cols == 0 || !cols.is_multiple_of(f.block_elems) {
        return Err(Error::Shape {
            op: "quantize",
            reason: format!("{name} {:?}: rows must be a non-zero multiple of {} to be {to}", t.shape, f.block_elems),
        });
    }
    let (elem, row_out) = (t.dtype.block_bytes(), cols / f.block_elems * f.block_bytes);
    let src = t.bytes.as_slice();
    let mut words = vec![0u32; (t.shape[0] * row_out).div_ceil(4)];
    let out = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..t.shape[0] * row_out];
    out.par_chunks_mut(ROWS_PER_TASK * row_out).zip(src.par_chunks(ROWS_PER_TASK * cols * elem)).for_each(|(o, s)| {
        let mut row = vec![0f32; cols];
        let mut blocks = Vec::with_capacity(row_out);
        for (o, s) in o.chunks_exact_mut(row_out).zip(s.chunks_exact(cols * elem)) {
            widen(t.dtype, s, &mut row);
            blocks.clear();
            quantize(&row, &mut blocks);
            o.copy_from_slice(&blocks);
        }
    });
    let len = out.len();
    HostTensor::new(name, to, t.shape.clone(), Bytes::Owned { words: std::sync::Arc::new(words), len })
}

/// Widens little-endian floats of `dtype` (f32, f16 or bf16) into `out`; byte-wise, so any alignment works.
fn widen(dtype: DType, src: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F16 => {
            out.iter_mut().zip(src.chunks_exact(2)).for_each(|(o, b)| *o = f16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        DType::BF16 => {
            out.iter_mut().zip(src.chunks_exact(2)).for_each(|(o, b)| *o = bf16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        _ => {
            out.iter_mut().zip(src.chunks_exact(4)).for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
    }
}

/// A block format a user names to quantize float weights into (`--quantize`): the one parser for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum QuantDtype {
    /// GGML Q8_0 (8.5 bits per weight).
    Q8_0,
    /// GGML Q4_0 (4.5 bits per weight).
    Q4_0,
    /// GGML Q4_1 (5 bits per weight).
    Q4_1,
}

impl QuantDtype {
    /// The same format as a tensor element type.
    pub fn to_engine(self) -> DType {
        match self {
            QuantDtype::Q8_0 => DType::Q8_0,
            QuantDtype::Q4_0 => DType::Q4_0,
            QuantDtype::Q4_1 => DType::Q4_1,
        }
    }
}

impl FromStr for QuantDtype {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match DType::parse(s.trim()) {
            Some(DType::Q8_0) => Ok(QuantDtype::Q8_0),
            Some(DType::Q4_0) => Ok(QuantDtype::Q4_0),
            Some(DType::Q4_1) => Ok(QuantDtype::Q4_1),
            _ => Err(Error::InvalidValue { what: "quantization", value: s.into(), expected: "q8_0, q4_0 or q4_1" }),
        }
    }
}

impl TryFrom<String> for QuantDtype {
    type Error = Error;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<QuantDtype> for String {
    fn from(d: QuantDtype) -> Self {
        d.to_string()
    }
}

impl fmt::Display for QuantDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.to_engine().fmt(f)
    }
}

/// `n` blocks of `dtype` with random quantized bits and random but moderate scales (a few hundredths; K-quant
/// super-scales a few thousandths, as their sub-scales multiply up to 63 or ±128): every bit pattern a kernel
/// can meet, values of a plausible size. Tests use them, and so does the kernel benchmark
/// ([`crate::backend::cpu::kernel_bench`]).
pub fn random_blocks(dtype: DType, n: usize, rng: &mut impl rand::Rng) -> Vec<u8> {
    let f = format(dtype).unwrap_or_else(|| panic!("{dtype} is not a block type"));
    let mut out: Vec<u8> = (0..n * f.block_bytes).map(|_| rng.random()).collect();
    let mut half = |b: &mut [u8], at: usize, lo: f32, hi: f32| {
        b[at..at + 2].copy_from_slice(&f16::from_f32(rng.random_range(lo..hi)).to_le_bytes())
    };
    for blk in out.chunks_exact_mut(f.block_bytes) {
        match dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => half(blk, 0, -0.05, 0.05),
            DType::Q4_1 | DType::Q5_1 => {
                half(blk, 0, 0.0, 0.05);
                half(blk, 2, -0.5, 0.5);
            }
            DType::Q4_K | DType::Q5_K => {
                half(blk, 0, 0.0, 0.004);
                half(blk, 2, 0.0, 0.004);
            }
            DType::Q2_K => {
                half(blk, 80, 0.0, 0.004);
                half(blk, 82, 0.0, 0.004);
            }
            DType::Q3_K => half(blk, 108, -0.002, 0.002),
            DType::Q6_K => half(blk, 208, -0.002, 0.002),
            DType::Q8_K => blk[0..4].copy_from_slice(&0.01f32.to_le_bytes()),
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("float types have no format"),
        }
    }
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
        assert_eq!((ggml_type(DType::BF16), from_ggml_type(9)), (30, None), "Q8_1 is not read");
        assert_eq!(FORMATS.map(|f| f.ggml_type), [8, 2, 3, 6, 7, 15, 10, 11, 12, 13, 14]);
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

    /// The formats strata writes.
    fn writable() -> impl Iterator<Item = &'static BlockFormat> {
        FORMATS.into_iter().filter(|f| f.quantize.is_some())
    }

    #[test]
    fn quantize_then_dequantize_is_close_for_every_format() {
        let v: Vec<f32> = (0..4 * QK).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
        for f in writable() {
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

    /// Blocks worked out by hand from ggml-quants.c's `quantize_row_*_ref`: the cases where a plausible
    /// implementation differs from llama.cpp's (ties, the sign of Q4_0's scale, truncation instead of rounding).
    #[test]
    fn quantizers_round_as_ggml_reference() {
        let block = |head: &[f32]| {
            let mut b = [0f32; QK];
            b[..head.len()].copy_from_slice(head);
            b
        };
        // Q8_0: d = amax / 127, q = roundf(x / d): ties go away from zero (2.5 -> 3, -2.5 -> -3).
        let q = quantize(DType::Q8_0, &block(&[127.0, 2.5, -2.5, -127.0, 0.49]));
        assert_eq!(f16::from_le_bytes([q[0], q[1]]).to_f32(), 1.0);
        assert_eq!(&q[2..7], &[127u8, 3, (-3i8) as u8, (-127i8) as u8, 0]);
        // Q4_0: the scale comes from the element of largest magnitude *with its sign*: d = max / -8, so that
        // element maps to nibble 0 and the opposite end clips at 15. q = min(15, trunc(x / d + 8.5)).
        let q = quantize(DType::Q4_0, &block(&[-4.0, 4.0, 1.0, -1.0, 0.25, 3.75]));
        assert_eq!(f16::from_le_bytes([q[0], q[1]]).to_f32(), 0.5);
        let nib = |j: usize| q[2 + j] & 0x0f;
        // -4 -> 0; 4 -> trunc(16.5) = 16 -> 15; 1 -> 10; -1 -> 6; 0.25 -> trunc(9.0) = 9; 3.75 -> trunc(16.0) -> 15.
        assert_eq!([nib(0), nib(1), nib(2), nib(3), nib(4), nib(5), nib(6)], [0, 15, 10, 6, 9, 15, 8]);
        // A positive largest element gives a negative scale.
        let q = quantize(DType::Q4_0, &block(&[8.0, -1.0]));
        assert_eq!(f16::from_le_bytes([q[0], q[1]]).to_f32(), -1.0);
        assert_eq!((q[2] & 0x0f, q[3] & 0x0f, q[4] & 0x0f), (0, 9, 8));
        // Q4_1: d = (max - min) / 15, m = min, q = min(15, trunc((x - min) / d + 0.5)).
        let mut b = block(&[]);
        b.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 / 2.0 - 1.0);
        let q = quantize(DType::Q4_1, &b);
        let (d, m) = (f16::from_le_bytes([q[0], q[1]]).to_f32(), f16::from_le_bytes([q[2], q[3]]).to_f32());
        assert_eq!((d, m), (f16::from_f32(15.5 / 15.0).to_f32(), -1.0));
        // Element 1 (-0.5): 0.5 / (15.5 / 15) + 0.5 = 0.98... truncates to 0; element 16 (7.0): 8.24... -> 8.
        assert_eq!((q[4] & 0x0f, q[5] & 0x0f, q[4] >> 4), (0, 0, 8));
        // An all-zero block: zero scales (Q4_0's is -0.0, as ggml's 0 / -8) and the middle code.
        let q = quantize(DType::Q4_0, &[0f32; QK]);
        assert_eq!((q[0], q[1], q[2]), (0x00, 0x80, 0x88));
        // Q5_0: d = max / -16, q = min(31, trunc(x / d + 16.5)); bit 4 of element i is bit i of the u32 after d.
        let q = quantize(DType::Q5_0, &block(&[-8.0, 8.0, 1.0, -1.0, 0.25]));
        assert_eq!(f16::from_le_bytes([q[0], q[1]]).to_f32(), 0.5);
        let qh = u32::from_le_bytes([q[2], q[3], q[4], q[5]]);
        let v = |j: usize| (q[6 + j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        // -8 -> 0; 8 -> trunc(32.5) = 32 -> 31; 1 -> 18; -1 -> 14; 0.25 -> trunc(17.0) = 17; 0 -> 16.
        assert_eq!([v(0), v(1), v(2), v(3), v(4), v(5)], [0, 31, 18, 14, 17, 16]);
        assert_eq!(qh >> 16, 0xffff, "elements 16.. are 0 -> 16: bit 4 set");
        // Q5_1: d = (max - min) / 31, q = trunc((x - min) / d + 0.5).
        let mut b = block(&[]);
        b.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 - 1.0);
        let q = quantize(DType::Q5_1, &b);
        let (d, m) = (f16::from_le_bytes([q[0], q[1]]).to_f32(), f16::from_le_bytes([q[2], q[3]]).to_f32());
        assert_eq!((d, m), (1.0, -1.0));
        let qh = u32::from_le_bytes([q[4], q[5], q[6], q[7]]);
        assert_eq!((q[8] & 0x0f, q[8 + 15] >> 4, qh), (0, 15, 0xffff_0000), "q = i");
    }

    #[test]
    fn q5_blocks_dequantize_through_their_high_bits() {
        for f in [&Q5_0, &Q5_1] {
            let v: Vec<f32> = (0..QK).map(|i| i as f32 - 16.0).collect();
            let q = quantize(f.dtype, &v);
            let mut back = [0f32; QK];
            dequantize(f.dtype, &q, &mut back);
            // Both grids hold the integers -16..16 exactly (Q5_0 from d = -1 with -16 -> code 0 ... 15 -> 31).
            assert_eq!(back.to_vec(), v, "{}", f.name);
        }
    }

    #[test]
    fn quantize_tensor_matches_quantize_from_any_float_type_and_refuses_what_it_cannot() -> Result<()> {
        let v: Vec<f32> = (0..3 * 64).map(|i| ((i * 53 % 97) as f32 - 48.0) / 64.0).collect();
        let f32_t = HostTensor::from_f32(vec![3, 64], &v);
        for f in writable() {
            for src in [DType::F32, DType::F16, DType::BF16] {
                let t = f32_t.convert(src);
                let q = quantize_tensor("w", &t, f.dtype)?;
                assert_eq!((q.dtype, q.shape.clone()), (f.dtype, vec![3, 64]));
                assert_eq!(q.bytes.as_slice(), quantize(f.dtype, &t.to_f32()), "{src} -> {}", f.name);
            }
        }
        let q = quantize_tensor("w", &f32_t, DType::Q8_0)?;
        assert!(quantize_tensor("w", &q, DType::Q4_0).is_err(), "requantizing is refused");
        assert!(quantize_tensor("w", &f32_t, DType::F16).is_err());
        let odd = HostTensor::from_f32(vec![4, 48], &v[..192]);
        assert!(quantize_tensor("w", &odd, DType::Q8_0).is_err(), "48 is not whole blocks of 32");
        let wide = HostTensor::from_f32(vec![1, 256], &[0.5; 256]);
        for f in FORMATS.into_iter().filter(|f| f.quantize.is_none()) {
            let err = quantize_tensor("w", &wide, f.dtype).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(&format!("reads {} but does not quantize", f.name)), "{}: {err}", f.name);
        }
        Ok(())
    }

    #[test]
    fn quant_dtypes_parse_print_and_serialize_the_same_way() -> Result<()> {
        for d in [QuantDtype::Q8_0, QuantDtype::Q4_0, QuantDtype::Q4_1] {
            assert_eq!(d.to_string().parse::<QuantDtype>()?, d);
            assert_eq!(serde_json::to_string(&d).ok(), Some(format!("\"{d}\"")));
            assert_eq!(format(d.to_engine()).map(|f| f.name), Some(d.to_string().as_str()));
        }
        assert_eq!("Q4_1".parse::<QuantDtype>()?, QuantDtype::Q4_1);
        let err = "f16".parse::<QuantDtype>().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "invalid quantization \"f16\": expected q8_0, q4_0 or q4_1");
        Ok(())
    }
}
