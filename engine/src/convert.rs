//! Converting between model formats: any model into a Hugging Face directory (dequantized safetensors), so both
//! formats can be checked against each other and GGUF-only models served from safetensors; and any model into a
//! GGUF file of its llama.cpp architecture, in a float type or quantized with llama.cpp's reference rounding
//! (`strata convert --quantize`), so a checkpoint is quantized once instead of at every load.

use std::path::Path;

use crate::config::{Architecture, ModelConfig};
use crate::gguf_writer::{self, TensorEntry};
use crate::layout::{ModelLayout, TensorId};
use crate::loader::ModelFiles;
use crate::loader::gguf::{ROPE_FREQS, Value, gguf_row_order};
use crate::quant;
use crate::tensor::Bytes;
use crate::tensor::DType;
use crate::tokenizer::gguf as gguf_tok;
use crate::{Error, Result};

/// Writes `config.json`, `model.safetensors`, `tokenizer.json` and `tokenizer_config.json` into `out`.
/// Matrices are stored as `dtype` (f32, f16 or bf16); norms stay f32.
pub fn to_hf_dir(files: &ModelFiles, out: &Path, dtype: DType) -> Result<()> {
    if dtype.is_quantized() {
        return Err(Error::Config(format!("cannot write {dtype} into safetensors; use f32, f16 or bf16")));
    }
    let cfg = files.config();
    if cfg.rope_freq_factors.is_some() {
        // config.json has no way to say them: the directory would hold another model.
        return Err(Error::Config(
            "a model with RoPE frequency factors (a GGUF's rope_freqs.weight or linear scaling) cannot be written as \
             a Hugging Face config"
                .into(),
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let names: Vec<String> = ModelLayout::new(cfg).tensors().into_iter().map(TensorId::hf_name).collect();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let t = files.tensor(&name)?;
        let target = if t.shape.len() == 2 { dtype } else { DType::F32 };
        tensors.push((name, t.convert(target)));
    }
    let views = tensors
        .iter()
        .map(|(n, t)| {
            let dt = match t.dtype {
                DType::F16 => safetensors::Dtype::F16,
                DType::BF16 => safetensors::Dtype::BF16,
                _ => safetensors::Dtype::F32,
            };
            safetensors::tensor::TensorView::new(dt, t.shape.clone(), t.bytes.as_slice())
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Config(format!("{n}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let st = out.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st)
        .map_err(|e| Error::Safetensors { path: st.clone(), reason: e.to_string() })?;
    let write = |name: &str, text: String| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).map_err(|e| Error::io(&p, e))
    };
    write("config.json", serde_json::to_string_pretty(&cfg.to_hf_json()).map_err(|e| Error::Config(e.to_string()))?)?;
    let tok = files.tokenizer()?;
    write("tokenizer.json", tok.to_json()?)?;
    let tc = serde_json::json!({
        "add_bos_token": tok.add_bos.is_some(),
        "add_eos_token": tok.add_eos.is_some(),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
    });
    write("tokenizer_config.json", serde_json::to_string_pretty(&tc).map_err(|e| Error::Config(e.to_string()))?)
}

/// What [`to_gguf`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufReport {
    /// Tensors written.
    pub tensors: usize,
    /// Matrices the source already stored quantized in another format, copied as they were: strata does not
    /// requantize (the rounding errors would add up).
    pub kept_quantized: Vec<String>,
}

/// `general.file_type` (llama.cpp's `llama_ftype`) of a file whose matrices are mostly `dtype`.
fn file_type(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        // The K-quants as llama.cpp's "_M" mixes name them (strata does not write these; the arms keep the map
        // whole). Q8_K has no file type: 1024 is llama.cpp's "guessed".
        DType::Q2_K => 10,
        DType::Q3_K => 12,
        DType::Q4_K => 15,
        DType::Q5_K => 17,
        DType::Q6_K => 18,
        DType::Q8_K => 1024,
        DType::BF16 => 32,
    }
}

/// The `general.*` and architecture metadata (`llama.*`, `qwen2.*`, `qwen3.*`) of a GGUF for `c` (what llama.cpp's
/// loader and strata's [`crate::loader::gguf`] read).
pub fn gguf_metadata(c: &ModelConfig) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U64(x as u64);
    let arch = c.architecture.gguf_name();
    let mut md = vec![("general.architecture".to_string(), Value::Str(arch.into()))];
    md.extend(
        [
            ("block_count", u(c.num_layers)),
            ("context_length", u(c.max_position_embeddings)),
            ("embedding_length", u(c.hidden_size)),
            ("feed_forward_length", u(c.intermediate_size)),
            ("attention.head_count", u(c.num_heads)),
            ("attention.head_count_kv", u(c.num_kv_heads)),
            ("attention.key_length", u(c.head_dim)),
            ("attention.value_length", u(c.head_dim)),
            ("rope.dimension_count", u(c.head_dim)),
            ("rope.freq_base", Value::F64(c.rope_theta)),
            ("attention.layer_norm_rms_epsilon", Value::F64(c.rms_norm_eps)),
            ("vocab_size", u(c.vocab_size)),
        ]
        .map(|(k, v)| (format!("{arch}.{k}"), v)),
    );
    md
}

/// A stand-in vocabulary for a model without a tokenizer (`random:` models, test models): byte-level BPE over
/// single bytes, the 256 byte symbols for the first ids and `<tokN>` fillers after them, no merges, so that
/// llama.cpp loads the file (its benchmarks feed token ids, not text) and strata encodes text a byte per token.
pub fn byte_vocabulary(vocab_size: usize) -> Vec<(String, Value)> {
    let byte_chars = crate::tokenizer::byte_level_alphabet();
    let tokens = (0..vocab_size).map(|id| byte_chars.get(id).map_or_else(|| format!("<tok{id}>"), |ch| ch.to_string()));
    vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str("smollm".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens.map(Value::Str).collect())),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
    ]
}

/// Writes `files` as a GGUF of its llama.cpp architecture at `out`: 2-D matrices (embeddings and head included)
/// as `dtype`, norms as f32, the tokenizer as `tokenizer.ggml.*` metadata. A quantized `dtype` quantizes float matrices one
/// at a time as llama.cpp's `llama-quantize --pure` does (bit for bit); matrices the source stores quantized in
/// another format are dequantized for a float `dtype` and kept as they are for a quantized one (listed in the
/// report). Q and K rows are interleaved per head where llama.cpp expects it (`llama` only).
pub fn to_gguf(files: &ModelFiles, out: &Path, dtype: DType) -> Result<GgufReport> {
    let cfg = files.config();
    // GGUF readers take q/k/v biases from the architecture, and llama.cpp reads RoPE scaling factors only for
    // Llama: a model that differs would load as a different model.
    let bias_as_read = cfg.architecture.gguf_attention_bias(cfg.attention_bias);
    let rope = rope_freqs_tensor(cfg);
    if cfg.attention_bias != bias_as_read || (rope.is_some() && cfg.architecture != Architecture::Llama) {
        return Err(Error::Config(format!(
            "a {} model{} cannot be written as a {} GGUF",
            cfg.architecture.hf_name(),
            if rope.is_some() {
                " with RoPE scaling"
            } else if cfg.attention_bias {
                " with q/k/v biases"
            } else {
                " without q/k/v biases"
            },
            cfg.architecture.gguf_name()
        )));
    }
    let layout = ModelLayout::new(cfg);
    let ids: Vec<TensorId> = layout.tensors();
    let mut entries = Vec::with_capacity(ids.len());
    let mut kept_quantized = Vec::new();
    for &id in &ids {
        let (file, shape) = files.tensor_meta(&id.hf_name())?;
        let target = match (shape.len(), file.is_quantized(), dtype.is_quantized()) {
            (2, true, true) if file != dtype => {
                kept_quantized.push(id.hf_name());
                file
            }
            (2, _, _) => dtype,
            _ => DType::F32,
        };
        entries.push(TensorEntry::new(id.gguf_name(), shape, target));
    }
    let rope_bytes = rope.map(|(entry, bytes)| {
        entries.push(entry);
        bytes
    });
    let mut md = gguf_metadata(cfg);
    md.push(("general.file_type".into(), Value::U64(file_type(dtype))));
    if dtype.is_quantized() {
        // ggml's quantization format version (GGML_QNT_VERSION), which llama.cpp writes beside quantized weights.
        md.push(("general.quantization_version".into(), Value::U64(2)));
    }
    md.extend(tokenizer_metadata(files)?);
    gguf_writer::write(out, &md, &entries, |i| {
        if let Some(bytes) = rope_bytes.as_ref().filter(|_| i == ids.len()) {
            return Ok(Bytes::owned(bytes));
        }
        let (id, entry) = (ids[i], &entries[i]);
        let name = id.hf_name();
        let t = files.tensor(&name)?;
        let mut t = if entry.dtype == t.dtype {
            t
        } else if entry.dtype.is_quantized() {
            quant::quantize_tensor(&name, &t, entry.dtype)?
        } else {
            t.convert(entry.dtype)
        };
        if let Some(heads) = layout.gguf_permuted_heads(id) {
            t = t.permute_rows(&gguf_row_order(t.shape[0], heads));
        }
        Ok(t.bytes)
    })?;
    Ok(GgufReport { tensors: entries.len(), kept_quantized })
}

/// The `rope_freqs.weight` entry and bytes of a model with RoPE scaling (its [`ModelConfig::rope_divisors`] as
/// f32, as llama.cpp's converter writes llama3 scaling), None for one without.
pub(crate) fn rope_freqs_tensor(cfg: &ModelConfig) -> Option<(TensorEntry, Vec<u8>)> {
    let divisors = cfg.rope_divisors()?;
    let bytes = divisors.iter().flat_map(|&d| (d as f32).to_le_bytes()).collect();
    Some((TensorEntry::new(ROPE_FREQS, vec![divisors.len()], DType::F32), bytes))
}

/// The tokenizer as GGUF metadata: a GGUF source's `tokenizer.*` keys as they are; a Hugging Face byte-level BPE
/// tokenizer (`tokenizer.json`) translated as llama.cpp's converter does; nothing for a model without one (a
/// directory without `tokenizer.json`, a synthetic model).
fn tokenizer_metadata(files: &ModelFiles) -> Result<Vec<(String, Value)>> {
    match files {
        ModelFiles::Gguf(g) => {
            let mut md: Vec<(String, Value)> = g
                .metadata
                .iter()
                .filter(|(k, _)| k.starts_with("tokenizer."))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            md.sort_by(|a, b| a.0.cmp(&b.0));
            Ok(md)
        }
        // llama.cpp refuses a file without a vocabulary: a synthetic model gets a stand-in.
        ModelFiles::Synthetic(_) => Ok(byte_vocabulary(files.config().vocab_size)),
        ModelFiles::Hf { dir, .. } if !dir.join("tokenizer.json").exists() => Ok(Vec::new()),
        ModelFiles::Hf { .. } => {
            let tok = files.tokenizer()?;
            let json: serde_json::Value =
                serde_json::from_str(&tok.to_json()?).map_err(|e| Error::Tokenizer(e.to_string()))?;
            let cfg = files.config();
            let mut md = bpe_metadata(&json, cfg.vocab_size)?;
            let id = |k: &str, v: Option<u32>| v.map(|v| (format!("tokenizer.ggml.{k}"), Value::U64(v.into())));
            md.extend(id("bos_token_id", cfg.bos_token_id));
            md.extend(id("eos_token_id", cfg.eos_token_ids.first().copied()));
            md.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(tok.add_bos.is_some())));
            md.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(tok.add_eos.is_some())));
            if let Some(t) = &tok.chat_template {
                md.push(("tokenizer.chat_template".into(), Value::Str(t.clone())));
            }
            Ok(md)
        }
    }
}

/// GGUF token types (llama.cpp's `llama_token_type`).
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const UNUSED: i64 = 5;

/// Tokens, types, merges and pre-tokenizer of a byte-level BPE `tokenizer.json`, padded to `vocab` ids.
fn bpe_metadata(json: &serde_json::Value, vocab: usize) -> Result<Vec<(String, Value)>> {
    let err = |m: &str| Error::Tokenizer(format!("cannot write this tokenizer as GGUF: {m} (byte-level BPE only)"));
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(err("its model is not BPE"));
    }
    let pre = &json["pre_tokenizer"];
    let kind = |p: &serde_json::Value| p["type"].as_str().unwrap_or("").to_string();
    // The GGUF name of each pre-tokenizer strata's GGUF reader rebuilds (`tokenizer::gguf`), recognised by the
    // pieces of the `tokenizer.json` it rebuilds.
    let parts: Vec<String> = pre["pretokenizers"].as_array().map(|a| a.iter().map(kind).collect()).unwrap_or_default();
    let split_regex = pre["pretokenizers"][0]["pattern"]["Regex"].as_str();
    let pre_name = match kind(pre).as_str() {
        "ByteLevel" => "gpt2",
        "Sequence" if parts == ["Digits", "ByteLevel"] && pre["pretokenizers"][0]["individual_digits"] == true => {
            "smollm"
        }
        "Sequence" if parts == ["Split", "ByteLevel"] && split_regex == Some(gguf_tok::LLAMA3_SPLIT) => "llama-bpe",
        "Sequence" if parts == ["Split", "ByteLevel"] && split_regex == Some(gguf_tok::QWEN2_SPLIT) => "qwen2",
        "Sequence" => {
            return Err(err("its pre-tokenizer sequence is not SmolLM's, Llama 3's or Qwen2's"));
        }
        other => return Err(err(&format!("pre-tokenizer {other:?}"))),
    };
    let map = model["vocab"].as_object().ok_or_else(|| err("no vocab"))?;
    let mut tokens: Vec<Option<(String, i64)>> = vec![None; vocab];
    let mut put = |id: Option<u64>, text: &str, ty: i64| -> Result<()> {
        let id = id.ok_or_else(|| err("a token id is not a number"))? as usize;
        if id >= tokens.len() {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some((text.to_string(), ty));
        Ok(())
    };
    for (text, id) in map {
        put(id.as_u64(), text, NORMAL)?;
    }
    for a in json["added_tokens"].as_array().into_iter().flatten() {
        let ty = if a["special"] == true { CONTROL } else { USER_DEFINED };
        put(a["id"].as_u64(), a["content"].as_str().unwrap_or(""), ty)?;
    }
    // Merges are "a b" strings in older tokenizer.json files and ["a", "b"] pairs in newer ones.
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| err("no merges"))?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(Value::Str(s.clone())),
            serde_json::Value::Array(p) => {
                match (p.first().and_then(|a| a.as_str()), p.get(1).and_then(|b| b.as_str())) {
                    (Some(a), Some(b)) => Ok(Value::Str(format!("{a} {b}"))),
                    _ => Err(err("a merge is not a pair of strings")),
                }
            }
            _ => Err(err("a merge is neither a string nor a pair")),
        })
        .collect::<Result<Vec<_>>>()?;
    // Ids the tokenizer leaves unnamed (a vocabulary padded for the matmul) get placeholders, as in llama.cpp.
    let (texts, types): (Vec<Value>, Vec<Value>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let (text, ty) = t.unwrap_or_else(|| (format!("[PAD{i}]"), UNUSED));
            (Value::Str(text), Value::I64(ty))
        })
        .unzip();
    Ok(vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre_name.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(texts)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ])
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::tokenizer::Tokenizer;

    /// Each pre-tokenizer the GGUF reader rebuilds is written back under the same name, so a converted file
    /// tokenizes as its source did.
    #[test]
    fn pre_tokenizer_names_survive_gguf_to_hf_to_gguf() {
        for pre in gguf_tok::SUPPORTED_PRE_TOKENIZERS {
            let tokens = ["a", "b", "ab"].map(|t| Value::Str(t.into())).to_vec();
            let md = HashMap::from([
                ("tokenizer.ggml.model".to_string(), Value::Str("gpt2".into())),
                ("tokenizer.ggml.pre".into(), Value::Str(pre.to_string())),
                ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
                ("tokenizer.ggml.merges".into(), Value::Array(vec![Value::Str("a b".into())])),
            ]);
            let json = Tokenizer::from_gguf(&md).expect("tokenizer builds").to_json().expect("serializes");
            let json: serde_json::Value = serde_json::from_str(&json).expect("valid json");
            let written = bpe_metadata(&json, 3).expect("writable as GGUF");
            let got = written.iter().find(|(k, _)| k == "tokenizer.ggml.pre").map(|(_, v)| v.clone());
            assert_eq!(got, Some(Value::Str(pre.to_string())), "{pre}");
        }
    }
}
