//! Writing GGUF files (version 3): metadata, the tensor directory, then each tensor's data, asked of the caller
//! one tensor at a time so that a converted model is never held whole in memory. `strata convert --to gguf` and
//! the test-model builders in `crate::testing` both write through it; [`crate::loader::gguf`] reads it back.

use std::io::{BufWriter, Write};
use std::path::Path;

use crate::loader::gguf::Value;
use crate::quant;
use crate::tensor::{Bytes, DType};
use crate::{Error, Result};

/// Tensor data offsets (and the end of the header) are multiples of this; readers assume 32 when the file does
/// not say `general.alignment`.
const ALIGN: usize = 32;

/// One tensor of the directory.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Its GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Shape in Hugging Face order, outermost first (GGUF lists the reverse).
    pub shape: Vec<usize>,
    /// Element type of the data the caller hands over.
    pub dtype: DType,
    /// The `ggml_type` code written for it: `dtype`'s, unless a test wants a corrupt file.
    pub ggml_type: u32,
}

impl TensorEntry {
    /// A tensor stored as `dtype`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, dtype: DType) -> Self {
        TensorEntry { name: name.into(), shape, ggml_type: quant::ggml_type(dtype), dtype }
    }

    fn bytes(&self) -> Result<usize> {
        let n: usize = self.shape.iter().product();
        self.dtype.bytes_for(n).ok_or_else(|| Error::Shape {
            op: "write gguf",
            reason: format!("tensor {:?}: {:?} is not whole blocks of {}", self.name, self.shape, self.dtype),
        })
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The GGUF value type a value is written as. Integers that fit take 32 bits and floats are written as f32:
/// llama.cpp checks a key's type when it reads it, and every key strata writes is a u32, i32 or f32 there.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U64(x) if u32::try_from(*x).is_ok() => 4,
        Value::U64(_) => 10,
        Value::I64(x) if i32::try_from(*x).is_ok() => 5,
        Value::I64(_) => 11,
        Value::F64(_) => 6,
        Value::Bool(_) => 7,
        Value::Str(_) => 8,
        Value::Array(_) => 9,
    }
}

/// Appends `v` encoded as type `ty` (the type of the array it is in may be wider than its own).
fn value(out: &mut Vec<u8>, v: &Value, ty: u32) {
    match v {
        Value::U64(x) if ty == 4 => out.extend_from_slice(&(*x as u32).to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) if ty == 5 => out.extend_from_slice(&(*x as i32).to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&(*x as f32).to_le_bytes()),
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::Str(s) => string(out, s),
        Value::Array(items) => {
            // One element type for the whole array: the widest any element needs (an empty one is of strings).
            let inner = items.iter().map(value_type).max().unwrap_or(8);
            out.extend_from_slice(&inner.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                value(out, item, inner);
            }
        }
    }
}

fn pad(out: &mut Vec<u8>) {
    out.resize(out.len().next_multiple_of(ALIGN), 0);
}

/// Writes `path`: `metadata` in order, the directory of `tensors`, then `data(i)`'s bytes for each tensor `i` in
/// order (checked against the entry's shape and type).
pub fn write(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[TensorEntry],
    mut data: impl FnMut(usize) -> Result<Bytes>,
) -> Result<()> {
    let io = |e| Error::io(path, e);
    let mut head = b"GGUF".to_vec();
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        string(&mut head, k);
        let ty = value_type(v);
        head.extend_from_slice(&ty.to_le_bytes());
        value(&mut head, v, ty);
    }
    let mut offset = 0usize;
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        string(&mut head, &t.name);
        head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            head.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        head.extend_from_slice(&t.ggml_type.to_le_bytes());
        head.extend_from_slice(&(offset as u64).to_le_bytes());
        let size = t.bytes()?;
        sizes.push(size);
        offset = (offset + size).next_multiple_of(ALIGN);
    }
    pad(&mut head);
    let mut w = BufWriter::new(std::fs::File::create(path).map_err(io)?);
    w.write_all(&head).map_err(io)?;
    for (i, (t, size)) in tensors.iter().zip(sizes).enumerate() {
        let bytes = data(i)?;
        if bytes.len() != size {
            return Err(Error::Shape {
                op: "write gguf",
                reason: format!("tensor {:?}: {} bytes for {:?} of {}", t.name, bytes.len(), t.shape, t.dtype),
            });
        }
        w.write_all(bytes.as_slice()).map_err(io)?;
        w.write_all(&[0u8; ALIGN][..size.next_multiple_of(ALIGN) - size]).map_err(io)?;
    }
    w.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::gguf::GgufSource;
    use crate::quant::quantize;

    #[test]
    fn written_metadata_and_tensors_read_back() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let path = dir.path().join("m.gguf");
        let c = crate::testing::tiny_config();
        let mut md = super::super::convert::gguf_metadata(&c);
        md.push(("test.big".into(), Value::U64(1 << 40)));
        md.push(("test.ids".into(), Value::Array(vec![Value::I64(-1), Value::I64(3)])));
        md.push(("tokenizer.ggml.tokens".into(), Value::Array(vec![Value::Str("a".into()); c.vocab_size])));
        let layout = crate::layout::ModelLayout::new(&c);
        let ids = layout.tensors();
        let entries: Vec<TensorEntry> = ids
            .iter()
            .map(|&id| {
                let shape = layout.shape(id);
                let dtype = if shape.len() == 2 { DType::Q8_0 } else { DType::F32 };
                TensorEntry::new(id.gguf_name(), shape, dtype)
            })
            .collect();
        let values = |e: &TensorEntry| -> Vec<f32> {
            (0..e.shape.iter().product::<usize>()).map(|i| (i % 7) as f32 / 7.0 - e.name.len() as f32 / 64.0).collect()
        };
        write(&path, &md, &entries, |i| {
            let v = values(&entries[i]);
            Ok(match entries[i].dtype {
                DType::F32 => Bytes::owned(bytemuck::cast_slice(&v)),
                q => Bytes::owned(&quantize(q, &v)),
            })
        })?;
        let g = GgufSource::open(&path)?;
        assert_eq!(g.config().hidden_size, c.hidden_size);
        assert_eq!(g.metadata.get("test.big"), Some(&Value::U64(1 << 40)));
        assert_eq!(g.metadata.get("test.ids"), Some(&Value::Array(vec![Value::I64(-1), Value::I64(3)])));
        // Unpermuted on read, so compare a tensor llama.cpp does not permute.
        let e =
            entries.iter().find(|e| e.name == "blk.1.ffn_down.weight").ok_or(Error::MissingTensor("down".into()))?;
        let t = g.tensor("model.layers.1.mlp.down_proj.weight")?;
        assert_eq!((t.dtype, t.bytes.as_slice()), (DType::Q8_0, quantize(DType::Q8_0, &values(e)).as_slice()));
        let wrong = write(&path, &md, &entries, |_| Ok(Bytes::owned(&[0; 4])));
        assert!(wrong.is_err(), "a tensor of the wrong size is refused");
        Ok(())
    }
}
