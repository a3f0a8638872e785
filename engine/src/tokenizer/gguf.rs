//! Rebuilding a Hugging Face `tokenizer.json` from GGUF `tokenizer.ggml.*` metadata: byte-level BPE
//! (`tokenizer.ggml.model = gpt2`, with the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`) and SentencePiece
//! (`llama`: Llama 2, Mistral, TinyLlama), each laid out as the model's own `tokenizer.json` on the Hub is, so that
//! the `tokenizers` crate gives the same ids as Hugging Face's tokenizer for that model.

use std::collections::HashMap;

use serde_json::{Value as Json, json};

use crate::loader::gguf::Value;
use crate::{Error, Result};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TYPE_NORMAL: u64 = 1;
const TYPE_UNKNOWN: u64 = 2;
const TYPE_CONTROL: u64 = 3;
const TYPE_USER_DEFINED: u64 = 4;

/// The `tokenizer.ggml.pre` names this module rebuilds, for error messages and docs.
pub const SUPPORTED_PRE_TOKENIZERS: &[&str] = &["gpt2", "smollm", "llama-bpe", "qwen2"];

/// Llama 3's split (llama.cpp's LLAMA3 pre-tokenizer; the `Split` of Meta-Llama-3's `tokenizer.json`): numbers
/// in runs of up to three digits.
pub(crate) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split (also Qwen2.5 and Qwen3): as Llama 3's, but every digit alone.
pub(crate) const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn tok_err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

/// The vocabulary as GGUF stores it: token texts and their types, and scores when present.
struct Vocab<'a> {
    tokens: Vec<&'a str>,
    types: Vec<u64>,
    scores: Option<Vec<f64>>,
}

impl<'a> Vocab<'a> {
    fn read(md: &'a HashMap<String, Value>) -> Result<Self> {
        let raw = md
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| tok_err("GGUF has no tokenizer.ggml.tokens"))?;
        let tokens = raw
            .iter()
            .enumerate()
            .map(|(i, t)| t.as_str().ok_or_else(|| tok_err(format!("GGUF token {i} is not a string"))))
            .collect::<Result<Vec<_>>>()?;
        let types = match md.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(ts) if ts.len() == tokens.len() => ts.iter().map(|t| t.as_u64().unwrap_or(TYPE_NORMAL)).collect(),
            Some(ts) => {
                return Err(tok_err(format!("GGUF has {} token types for {} tokens", ts.len(), tokens.len())));
            }
            None => vec![TYPE_NORMAL; tokens.len()],
        };
        let scores = md
            .get("tokenizer.ggml.scores")
            .and_then(Value::as_array)
            .map(|s| s.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect::<Vec<_>>());
        if let Some(s) = &scores
            && s.len() != tokens.len()
        {
            return Err(tok_err(format!("GGUF has {} token scores for {} tokens", s.len(), tokens.len())));
        }
        Ok(Vocab { tokens, types, scores })
    }

    fn vocab_json(&self) -> serde_json::Map<String, Json> {
        self.tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect()
    }

    /// Control tokens (type 3) as special added tokens, user-defined ones (4) as plain added tokens: both are
    /// matched whole in the input before the model sees it, as llama.cpp does, so `<|im_start|>` is never split.
    fn added_tokens(&self) -> Vec<Json> {
        let mut added = Vec::new();
        for (i, (t, &ty)) in self.tokens.iter().zip(&self.types).enumerate() {
            if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
                added.push(json!({
                    "id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": ty == TYPE_CONTROL,
                }));
            }
        }
        added
    }
}

/// Builds the `tokenizer.json` value for GGUF metadata.
pub fn tokenizer_json(md: &HashMap<String, Value>) -> Result<Json> {
    let model = md.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
    let vocab = Vocab::read(md)?;
    let (normalizer, pre_tokenizer, decoder, model) = match model {
        "gpt2" => byte_level_bpe(md, &vocab)?,
        "llama" => sentencepiece(md, &vocab)?,
        other => {
            return Err(tok_err(format!(
                "GGUF tokenizer model {other:?} is not supported (gpt2: byte-level BPE; llama: SentencePiece)"
            )));
        }
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": vocab.added_tokens(),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": decoder,
        "model": model,
    }))
}

type Parts = (Json, Json, Json, Json);

/// GPT-2 style byte-level BPE: merges from the file, the split regex of the named pre-tokenizer.
fn byte_level_bpe(md: &HashMap<String, Value>, vocab: &Vocab) -> Result<Parts> {
    let merges = md
        .get("tokenizer.ggml.merges")
        .and_then(Value::as_array)
        .ok_or_else(|| tok_err("GGUF has no tokenizer.ggml.merges"))?;
    let merges: Vec<&str> = merges.iter().filter_map(Value::as_str).collect();
    let pre = md.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex});
    let split =
        |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    let mut normalizer = Json::Null;
    // Llama 3 takes a pre-tokenized word whole when the vocabulary has it, before any merge (llama.cpp's
    // `ignore_merges`, the `tokenizer.json`'s too).
    let mut ignore_merges = false;
    let pre_tokenizer = match pre {
        // SmolLM's tokenizer splits digits one by one before the GPT-2 byte-level split.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "gpt2" | "default" | "" => byte_level(true),
        "llama-bpe" => {
            ignore_merges = true;
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]})
        }
        "qwen2" => {
            // Qwen's `tokenizer.json` composes text to NFC first; llama.cpp does not, Hugging Face does.
            normalizer = json!({"type": "NFC"});
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]})
        }
        other => {
            return Err(tok_err(format!(
                "GGUF pre-tokenizer {other:?} is not supported (supported: {})",
                SUPPORTED_PRE_TOKENIZERS.join(", ")
            )));
        }
    };
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
        "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
        "vocab": vocab.vocab_json(), "merges": merges,
    });
    Ok((normalizer, pre_tokenizer, decoder, model))
}

/// SentencePiece BPE as Hugging Face's `LlamaTokenizerFast` runs it: spaces become `▁` (with one more in front
/// unless `tokenizer.ggml.add_space_prefix` is false), BPE merges ordered by the merged piece's score, and bytes
/// with no piece of their own fall back to the `<0xNN>` tokens.
fn sentencepiece(md: &HashMap<String, Value>, vocab: &Vocab) -> Result<Parts> {
    let scores =
        vocab.scores.as_ref().ok_or_else(|| tok_err("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores"))?;
    let prefix_space = md.get("tokenizer.ggml.add_space_prefix").is_none_or(|v| *v == Value::Bool(true));
    let unk = md
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(Value::as_u64)
        .map(|i| i as usize)
        .or_else(|| vocab.types.iter().position(|&t| t == TYPE_UNKNOWN))
        .and_then(|i| vocab.tokens.get(i).copied());
    let replace_space = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
    let normalizer = if prefix_space {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace_space]})
    } else {
        replace_space
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix_space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
        "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
        "vocab": vocab.vocab_json(), "merges": merges_from_scores(vocab, scores),
    });
    Ok((normalizer, Json::Null, json!({"type": "Sequence", "decoders": decoders}), model))
}

/// SentencePiece stores no merges, only a score per piece: merging two pieces is allowed when their concatenation
/// is a piece, and the higher that piece's score the earlier the merge. Listing every such pair by falling score
/// gives the merge list a BPE model needs (Hugging Face's converters do the same; ties keep vocabulary order, and
/// within one piece the pair of higher-scored halves comes first).
fn merges_from_scores(vocab: &Vocab, scores: &[f64]) -> Vec<Json> {
    let ids: HashMap<&str, usize> = vocab.tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    // Only normal pieces are merge results or halves: control, unknown and byte tokens are never built by merging.
    let mergeable = |i: usize| vocab.types[i] == TYPE_NORMAL;
    let mut merges: Vec<(f64, &str, &str)> = Vec::new();
    for (i, piece) in vocab.tokens.iter().enumerate() {
        if !mergeable(i) {
            continue;
        }
        let mut local: Vec<(f64, f64, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                let (&li, &ri) = (ids.get(l)?, ids.get(r)?);
                (mergeable(li) && mergeable(ri)).then_some((scores[li], scores[ri], l, r))
            })
            .collect();
        local.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.total_cmp(&a.1)));
        merges.extend(local.into_iter().map(|(_, _, l, r)| (scores[i], l, r)));
    }
    // Stable: equal scores keep the order built above.
    merges.sort_by(|a, b| b.0.total_cmp(&a.0));
    merges.into_iter().map(|(_, l, r)| json!([l, r])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;

    const TYPE_BYTE: u64 = 6;

    fn strs(xs: &[&str]) -> Value {
        Value::Array(xs.iter().map(|x| Value::Str(x.to_string())).collect())
    }

    /// A SentencePiece vocabulary as llama.cpp writes one: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then pieces
    /// whose scores fall with their rank.
    fn spm(pieces: &[&str]) -> HashMap<String, Value> {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut types = vec![TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        types.extend([TYPE_BYTE; 256]);
        tokens.extend(pieces.iter().map(|p| p.to_string()));
        types.extend(vec![TYPE_NORMAL; pieces.len()]);
        let scores = (0..tokens.len()).map(|i| Value::F64(if i < 259 { 0.0 } else { -(i as f64) }));
        HashMap::from([
            ("tokenizer.ggml.model".into(), Value::Str("llama".into())),
            ("tokenizer.ggml.tokens".into(), Value::Array(tokens.into_iter().map(Value::Str).collect())),
            ("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::U64).collect())),
            ("tokenizer.ggml.scores".into(), Value::Array(scores.collect())),
            ("tokenizer.ggml.bos_token_id".into(), Value::U64(1)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U64(2)),
        ])
    }

    #[test]
    fn unknown_pre_tokenizers_and_models_are_named_with_the_supported_ones() {
        let mut md = HashMap::from([
            ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::Str("deepseek-coder".into())),
            ("tokenizer.ggml.tokens".into(), strs(&["a"])),
            ("tokenizer.ggml.merges".into(), strs(&[])),
        ]);
        let err = tokenizer_json(&md).expect_err("must fail").to_string();
        assert!(err.contains("\"deepseek-coder\"") && err.contains("llama-bpe, qwen2"), "{err}");
        md.insert("tokenizer.ggml.model".into(), Value::Str("bert".into()));
        let err = tokenizer_json(&md).expect_err("must fail").to_string();
        assert!(err.contains("\"bert\"") && err.contains("llama"), "{err}");
    }

    #[test]
    fn sentencepiece_merges_by_score_falls_back_to_bytes_and_decodes_spaces() {
        // "▁ab" ranks above "ab", so "▁ab" is built as "▁a"+"b" even though "a"+"b" alone would merge too.
        let tok = Tokenizer::from_gguf(&spm(&["▁", "a", "b", "▁a", "▁ab", "ab"])).expect("tokenizer builds");
        let id = |t: &str| tok.token_id(t).expect("token in vocabulary");
        assert_eq!(tok.add_bos, Some(1), "SentencePiece vocabularies add BOS unless told otherwise");
        let ids = tok.encode("ab ab é").expect("encodes");
        // é has no piece: its two UTF-8 bytes.
        let want = [1, id("▁ab"), id("▁ab"), id("▁"), id("<0xC3>"), id("<0xA9>")];
        assert_eq!(ids, want);
        assert_eq!(tok.decode(&ids).expect("decodes"), "ab ab é", "▁ back to spaces, the prefix space dropped");
        // Control tokens in the text are matched whole.
        assert_eq!(tok.encode("a</s>").expect("encodes"), [1, id("▁a"), 2]);
    }

    #[test]
    fn merges_from_scores_order_by_the_merged_piece() {
        let md = spm(&["a", "b", "c", "bc", "ab", "abc"]);
        let vocab = Vocab::read(&md).expect("vocabulary reads");
        let merges = merges_from_scores(&vocab, vocab.scores.as_ref().expect("has scores"));
        // bc (-262) before ab (-263) before abc (-264); abc's halves "a"+"bc" outrank "ab"+"c".
        assert_eq!(merges, [json!(["b", "c"]), json!(["a", "b"]), json!(["a", "bc"]), json!(["ab", "c"])]);
    }

    #[test]
    fn add_eos_and_no_space_prefix_follow_the_metadata() {
        let mut md = spm(&["▁", "a", "▁a"]);
        md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
        md.insert("tokenizer.ggml.add_eos_token".into(), Value::Bool(true));
        md.insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false));
        let tok = Tokenizer::from_gguf(&md).expect("tokenizer builds");
        let id = |t: &str| tok.token_id(t).expect("token in vocabulary");
        assert_eq!(tok.encode("a a").expect("encodes"), [id("a"), id("▁a"), 2]);
        assert_eq!(tok.decode(&[id("a"), id("▁a")]).expect("decodes"), "a a");
    }
}
