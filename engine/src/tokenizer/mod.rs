//! Text ↔ token ids: Hugging Face `tokenizer.json`, or a tokenizer rebuilt from GGUF metadata, plus the
//! chat template and incremental detokenization.

use std::collections::HashMap;
use std::path::Path;

use crate::loader::gguf::Value;
use crate::{Error, Result};

pub mod gguf;

/// A tokenizer with the model's special-token conventions.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Prepend this id when encoding a prompt, when the model wants a BOS token.
    pub add_bos: Option<u32>,
    /// Append this id when encoding a prompt, when the model wants an EOS token after it.
    pub add_eos: Option<u32>,
    /// Jinja chat template, when the model ships one.
    pub chat_template: Option<String>,
    /// BOS token text (for templates).
    pub bos_token: String,
    /// EOS token text (for templates).
    pub eos_token: String,
}

/// One chat message.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Loads `tokenizer.json` (and `tokenizer_config.json` when present) from a Hugging Face directory.
    pub fn from_hf_dir(dir: &Path, bos_token_id: Option<u32>) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(t) => serde_json::from_str(&t).map_err(|e| Error::Tokenizer(format!("{}: {e}", cfg_path.display())))?,
            Err(_) => serde_json::Value::Null,
        };
        let token_text = |key: &str| -> String {
            match cfg.get(key) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => v.get("content").and_then(|c| c.as_str()).unwrap_or("").to_string(),
                None => String::new(),
            }
        };
        let flag = |key: &str| cfg.get(key).and_then(|v| v.as_bool()).unwrap_or(false);
        let eos_text = token_text("eos_token");
        let add_eos = if flag("add_eos_token") { inner.token_to_id(&eos_text) } else { None };
        Ok(Tokenizer {
            add_bos: if flag("add_bos_token") { bos_token_id } else { None },
            add_eos,
            chat_template: chat_template(dir, &cfg)?,
            bos_token: token_text("bos_token"),
            eos_token: eos_text,
            inner,
        })
    }

    /// Rebuilds the tokenizer from GGUF `tokenizer.ggml.*` metadata (byte-level BPE or SentencePiece).
    pub fn from_gguf(md: &HashMap<String, Value>) -> Result<Self> {
        let json = gguf::tokenizer_json(md)?;
        let inner = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).map_err(tok_err)?;
        let tokens = md.get("tokenizer.ggml.tokens").and_then(Value::as_array).unwrap_or(&[]);
        let text_of = |key: &str| {
            md.get(key)
                .and_then(Value::as_u64)
                .and_then(|i| tokens.get(i as usize))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let id = |key: &str| md.get(key).and_then(Value::as_u64).map(|v| v as u32);
        // Without the flag llama.cpp adds BOS for SentencePiece vocabularies and not for byte-level BPE ones.
        let spm = md.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("llama");
        let flag = |key: &str, default: bool| md.get(key).map_or(default, |v| *v == Value::Bool(true));
        let add_bos = flag("tokenizer.ggml.add_bos_token", spm);
        let add_eos = flag("tokenizer.ggml.add_eos_token", false);
        Ok(Tokenizer {
            inner,
            add_bos: id("tokenizer.ggml.bos_token_id").filter(|_| add_bos),
            add_eos: id("tokenizer.ggml.eos_token_id").filter(|_| add_eos),
            chat_template: md.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string),
            bos_token: text_of("tokenizer.ggml.bos_token_id"),
            eos_token: text_of("tokenizer.ggml.eos_token_id"),
        })
    }

    /// Encodes text into ids (special tokens in the text are recognised), adding BOS when the model wants it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// [`Tokenizer::encode`], adding the model's BOS and EOS only with `add_special_tokens`.
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        // A text that starts with the BOS token's text (a rendered chat template) has it already; an unnamed BOS
        // token (empty text) is always added.
        if let Some(b) = self.add_bos.filter(|_| add_special_tokens)
            && (self.bos_token.is_empty() || !text.starts_with(&self.bos_token))
        {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        ids.extend(self.add_eos.filter(|_| add_special_tokens));
        Ok(ids)
    }

    /// The vocabulary's string of each id (`None` outside it), as `convert_ids_to_tokens` gives them.
    pub fn token_strs(&self, ids: &[u32]) -> Vec<Option<String>> {
        ids.iter().map(|&id| self.inner.id_to_token(id)).collect()
    }

    /// Decodes ids into text, keeping special tokens out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tok_err)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string, when it exists.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Serializes the underlying tokenizer as `tokenizer.json` text.
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(tok_err)
    }

    /// Renders a conversation through the model's chat template, ending with the assistant prompt.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_chat(messages, true)
    }

    /// Renders a conversation through the model's chat template; with `add_generation_prompt`, the template's
    /// opening of the assistant's turn ends it.
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::ChatTemplate("the model ships no chat template".into()))?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", template).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        let tmpl = env.get_template("chat").map_err(|e| Error::ChatTemplate(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| Error::ChatTemplate(e.to_string()))
    }
}

/// The chat template of a Hugging Face directory: `tokenizer_config.json`'s `chat_template` (a string, or a list
/// of named templates of which the `default` one is used), else the `chat_template.jinja` file newer
/// exports write beside it.
fn chat_template(dir: &Path, cfg: &serde_json::Value) -> Result<Option<String>> {
    match cfg.get("chat_template") {
        Some(serde_json::Value::String(s)) => return Ok(Some(s.clone())),
        Some(serde_json::Value::Array(named)) => {
            let default = named.iter().find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
            if let Some(t) = default.and_then(|t| t.get("template")).and_then(|t| t.as_str()) {
                return Ok(Some(t.to_string()));
            }
        }
        _ => {}
    }
    let path = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(&path, e)),
    }
}

/// Turns a growing list of ids into text deltas, holding back incomplete UTF-8 sequences. Each step decodes only a
/// short window (the ids of the last emitted delta, kept as context because decoders treat a sequence's first
/// token specially, plus the ids not emitted yet), so a token costs the same at position 4,000 as at 4; the
/// deltas still add up to the decoding of all ids.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    /// The window: context ids first, then ids whose text is not emitted yet.
    ids: Vec<u32>,
    /// How many of `ids` are context.
    context: usize,
    /// The decoding of the context ids: the window's text already emitted.
    context_text: String,
}

impl IncrementalDecoder {
    /// Adds one id; returns the new text, if any became complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        let done = self.context_text.len();
        if text.len() <= done || text.ends_with('\u{fffd}') || !text.is_char_boundary(done) {
            return Ok(String::new());
        }
        // Decoding more ids can in principle rewrite earlier text (a tokenizer's cleanup); what was emitted
        // stays emitted, and the delta is what lies beyond it.
        let delta = text[done..].to_string();
        // The ids just emitted become the context of the next step.
        self.ids.drain(..self.context);
        self.context = self.ids.len();
        self.context_text = tok.decode(&self.ids)?;
        Ok(delta)
    }
}

/// The GPT-2 byte-level alphabet: the printable character standing for each byte value.
pub fn byte_level_alphabet() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xa1..=0xac).chain(0xae..=0xff).collect();
    let mut chars: Vec<(u32, u32)> = printable.iter().map(|&b| (b, b)).collect();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            chars.push((b, 256 + n));
            n += 1;
        }
    }
    printable.clear();
    chars.sort_unstable();
    chars.into_iter().map(|(_, c)| char::from_u32(c).unwrap_or('?')).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Hugging Face directory whose tokenizer.json is rebuilt from a tiny GGUF vocabulary.
    fn hf_dir(config: serde_json::Value, jinja: Option<&str>) -> tempfile::TempDir {
        let tokens = ["<s>", "</s>", "a", "b"].map(|t| Value::Str(t.into())).to_vec();
        let md = HashMap::from([
            ("tokenizer.ggml.model".to_string(), Value::Str("gpt2".into())),
            ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
            ("tokenizer.ggml.token_type".into(), Value::Array([3, 3, 1, 1].map(Value::U64).to_vec())),
            ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
        ]);
        let dir = tempfile::tempdir().expect("temp files");
        std::fs::write(
            dir.path().join("tokenizer.json"),
            Tokenizer::from_gguf(&md).expect("temp files").to_json().expect("temp files"),
        )
        .expect("test fixture");
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("temp files");
        if let Some(t) = jinja {
            std::fs::write(dir.path().join("chat_template.jinja"), t).expect("temp files");
        }
        dir
    }

    #[test]
    fn chat_template_jinja_is_used_when_the_config_has_none() {
        let only_file = hf_dir(serde_json::json!({"eos_token": "</s>"}), Some("from file"));
        assert_eq!(
            Tokenizer::from_hf_dir(only_file.path(), None).expect("tokenizer loads").chat_template.as_deref(),
            Some("from file")
        );
        let both = hf_dir(serde_json::json!({"chat_template": "from config"}), Some("from file"));
        assert_eq!(
            Tokenizer::from_hf_dir(both.path(), None).expect("tokenizer loads").chat_template.as_deref(),
            Some("from config")
        );
        let named = hf_dir(serde_json::json!({"chat_template": [{"name": "default", "template": "named"}]}), None);
        assert_eq!(
            Tokenizer::from_hf_dir(named.path(), None).expect("tokenizer loads").chat_template.as_deref(),
            Some("named")
        );
        let none = hf_dir(serde_json::json!({}), None);
        assert_eq!(Tokenizer::from_hf_dir(none.path(), None).expect("tokenizer loads").chat_template, None);
    }

    #[test]
    fn the_generation_prompt_is_the_templates_to_add() {
        let jinja = "{% for m in messages %}[{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}";
        let tok = Tokenizer::from_hf_dir(hf_dir(serde_json::json!({}), Some(jinja)).path(), None).expect("loads");
        let messages = [ChatMessage { role: "user".into(), content: "a".into() }];
        assert_eq!(tok.apply_chat_template(&messages).expect("renders"), "[a]>");
        assert_eq!(tok.render_chat(&messages, false).expect("renders"), "[a]");
    }

    #[test]
    fn add_bos_and_add_eos_wrap_the_prompt() {
        let cfg =
            serde_json::json!({"add_bos_token": true, "add_eos_token": true, "bos_token": "<s>", "eos_token": "</s>"});
        let tok = Tokenizer::from_hf_dir(hf_dir(cfg, None).path(), Some(0)).expect("tokenizer loads");
        assert_eq!(tok.encode("ab").expect("encodes"), [0, 2, 3, 1]);
        // Special tokens in the text are single ids, and decoding leaves them out.
        assert_eq!(tok.encode("a</s>b").expect("encodes"), [0, 2, 1, 3, 1]);
        assert_eq!(tok.decode(&[0, 2, 1, 3]).expect("decodes"), "ab");
        // A text starting with the BOS token's text has it already.
        assert_eq!(tok.encode("<s>ab").expect("encodes")[..2], [0, 2]);
        // Without special tokens (vLLM's add_special_tokens: false) neither is added; the text's own stay.
        assert_eq!(tok.encode_with("ab", false).expect("encodes"), [2, 3]);
        assert_eq!(tok.encode_with("a</s>b", false).expect("encodes"), [2, 1, 3]);
        assert_eq!(tok.token_strs(&[0, 3, 9]), [Some("<s>".into()), Some("b".into()), None]);
        // A BOS token without a name in tokenizer_config.json is still added.
        let unnamed = serde_json::json!({"add_bos_token": true});
        let tok = Tokenizer::from_hf_dir(hf_dir(unnamed, None).path(), Some(0)).expect("tokenizer loads");
        assert_eq!(tok.encode("ab").expect("encodes"), [0, 2, 3]);
    }
}
