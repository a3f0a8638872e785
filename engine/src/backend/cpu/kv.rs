//! The CPU backend's paged KV storage in each [`KvDtype`]: rows are converted as they are written (f16/bf16
//! rounded to nearest even, q8_0 quantized per 32-element block by [`quant::Q8_0`]'s reference quantizer) and
//! read by attention in place (f32, and f16/bf16 where the CPU converts them in registers) or as f32 one head at
//! a time (q8_0).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::CpuTensor;
use super::pages::Pages;
use crate::backend::AttnSeq;
use crate::quant::{self, QK};
use crate::{Error, KvDtype, Result};

/// One layer's keys or values, `num_blocks × block_size` rows of `kv_dim` elements, in the cache's type, in
/// pages of their own (returned to the system when the cache is dropped, see [`Pages`]).
#[derive(Debug)]
pub(super) enum KvStore {
    /// Exact; attention reads it in place.
    F32(Pages<f32>),
    /// IEEE half.
    F16(Pages<f16>),
    /// bfloat16.
    Bf16(Pages<bf16>),
    /// GGML Q8_0 blocks, `kv_dim / 32` per row.
    Q8_0(Pages<u8>),
}

impl KvStore {
    fn zeros(dtype: KvDtype, rows: usize, kv_dim: usize) -> Result<Self> {
        let elements = rows * kv_dim;
        Ok(match dtype {
            KvDtype::F32 => KvStore::F32(Pages::zeroed(elements)?),
            KvDtype::F16 => KvStore::F16(Pages::zeroed(elements)?),
            KvDtype::Bf16 => KvStore::Bf16(Pages::zeroed(elements)?),
            KvDtype::Q8_0 => KvStore::Q8_0(Pages::zeroed(rows * dtype.row_bytes(kv_dim)?)?),
        })
    }

    /// Writes to each page, so the lazily mapped zeroes become resident.
    fn prefault(&mut self) {
        fn touch<T: Copy>(v: &mut [T]) {
            for x in v.iter_mut().step_by((4096 / size_of::<T>()).max(1)) {
                // Volatile: a plain store of the value already there may be optimised away.
                // SAFETY: `x` is a valid, aligned, exclusive reference.
                unsafe { std::ptr::write_volatile(x, *x) };
            }
        }
        match self {
            KvStore::F32(v) => touch(v),
            KvStore::F16(v) => touch(v),
            KvStore::Bf16(v) => touch(v),
            KvStore::Q8_0(v) => touch(v),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            KvStore::F32(v) => v.len() * 4,
            KvStore::F16(v) => v.len() * 2,
            KvStore::Bf16(v) => v.len() * 2,
            KvStore::Q8_0(v) => v.len(),
        }
    }

    /// Stores `src` (one row of `kv_dim` values) at `slot`. `scratch` holds a quantized row between calls.
    fn write(&mut self, slot: usize, src: &[f32], scratch: &mut Vec<u8>) {
        let n = src.len();
        match self {
            KvStore::F32(v) => v[slot * n..][..n].copy_from_slice(src),
            KvStore::F16(v) => v[slot * n..][..n].convert_from_f32_slice(src),
            KvStore::Bf16(v) => v[slot * n..][..n].convert_from_f32_slice(src),
            KvStore::Q8_0(v) => {
                scratch.clear();
                quant::quantize_q8_0(src, scratch);
                v[slot * scratch.len()..][..scratch.len()].copy_from_slice(scratch);
            }
        }
    }

    /// Elements `col..col + dst.len()` of the row at `slot` (rows `kv_dim` wide), as f32.
    fn read(&self, slot: usize, kv_dim: usize, col: usize, dst: &mut [f32]) {
        let at = slot * kv_dim + col;
        match self {
            KvStore::F32(v) => dst.copy_from_slice(&v[at..][..dst.len()]),
            KvStore::F16(v) => v[at..][..dst.len()].convert_to_f32_slice(dst),
            KvStore::Bf16(v) => v[at..][..dst.len()].convert_to_f32_slice(dst),
            KvStore::Q8_0(v) => {
                // A head may start or end inside a block (heads narrower than 32): dequantize the blocks it
                // touches and keep its part.
                let f = &quant::Q8_0;
                let row = &v[slot * (kv_dim / QK) * f.block_bytes..];
                let mut block = [0f32; QK];
                let (mut c, end) = (col, col + dst.len());
                while c < end {
                    let b = c / QK;
                    (f.dequantize)(&row[b * f.block_bytes..][..f.block_bytes], &mut block);
                    let upto = end.min((b + 1) * QK);
                    dst[c - col..upto - col].copy_from_slice(&block[c - b * QK..upto - b * QK]);
                    c = upto;
                }
            }
        }
    }
}

/// Paged keys and values for one layer, in the cache's [`KvDtype`].
#[derive(Debug)]
pub struct CpuKvLayer {
    pub(super) k: KvStore,
    pub(super) v: KvStore,
    pub(super) kv_dim: usize,
    pub(super) block_size: usize,
}

impl CpuKvLayer {
    /// `num_blocks × block_size` zeroed slots of `kv_dim` keys and values stored as `dtype`.
    pub fn new(num_blocks: usize, block_size: usize, kv_dim: usize, dtype: KvDtype) -> Result<Self> {
        let rows = num_blocks * block_size;
        Ok(CpuKvLayer {
            k: KvStore::zeros(dtype, rows, kv_dim)?,
            v: KvStore::zeros(dtype, rows, kv_dim)?,
            kv_dim,
            block_size,
        })
    }

    /// Bytes the keys and values take.
    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }

    /// Makes the keys and values resident (see [`crate::backend::Backend::prefault_kv_layer`]).
    pub(super) fn prefault(&mut self) {
        self.k.prefault();
        self.v.prefault();
    }

    /// The f32 keys and values when the cache stores f32 (attention reads those in place).
    pub(super) fn as_f32(&self) -> Option<(&[f32], &[f32])> {
        match (&self.k, &self.v) {
            (KvStore::F32(k), KvStore::F32(v)) => Some((k, v)),
            _ => None,
        }
    }

    /// The f16 keys and values when the cache stores f16 (attention reads those in place where the CPU converts
    /// them in registers).
    pub(super) fn as_f16(&self) -> Option<(&[f16], &[f16])> {
        match (&self.k, &self.v) {
            (KvStore::F16(k), KvStore::F16(v)) => Some((k, v)),
            _ => None,
        }
    }

    /// The bf16 keys and values when the cache stores bf16 (read in place as f16 is).
    pub(super) fn as_bf16(&self) -> Option<(&[bf16], &[bf16])> {
        match (&self.k, &self.v) {
            (KvStore::Bf16(k), KvStore::Bf16(v)) => Some((k, v)),
            _ => None,
        }
    }

    /// Cache slot of position `pos` through a block table.
    fn slot(&self, blocks: &[u32], pos: usize) -> usize {
        blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Scatters new keys/values into their cache slots.
    pub(super) fn write(&mut self, k: &CpuTensor, v: &CpuTensor, seqs: &[AttnSeq<'_>]) -> Result<()> {
        let kv_dim = self.kv_dim;
        let mut scratch = Vec::new();
        for s in seqs {
            if s.blocks.len() * self.block_size < s.start_pos + s.len {
                return Err(Error::Shape {
                    op: "attention",
                    reason: format!("position {} has no KV block ({} blocks)", s.start_pos + s.len - 1, s.blocks.len()),
                });
            }
            for t in 0..s.len {
                let slot = self.slot(s.blocks, s.start_pos + t);
                let row = s.row + t;
                self.k.write(slot, &k.data[row * kv_dim..(row + 1) * kv_dim], &mut scratch);
                self.v.write(slot, &v.data[row * kv_dim..(row + 1) * kv_dim], &mut scratch);
            }
        }
        Ok(())
    }

    /// Positions `0..ctx` of one head (columns `head..head + head_dim`) as f32 rows of `head_dim`, keys into
    /// `k` and values into `v`, each resized to `ctx × head_dim`.
    pub(super) fn read_head(
        &self,
        blocks: &[u32],
        head: usize,
        head_dim: usize,
        ctx: usize,
        k: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) {
        k.resize(ctx * head_dim, 0.0);
        v.resize(ctx * head_dim, 0.0);
        for (j, (kr, vr)) in k.chunks_exact_mut(head_dim).zip(v.chunks_exact_mut(head_dim)).enumerate() {
            let slot = self.slot(blocks, j);
            self.k.read(slot, self.kv_dim, head, kr);
            self.v.read(slot, self.kv_dim, head, vr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_within_each_types_rounding() -> Result<()> {
        // 64 columns: two Q8_0 blocks per row; read back heads of 16 that start inside a block.
        let kv_dim = 64;
        let row: Vec<f32> = (0..kv_dim).map(|i| ((i * 37 % 61) as f32 - 30.0) / 7.0).collect();
        let x = CpuTensor { data: row.clone(), rows: 1, cols: kv_dim };
        let blocks = [1u32, 0];
        // Worst error allowed per element: f16 and bf16 round to 11 and 8 significant bits; Q8_0 to half a step
        // of its block's max / 127, plus its f16 scale's rounding times at most 127 steps.
        let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (dtype, bound) in [
            (KvDtype::F32, 0.0),
            (KvDtype::F16, amax / 2048.0),
            (KvDtype::Bf16, amax / 256.0),
            (KvDtype::Q8_0, amax / 254.0 + amax / 2048.0),
        ] {
            let mut layer = CpuKvLayer::new(2, 4, kv_dim, dtype)?;
            assert_eq!(layer.bytes(), 2 * 2 * 4 * dtype.row_bytes(kv_dim)?);
            layer.write(&x, &x, &[AttnSeq { row: 0, len: 1, start_pos: 5, blocks: &blocks }])?;
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for head in [0, 16, 24, 48] {
                layer.read_head(&blocks, head, 16, 6, &mut k, &mut v);
                assert_eq!(k, v);
                assert!(k[..5 * 16].iter().all(|&x| x == 0.0), "{dtype}: unwritten positions are zero");
                for (i, (a, b)) in k[5 * 16..].iter().zip(&row[head..head + 16]).enumerate() {
                    assert!((a - b).abs() <= bound, "{dtype}, column {}: {a} vs {b}", head + i);
                }
            }
            if dtype == KvDtype::F32 {
                assert_eq!(&k[5 * 16..], &row[48..64]);
            }
        }
        let short = CpuKvLayer::new(2, 4, kv_dim, KvDtype::F16)?.write(
            &x,
            &x,
            &[AttnSeq { row: 0, len: 1, start_pos: 8, blocks: &blocks }],
        );
        assert!(short.is_err(), "a position past the block table is refused");
        assert!(matches!(CpuKvLayer::new(1, 1, 48, KvDtype::Q8_0), Err(Error::KvDim { kv_dim: 48, .. })));
        Ok(())
    }
}
