//! GGUF files (architectures `llama`, `qwen2`, `qwen3`): metadata, tensor directory, and the mapping to Hugging
//! Face names.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::config::{Architecture, ModelConfig};
use crate::layout::{ModelLayout, TensorId};
use crate::quant;
use crate::tensor::{Bytes, DType, HostTensor};
use crate::{Error, Result};

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer.
    U64(u64),
    /// Any signed integer.
    I64(i64),
    /// Any float.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, when it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U64(v) => Some(*v),
            Value::I64(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }

    /// The value as a float, when it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F64(v) => Some(*v),
            Value::U64(v) => Some(*v as f64),
            Value::I64(v) => Some(*v as f64),
            _ => None,
        }
    }

    /// The value as a string, when it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array, when it is one.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

struct TensorInfo {
    dtype: DType,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// An opened GGUF file.
pub struct GgufSource {
    path: PathBuf,
    map: Arc<Mmap>,
    /// All metadata key/values.
    pub metadata: HashMap<String, Value>,
    tensors: HashMap<String, TensorInfo>,
    config: ModelConfig,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Gguf { path: self.path.to_path_buf(), reason: reason.into() }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!("truncated: needed {n} bytes at offset {}", self.pos))),
        }
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of items that each take at least `min_bytes` of what is left of the file: a count the rest of the
    /// file cannot hold is corrupt, so no allocation sized by it is ever larger than a small multiple of the file.
    fn count(&mut self, min_bytes: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64()?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.checked_mul(min_bytes as u64).is_none_or(|b| b > left) {
            return Err(self.err(format!(
                "{what} count {n} at offset {at} needs at least {min_bytes} bytes each, more than the {left} left"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.count(1, "string byte")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U64(self.take(1)?[0] as u64),
            1 => Value::I64(self.take(1)?[0] as i8 as i64),
            2 => {
                let b = self.take(2)?;
                Value::U64(u16::from_le_bytes([b[0], b[1]]) as u64)
            }
            3 => {
                let b = self.take(2)?;
                Value::I64(i16::from_le_bytes([b[0], b[1]]) as i64)
            }
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deeply"));
                }
                let inner = self.u32()?;
                let min =
                    min_value_bytes(inner).ok_or_else(|| self.err(format!("unknown array element type {inner}")))?;
                let n = self.count(min, "array element")?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(self.err(format!("unknown metadata value type {other}"))),
        })
    }
}

/// The fewest bytes a metadata value of type `ty` takes in the file, or `None` for an unknown type.
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        // A string is its u64 length; an array its u32 element type and u64 count.
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// The fewest bytes of a metadata entry (an empty key, its type and a one-byte value) and of a tensor entry (an
/// empty name, no dimensions, its type and offset).
const MIN_KV_BYTES: usize = 8 + 4 + 1;
const MIN_TENSOR_BYTES: usize = 8 + 4 + 4 + 8;

/// The element type of a tensor's `ggml_type`, or a name for the error when strata does not read it.
fn ggml_type(code: u32) -> std::result::Result<DType, String> {
    quant::from_ggml_type(code).ok_or_else(|| match code {
        9 => "Q8_1".into(),
        other => format!("ggml type {other}"),
    })
}

impl GgufSource {
    /// Opens and indexes a GGUF file; tensor data is not read.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: model files are treated as read-only for the life of the process.
        let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?);
        let mut r = Reader { buf: &map, pos: 0, path };
        if r.take(4).map_err(|_| r.err("file too short for a GGUF header"))? != b"GGUF" {
            return Err(r.err("bad magic (not a GGUF file)"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.err(format!("unsupported GGUF version {version}")));
        }
        let n_tensors = r.count(MIN_TENSOR_BYTES, "tensor")?;
        let n_kv = r.count(MIN_KV_BYTES, "metadata")?;
        if n_tensors * MIN_TENSOR_BYTES + n_kv * MIN_KV_BYTES > r.buf.len() - r.pos {
            return Err(r.err(format!("{n_tensors} tensors and {n_kv} metadata entries cannot fit in the file")));
        }
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            if n_dims > 4 {
                return Err(r.err(format!("tensor {name:?} has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64()? as usize);
            }
            let code = r.u32()?;
            let offset = r.u64()? as usize;
            raw.push((name, dims, code, offset));
        }
        let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32) as usize;
        if align == 0 || !align.is_power_of_two() {
            return Err(r.err(format!("general.alignment {align} is not a power of two")));
        }
        let data_start = r.pos.div_ceil(align) * align;
        let mut tensors = HashMap::new();
        for (name, dims, code, offset) in raw {
            let dtype = ggml_type(code).map_err(|t| Error::UnsupportedDType { name: name.clone(), dtype: t })?;
            // GGUF lists the fastest-varying dimension first; Hugging Face order is the reverse.
            let shape: Vec<usize> = dims.iter().rev().copied().collect();
            let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if let Some(row) = dims.first().filter(|&&c| !c.is_multiple_of(dtype.block_elems())) {
                return Err(r.err(format!(
                    "tensor {name:?} {shape:?}: rows of {row} are not whole {dtype} blocks of {}",
                    dtype.block_elems()
                )));
            }
            let len = elems
                .and_then(|n| dtype.bytes_for(n))
                .ok_or_else(|| r.err(format!("tensor {name:?} has invalid shape {shape:?} for {dtype}")))?;
            let start = data_start.checked_add(offset).filter(|s| s.checked_add(len).is_some_and(|e| e <= map.len()));
            let Some(start) = start else {
                return Err(r.err(format!("tensor {name:?} lies beyond the end of the file (truncated?)")));
            };
            tensors.insert(name, TensorInfo { dtype, shape, offset: start, len });
        }
        let config = config_from_metadata(&metadata, &tensors, &map, path)?;
        Ok(GgufSource { path: path.to_path_buf(), map, metadata, tensors, config })
    }

    /// The model's configuration, derived from metadata.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether a tensor (by Hugging Face name) exists.
    pub fn contains(&self, hf_name: &str) -> bool {
        gguf_name(hf_name).is_some_and(|n| self.tensors.contains_key(&n))
    }

    /// Storage type and shape of a tensor by Hugging Face name (the permutation keeps the shape).
    pub fn meta(&self, hf_name: &str) -> Option<(DType, Vec<usize>)> {
        self.tensors.get(&gguf_name(hf_name)?).map(|t| (t.dtype, t.shape.clone()))
    }

    /// Reads a tensor by its Hugging Face name, undoing llama.cpp's Q/K row permutation where the architecture
    /// has one.
    pub fn tensor(&self, hf_name: &str) -> Result<HostTensor> {
        let id = TensorId::from_hf_name(hf_name).ok_or_else(|| Error::MissingTensor(hf_name.to_string()))?;
        let name = id.gguf_name();
        let info = self.tensors.get(&name).ok_or_else(|| Error::MissingTensor(format!("{hf_name} ({name})")))?;
        let bytes = Bytes::mapped(self.map.clone(), info.offset, info.len);
        let t = HostTensor::new(&name, info.dtype, info.shape.clone(), bytes)
            .map_err(|e| Error::Gguf { path: self.path.clone(), reason: e.to_string() })?;
        let Some(heads) = ModelLayout::new(&self.config).gguf_permuted_heads(id) else {
            return Ok(t);
        };
        // A matrix's rows or a bias's elements. Empty rows would let a crafted file claim any number of them for no
        // bytes, and the permutation is as long as the rows.
        let rows = match t.shape[..] {
            [rows] => rows,
            [rows, cols] if cols > 0 => rows,
            _ => 0,
        };
        if rows == 0 || rows % heads != 0 || (rows / heads) % 2 != 0 {
            let mut expected = vec![heads * self.config.head_dim, self.config.hidden_size];
            expected.truncate(t.shape.len().clamp(1, 2));
            return Err(Error::ShapeMismatch { name: hf_name.into(), actual: t.shape.clone(), expected });
        }
        Ok(t.permute_rows(&unpermute_rows(t.shape[0], heads)))
    }
}

/// llama.cpp stores each head's rows interleaved (pair-wise) for its RoPE; Hugging Face stores halves.
/// HF row `(h, half, k)` is GGUF row `h*d + 2k + half`.
fn unpermute_rows(rows: usize, heads: usize) -> Vec<usize> {
    let d = rows / heads;
    let mut src = Vec::with_capacity(rows);
    for h in 0..heads {
        for half in 0..2 {
            for k in 0..d / 2 {
                src.push(h * d + 2 * k + half);
            }
        }
    }
    src
}

/// The inverse of `unpermute_rows`, for writing: GGUF row `i` is Hugging Face row `order[i]`.
pub fn gguf_row_order(rows: usize, heads: usize) -> Vec<usize> {
    let mut order = vec![0; rows];
    for (hf, gguf) in unpermute_rows(rows, heads).into_iter().enumerate() {
        order[gguf] = hf;
    }
    order
}

/// The GGUF name of a tensor known by its Hugging Face name.
fn gguf_name(hf: &str) -> Option<String> {
    TensorId::from_hf_name(hf).map(TensorId::gguf_name)
}

fn config_from_metadata(
    md: &HashMap<String, Value>,
    tensors: &HashMap<String, TensorInfo>,
    data: &[u8],
    path: &Path,
) -> Result<ModelConfig> {
    let arch_name = md.get("general.architecture").and_then(Value::as_str).unwrap_or("");
    let architecture = Architecture::from_gguf_name(arch_name)?;
    // Hyper-parameters sit under the architecture's own prefix (`qwen3.block_count`).
    let key = |k: &str| format!("{}.{k}", architecture.gguf_name());
    let num = |k: &str| md.get(&key(k)).and_then(Value::as_u64).map(|v| v as usize);
    let get = |k: &str| -> Result<usize> {
        num(k).ok_or_else(|| Error::Gguf { path: path.to_path_buf(), reason: format!("metadata {} missing", key(k)) })
    };
    let hidden = get("embedding_length")?;
    let heads = get("attention.head_count")?;
    let vocab = match num("vocab_size") {
        Some(v) => v,
        None => md.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(|a| a.len()).ok_or_else(|| {
            Error::Gguf { path: path.to_path_buf(), reason: "no vocab size and no tokenizer.ggml.tokens".into() }
        })?,
    };
    let head_dim = num("attention.key_length").or_else(|| num("rope.dimension_count")).unwrap_or(hidden / heads.max(1));
    let f = |k: &str, default: f64| md.get(&key(k)).and_then(Value::as_f64).unwrap_or(default);
    let tok_id = |k: &str| md.get(&format!("tokenizer.ggml.{k}")).and_then(Value::as_u64).map(|v| v as u32);
    let attention_bias = architecture.gguf_attention_bias(tensors.contains_key("blk.0.attn_q.bias"));
    let cfg = ModelConfig {
        architecture,
        hidden_size: hidden,
        intermediate_size: get("feed_forward_length")?,
        num_layers: get("block_count")?,
        num_heads: heads,
        num_kv_heads: num("attention.head_count_kv").unwrap_or(heads),
        head_dim,
        vocab_size: vocab,
        rms_norm_eps: f("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta: f("rope.freq_base", 10000.0),
        rope_scaling: None,
        rope_freq_factors: rope_freq_factors(md, tensors, data, architecture.gguf_name(), head_dim, path)?,
        tie_word_embeddings: !tensors.contains_key("output.weight"),
        attention_bias,
        max_position_embeddings: num("context_length").unwrap_or(2048),
        bos_token_id: tok_id("bos_token_id"),
        // Generation stops at any of them: chat models end a turn with EOT (`<|eot_id|>`, `<|im_end|>`), not EOS.
        eos_token_ids: eos_ids([tok_id("eos_token_id"), tok_id("eot_token_id"), tok_id("eom_token_id")]),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The tensor llama.cpp's GGUFs carry llama3 RoPE scaling in: one divisor per inverse frequency.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// RoPE scaling as llama.cpp's GGUFs carry it, as per-frequency divisors: the `rope_freqs.weight` tensor (llama3
/// scaling: `convert_hf_to_gguf.py` writes it for Llama 3.1 and later), times the constant factor of `linear`
/// scaling. Other scaling types (yarn, longrope) are refused: loading such a file without them would serve another
/// model.
fn rope_freq_factors(
    md: &HashMap<String, Value>,
    tensors: &HashMap<String, TensorInfo>,
    data: &[u8],
    arch: &str,
    head_dim: usize,
    path: &Path,
) -> Result<Option<Vec<f32>>> {
    let err = |reason: String| Error::Gguf { path: path.to_path_buf(), reason };
    let half = head_dim / 2;
    let mut factors = match tensors.get(ROPE_FREQS) {
        None => None,
        Some(t) if t.dtype == DType::F32 && t.shape == [half] => {
            let bytes = &data[t.offset..t.offset + t.len];
            Some(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>())
        }
        Some(t) => {
            return Err(err(format!("{ROPE_FREQS} is {} {:?}; expected f32 [{half}]", t.dtype, t.shape)));
        }
    };
    let linear = md.get(&format!("{arch}.rope.scale_linear")).and_then(Value::as_f64);
    // Older files name linear scaling by its factor alone.
    let implied = if linear.is_some() { "linear" } else { "none" };
    match md.get(&format!("{arch}.rope.scaling.type")).and_then(Value::as_str).unwrap_or(implied) {
        "none" => {}
        "linear" => {
            let factor = md.get(&format!("{arch}.rope.scaling.factor")).and_then(Value::as_f64).or(linear);
            let factor =
                factor.ok_or_else(|| err(format!("linear RoPE scaling without {arch}.rope.scaling.factor")))?;
            for f in factors.get_or_insert_with(|| vec![1.0; half]) {
                *f *= factor as f32;
            }
        }
        other => {
            return Err(err(format!("RoPE scaling type {other:?} ({arch}.rope.scaling.type) is not supported")));
        }
    }
    Ok(factors)
}

/// The distinct ids among `ids`, in order.
fn eos_ids(ids: [Option<u32>; 3]) -> Vec<u32> {
    let mut out = Vec::new();
    for id in ids.into_iter().flatten() {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Llama3RopeScaling;

    /// A tiny llama GGUF's source with `extra` metadata and, if given, a `rope_freqs.weight` tensor.
    fn rope_source(dir: &Path, extra: &[(&str, Value)], freqs: Option<&[f32]>) -> Result<GgufSource> {
        let path = dir.join("rope.gguf");
        let mut md = crate::convert::gguf_metadata(&crate::testing::tiny_config());
        md.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        let entries: Vec<_> =
            freqs.iter().map(|f| crate::gguf_writer::TensorEntry::new(ROPE_FREQS, vec![f.len()], DType::F32)).collect();
        let bytes: Vec<u8> = freqs.unwrap_or(&[]).iter().flat_map(|f| f.to_le_bytes()).collect();
        crate::gguf_writer::write(&path, &md, &entries, |_| Ok(Bytes::owned(&bytes)))?;
        GgufSource::open(&path)
    }

    /// Llama 3.1's scaling reaches a GGUF as `rope_freqs.weight`, the divisors a converter computes from the Hugging
    /// Face `rope_scaling`; read back, they give that config's frequencies.
    #[test]
    fn llama3_rope_factors_give_the_hugging_face_frequencies() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io(Path::new("tempdir"), e))?;
        let base = crate::testing::tiny_config();
        let s = Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        };
        // What a converter writes: `strata convert` as llama.cpp's conversion/llama.py does (checked against
        // llama.cpp itself in engine/tests/gguf_kquants.rs).
        let scaled = ModelConfig { rope_scaling: Some(s), ..base.clone() };
        let factors: Vec<f32> = scaled.rope_divisors().unwrap_or_default().iter().map(|&d| d as f32).collect();
        assert!(factors.contains(&1.0) && factors.contains(&8.0), "{factors:?}");
        let source = rope_source(dir.path(), &[], Some(&factors))?;
        let got = source.config().rope_inv_freq();
        let want = scaled.rope_inv_freq();
        let plain = base.rope_inv_freq();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.abs(), "{got:?} against {want:?}");
        }
        assert!(got.iter().zip(&plain).any(|(g, p)| (g - p).abs() > 0.1 * p.abs()), "no frequency was scaled");
        Ok(())
    }

    #[test]
    fn linear_rope_scaling_divides_every_frequency_and_others_are_refused() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io(Path::new("tempdir"), e))?;
        let plain = crate::testing::tiny_config().rope_inv_freq();
        let linear =
            [("llama.rope.scaling.type", Value::Str("linear".into())), ("llama.rope.scaling.factor", Value::F64(4.0))];
        for md in [&linear[..], &[("llama.rope.scale_linear", Value::F64(4.0))]] {
            let got = rope_source(dir.path(), md, None)?.config().rope_inv_freq();
            assert_eq!(got, plain.iter().map(|p| (f64::from(*p) / 4.0) as f32).collect::<Vec<_>>());
        }
        let same = rope_source(dir.path(), &[("llama.rope.scaling.type", Value::Str("none".into()))], None)?;
        assert_eq!(same.config().rope_inv_freq(), plain);
        let yarn = rope_source(dir.path(), &[("llama.rope.scaling.type", Value::Str("yarn".into()))], None);
        let err = yarn.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("RoPE scaling type \"yarn\""), "{err}");
        let short = rope_source(dir.path(), &[], Some(&[1.0; 3])).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(short.contains("rope_freqs.weight is f32 [3]"), "{short}");
        let zero = vec![0.0; plain.len()];
        let err = rope_source(dir.path(), &[], Some(&zero)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("not a positive finite number"), "{err}");
        Ok(())
    }

    #[test]
    fn an_unknown_architecture_is_named_with_the_supported_ones() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io(Path::new("tempdir"), e))?;
        let path = dir.path().join("gemma.gguf");
        let md = vec![("general.architecture".to_string(), Value::Str("gemma2".into()))];
        crate::gguf_writer::write(&path, &md, &[], |_| Err(Error::MissingTensor("none".into())))?;
        let err = GgufSource::open(&path).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("\"gguf:gemma2\"") && err.contains("gguf:llama, gguf:qwen2, gguf:qwen3"), "{err}");
        Ok(())
    }

    /// Found with the `gguf` fuzz target's harness: a permuted tensor of 2^40 empty rows (no bytes at all) made the
    /// row permutation allocate 8 TiB and abort. `fuzz/crashes/gguf/zero-width-q.gguf` is that file.
    #[test]
    fn a_permuted_tensor_of_empty_rows_is_refused() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io(Path::new("tempdir"), e))?;
        let path = dir.path().join("empty-rows.gguf");
        let cfg = ModelConfig { num_layers: 1, ..crate::testing::tiny_config() };
        let md = crate::convert::gguf_metadata(&cfg);
        let q = crate::gguf_writer::TensorEntry::new("blk.0.attn_q.weight", vec![1 << 40, 0], DType::F32);
        crate::gguf_writer::write(&path, &md, &[q], |_| Ok(Bytes::owned(&[])))?;
        let source = GgufSource::open(&path)?;
        let err = source.tensor("model.layers.0.self_attn.q_proj.weight").err().map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("[1099511627776, 0]")), "{err:?}");
        Ok(())
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: gguf[h, k, half] = hf[h, half, k]; build that and check we map back.
        let (heads, d) = (2, 8);
        let hf: Vec<usize> = (0..heads * d).collect();
        let mut gguf = vec![0; heads * d];
        for h in 0..heads {
            for half in 0..2 {
                for k in 0..d / 2 {
                    gguf[h * d + 2 * k + half] = hf[h * d + half * d / 2 + k];
                }
            }
        }
        let back: Vec<usize> = unpermute_rows(heads * d, heads).iter().map(|&r| gguf[r]).collect();
        assert_eq!(back, hf);
        let forward: Vec<usize> = gguf_row_order(heads * d, heads).iter().map(|&r| hf[r]).collect();
        assert_eq!(forward, gguf, "writing permutes as llama.cpp does");
    }
}
