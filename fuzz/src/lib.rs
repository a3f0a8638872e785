//! The bodies of strata's fuzz targets, one function per target. Each takes any bytes and must neither panic nor,
//! while opening a model file, allocate more than `reader_alloc_limit` of the input's size (a small multiple of it);
//! errors are the expected answer to most inputs. The binaries in `src/bin/` hand these to AFL++; the `corpus`
//! test runs every seed and every committed crash through them under plain `cargo test --lib`.

use prost::Message;
use strata_coordinator::http::openai::{Body, ChatRequest, CompletionRequest, GenerationRequest};
use strata_engine::layout::{ModelLayout, TensorId};
use strata_engine::loader::gguf::GgufSource;
use strata_engine::loader::hf::HfSource;
use strata_engine::tensor::HostTensor;
use strata_engine::testing::alloc::{reader_alloc_limit, with_alloc_limit};
use strata_engine::tokenizer::Tokenizer;
use strata_proto::pb::{Dtype, ForwardRequest, HiddenStates};

pub use strata_engine::testing::alloc::CountingAlloc;

/// Tensors larger than this are opened but not converted to f32, to keep each run fast.
const MAX_CONVERTED_BYTES: usize = 1 << 20;

/// A directory of its own holding `files`, removed when dropped. (A directory per process, kept in a static, was
/// never removed: statics are not dropped, and every test run left one behind in the temporary folder.)
fn scratch(files: &[(&str, &[u8])]) -> Option<tempfile::TempDir> {
    let dir = tempfile::Builder::new().prefix("strata-fuzz").tempdir().ok()?;
    for (name, data) in files {
        std::fs::write(dir.path().join(name), data).ok()?;
    }
    Some(dir)
}

/// Reads [`some_tensors`] of `layout` through `tensor` and widens the small ones to f32.
fn read_tensors(layout: &ModelLayout<'_>, tensor: impl Fn(&str) -> strata_engine::Result<HostTensor>) {
    for id in some_tensors(layout) {
        let _ = layout.shape(id);
        if let Ok(t) = tensor(&id.hf_name())
            && t.bytes.len() <= MAX_CONVERTED_BYTES
        {
            let _ = t.to_f32();
        }
    }
}

/// The tensors each target reads after a model opens: the model-wide ones and the first layer's.
fn some_tensors(layout: &ModelLayout<'_>) -> Vec<TensorId> {
    [TensorId::Embed, TensorId::FinalNorm, TensorId::LmHead].into_iter().chain(layout.layer_tensors(0)).collect()
}

/// A GGUF file: opened (header, metadata, tensor directory, config), its tokenizer built, and the first layer's
/// tensors read and widened to f32.
pub fn gguf(data: &[u8]) {
    let Some(dir) = scratch(&[("model.gguf", data)]) else { return };
    let path = dir.path().join("model.gguf");
    let (opened, _) = with_alloc_limit(reader_alloc_limit(data.len()), || GgufSource::open(&path));
    let Ok(source) = opened else { return };
    let _ = Tokenizer::from_gguf(&source.metadata);
    read_tensors(&ModelLayout::new(source.config()), |name| source.tensor(name));
}

/// A Hugging Face directory: the input up to its first NUL byte is `config.json`, the rest `model.safetensors`.
pub fn safetensors_header(data: &[u8]) {
    let (config, weights) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Some(dir) = scratch(&[("config.json", config), ("model.safetensors", weights)]) else { return };
    let (opened, _) = with_alloc_limit(reader_alloc_limit(data.len()), || HfSource::open(dir.path()));
    let Ok(source) = opened else { return };
    read_tensors(&ModelLayout::new(source.config()), |name| source.tensor(name));
}

/// A stage's `ForwardRequest` as protobuf bytes: its hidden states decoded to f32 and, for f32, encoded back to the
/// same bytes.
pub fn hidden_codec(data: &[u8]) {
    let hidden = match ForwardRequest::decode(data) {
        Ok(ForwardRequest { hidden: Some(h), .. }) => h,
        _ => match HiddenStates::decode(data) {
            Ok(h) => h,
            Err(_) => return,
        },
    };
    let Ok((values, rows, cols)) = strata_proto::decode_to_f32(&hidden) else { return };
    assert_eq!(values.len(), rows * cols, "decoded value count");
    if hidden.dtype == Dtype::F32 as i32 {
        let again = strata_proto::encode_f32(&values, rows, cols, Dtype::F32);
        assert_eq!(again.map(|h| h.data).ok(), Some(hidden.data), "f32 hidden states round-trip");
    }
}

/// A request body for `/v1/completions` and for `/v1/chat/completions`, read and validated as the HTTP handlers do.
pub fn openai_request(data: &[u8]) {
    fn params<T: GenerationRequest>(data: &[u8]) {
        if let Ok(body) = Body::<T>::from_bytes(data) {
            let _ = body.fields.params(&body.common);
            let _ = body.common.streaming();
        }
    }
    params::<CompletionRequest>(data);
    params::<ChatRequest>(data);
}

/// A target's body.
pub type Target = fn(&[u8]);

/// The targets by name, for the corpus test.
pub const TARGETS: [(&str, Target); 4] = [
    ("gguf", gguf),
    ("safetensors_header", safetensors_header),
    ("hidden_codec", hidden_codec),
    ("openai_request", openai_request),
];

/// Every committed input (the seeds in `corpus/<target>/` and the crashes fixed since in `crashes/<target>/`) runs
/// through its target without AFL, so a fixed crash stays fixed under `cargo test --lib` (the binaries need AFL's
/// runtime to link, so this is a unit test rather than an integration test).
#[cfg(test)]
mod corpus {
    use std::path::Path;

    use super::{CountingAlloc, TARGETS};

    #[global_allocator]
    static ALLOC: CountingAlloc = CountingAlloc;

    #[test]
    fn every_committed_input_runs_cleanly() -> std::io::Result<()> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        for (name, target) in TARGETS {
            let mut seeds = 0;
            for dir in [root.join("corpus").join(name), root.join("crashes").join(name)] {
                let Ok(entries) = std::fs::read_dir(&dir) else { continue };
                for entry in entries {
                    let path = entry?.path();
                    if path.is_file() {
                        target(&std::fs::read(&path)?);
                        seeds += usize::from(path.starts_with(root.join("corpus")));
                    }
                }
            }
            assert!(seeds > 0, "{name} has no seeds in corpus/{name}");
        }
        Ok(())
    }
}
