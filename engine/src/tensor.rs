//! Host-side tensors as read from model files: an element type, a shape and bytes that are borrowed from a
//! memory map (zero-copy), owned, or a window of a shared anonymous mapping (the CPU backend's weight arena).

use std::fmt;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::{Mmap, MmapRaw};

use crate::quant;
use crate::{Error, Result};

/// Element types a weight can be stored in.
// The block formats keep ggml's names (`Q4_K`), as `Q8_0` does.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// GGML Q8_0 ([`quant::Q8_0`]).
    Q8_0,
    /// GGML Q4_0 ([`quant::Q4_0`]).
    Q4_0,
    /// GGML Q4_1 ([`quant::Q4_1`]).
    Q4_1,
    /// GGML Q5_0 ([`quant::Q5_0`]).
    Q5_0,
    /// GGML Q5_1 ([`quant::Q5_1`]).
    Q5_1,
    /// GGML Q8_K ([`quant::Q8_K`]).
    Q8_K,
    /// GGML Q2_K ([`quant::Q2_K`]).
    Q2_K,
    /// GGML Q3_K ([`quant::Q3_K`]).
    Q3_K,
    /// GGML Q4_K ([`quant::Q4_K`]).
    Q4_K,
    /// GGML Q5_K ([`quant::Q5_K`]).
    Q5_K,
    /// GGML Q6_K ([`quant::Q6_K`]).
    Q6_K,
}

impl DType {
    /// Elements per storage block (1 for float types; see [`quant::BlockFormat`]).
    pub fn block_elems(self) -> usize {
        quant::format(self).map_or(1, |f| f.block_elems)
    }

    /// Bytes per storage block (the element size for float types).
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            q => quant::format(q).map_or(0, |f| f.block_bytes),
        }
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_elems()).then(|| (n / self.block_elems()).checked_mul(self.block_bytes())).flatten()
    }

    /// Whether this is a block-quantized type.
    pub fn is_quantized(self) -> bool {
        quant::format(self).is_some()
    }

    /// Parses the names used on the command line and in safetensors headers.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => DType::F32,
            "f16" | "float16" | "fp16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            name => return quant::FORMATS.iter().find(|f| f.name == name).map(|f| f.dtype),
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            q => quant::format(*q).map_or("?", |f| f.name),
        })
    }
}

/// Bytes of a tensor: a window into a shared memory map, or an owned 4-byte-aligned buffer.
#[derive(Clone)]
pub enum Bytes {
    /// Zero-copy view into a mapped file.
    Mapped {
        /// The map (kept alive by this reference).
        map: Arc<Mmap>,
        /// Start of the window.
        offset: usize,
        /// Length of the window.
        len: usize,
    },
    /// Owned bytes, stored in `u32`s so float views are aligned.
    Owned {
        /// Backing words.
        words: Arc<Vec<u32>>,
        /// Length in bytes.
        len: usize,
    },
    /// A window of an anonymous mapping shared by many tensors (the CPU backend's weight arena).
    Arena(ArenaWindow),
}

/// A written, frozen window of a shared anonymous mapping; only `ArenaWindow::new` makes one, so a window
/// always lies inside its map.
#[derive(Clone)]
pub struct ArenaWindow {
    map: Arc<MmapRaw>,
    offset: usize,
    len: usize,
}

impl ArenaWindow {
    /// Bytes `offset..offset + len` of `map`.
    ///
    /// # Safety
    /// The range must lie inside `map`, hold initialized bytes, and not be written through any pointer for as long
    /// as the window (or a clone) lives; other ranges of `map` may be.
    pub(crate) unsafe fn new(map: Arc<MmapRaw>, offset: usize, len: usize) -> Self {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= map.len()));
        ArenaWindow { map, offset, len }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `new`'s contract: the range is inside the live map, written, and frozen.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.offset), self.len) }
    }
}

impl Bytes {
    /// Copies `data` into an owned, aligned buffer.
    pub fn owned(data: &[u8]) -> Self {
        let mut words = vec![0u32; data.len().div_ceil(4)];
        bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..data.len()].copy_from_slice(data);
        Bytes::Owned { words: Arc::new(words), len: data.len() }
    }

    /// Takes a window of a map, copying it when it is not 4-byte aligned.
    pub fn mapped(map: Arc<Mmap>, offset: usize, len: usize) -> Self {
        if (map.as_ptr() as usize + offset).is_multiple_of(4) {
            Bytes::Mapped { map, offset, len }
        } else {
            Bytes::owned(&map[offset..offset + len])
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            Bytes::Owned { words, len } => &bytemuck::cast_slice::<u32, u8>(words)[..*len],
            Bytes::Arena(window) => window.as_slice(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Bytes::Mapped { len, .. } | Bytes::Owned { len, .. } | Bytes::Arena(ArenaWindow { len, .. }) => *len,
        }
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells the kernel how the pages of a mapped window will be used; other bytes are left as they are.
    /// `DontNeed` drops the window's pages from this process's resident set: the map is read-only, so the next
    /// read faults them in again from the file (or the page cache). Pages shared with a neighbouring tensor are
    /// dropped too, which costs that tensor a fault, never its contents.
    pub fn advise(&self, paging: Paging) -> Result<()> {
        let Bytes::Mapped { map, offset, len } = self else {
            return Ok(());
        };
        let result = match paging {
            Paging::WillNeed => map.advise_range(memmap2::Advice::WillNeed, *offset, *len),
            // SAFETY: the map is never written through (it is a read-only `Mmap`), so dropping its pages loses
            // nothing: they read back from the file, which stays open and unchanged while the map lives.
            Paging::DontNeed => unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, *offset, *len)
            },
        };
        result.map_err(|e| Error::Device(format!("madvise({paging:?}) on {len} mapped weight bytes: {e}")))
    }

    /// The same bytes backed by a file, so their pages can leave memory ([`Bytes::advise`]): a mapped window as
    /// it is, other bytes written to an unnamed temporary file in `dir` (gone when the last map of it is).
    pub fn spill(&self, dir: &Path) -> Result<Bytes> {
        if matches!(self, Bytes::Mapped { .. }) {
            return Ok(self.clone());
        }
        Bytes::spilled(self.as_slice(), dir)
    }

    /// `data` written to an unnamed temporary file in `dir` and mapped from it (the file is gone when the last
    /// map of it is), without first copying it into memory of its own.
    pub(crate) fn spilled(data: &[u8], dir: &Path) -> Result<Bytes> {
        if data.is_empty() {
            return Ok(Bytes::owned(data));
        }
        let io = |e| Error::io(dir, e);
        let mut file = tempfile::tempfile_in(dir).map_err(io)?;
        file.write_all(data).map_err(io)?;
        // SAFETY: the file is unnamed and private to this process, so nothing else can change it under the map.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Ok(Bytes::mapped(Arc::new(map), 0, data.len()))
    }
}

/// How the pages of a mapped tensor will be used next (see [`Bytes::advise`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Paging {
    /// Read soon: start reading the pages in.
    WillNeed,
    /// Not needed until further notice: let them go.
    DontNeed,
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bytes::Mapped { len, .. } => write!(f, "Mapped({len} bytes)"),
            Bytes::Owned { len, .. } => write!(f, "Owned({len} bytes)"),
            Bytes::Arena(w) => write!(f, "Arena({} bytes)", w.len),
        }
    }
}

/// A weight tensor on the host. Shapes use Hugging Face order: a matrix is `[out, in]`, row-major.
#[derive(Debug, Clone)]
pub struct HostTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Raw little-endian bytes.
    pub bytes: Bytes,
}

impl HostTensor {
    /// Builds a tensor, checking the byte length matches shape and type.
    pub fn new(name: &str, dtype: DType, shape: Vec<usize>, bytes: Bytes) -> Result<Self> {
        let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let row = shape.last().copied().unwrap_or(1);
        let expected = if !row.is_multiple_of(dtype.block_elems()) { None } else { n.and_then(|n| dtype.bytes_for(n)) };
        match expected {
            Some(b) if b == bytes.len() => Ok(HostTensor { dtype, shape, bytes }),
            _ => Err(Error::Shape {
                op: "load",
                reason: format!("tensor {name:?}: {} bytes do not hold {shape:?} of {dtype}", bytes.len()),
            }),
        }
    }

    /// An owned f32 tensor.
    pub fn from_f32(shape: Vec<usize>, data: &[f32]) -> Self {
        HostTensor { dtype: DType::F32, shape, bytes: Bytes::owned(bytemuck::cast_slice(data)) }
    }

    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks the shape.
    pub fn expect_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        if self.shape == expected {
            Ok(())
        } else {
            Err(Error::ShapeMismatch { name: name.into(), actual: self.shape.clone(), expected: expected.to_vec() })
        }
    }

    /// All elements as f32 (dequantizing or widening as needed).
    pub fn to_f32(&self) -> Vec<f32> {
        let b = self.bytes.as_slice();
        match self.dtype {
            DType::F32 => bytemuck::cast_slice::<u8, f32>(b).to_vec(),
            DType::F16 => bytemuck::cast_slice::<u8, f16>(b).iter().map(|x| x.to_f32()).collect(),
            DType::BF16 => bytemuck::cast_slice::<u8, bf16>(b).iter().map(|x| x.to_f32()).collect(),
            q => {
                let mut out = vec![0f32; self.elems()];
                quant::dequantize(q, b, &mut out);
                out
            }
        }
    }

    /// Converts to another float type (quantized targets are not produced here).
    pub fn convert(&self, to: DType) -> Self {
        if to == self.dtype || to.is_quantized() {
            return self.clone();
        }
        let v = self.to_f32();
        let bytes = match to {
            DType::F32 => Bytes::owned(bytemuck::cast_slice(&v)),
            DType::F16 => {
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                Bytes::owned(bytemuck::cast_slice(&h))
            }
            _ => {
                let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
                Bytes::owned(bytemuck::cast_slice(&h))
            }
        };
        HostTensor { dtype: to, shape: self.shape.clone(), bytes }
    }

    /// Reorders the rows of a 2-D tensor (the elements of a 1-D one): output row `i` is input row `src[i]`.
    pub fn permute_rows(&self, src: &[usize]) -> Self {
        let b = self.bytes.as_slice();
        let row_bytes = b.len() / self.shape[0].max(1);
        let mut out = Vec::with_capacity(b.len());
        for &r in src {
            out.extend_from_slice(&b[r * row_bytes..(r + 1) * row_bytes]);
        }
        HostTensor { dtype: self.dtype, shape: self.shape.clone(), bytes: Bytes::owned(&out) }
    }
}

/// Reads the f16 at `b[i..i+2]`.
#[inline]
pub fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_wrong_byte_length() {
        let err = HostTensor::new("w", DType::F32, vec![2, 3], Bytes::owned(&[0u8; 20])).expect_err("short");
        assert!(err.to_string().contains("\"w\""));
    }
}
