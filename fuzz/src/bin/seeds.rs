//! Writes the seed corpora (`cargo run --bin seeds -- fuzz/corpus`): tiny valid models written by the engine's own
//! writers, valid hidden-state messages, and OpenAI requests. The committed seeds came from this; rerun it when a
//! format changes.

use std::path::Path;

use anyhow::{Context, Result};
use prost::Message;
use strata_engine::config::{Architecture, ModelConfig};
use strata_engine::tensor::DType;
use strata_engine::testing::{GgufOverrides, TinySpec, random_weights, tiny_config, write_gguf, write_hf};
use strata_proto::pb::{Dtype, ForwardRequest, SeqChunk};

fn config(architecture: Architecture, hidden: usize, head_dim: usize) -> ModelConfig {
    ModelConfig {
        architecture,
        hidden_size: hidden,
        intermediate_size: hidden,
        num_layers: 1,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim,
        vocab_size: 4,
        attention_bias: architecture == Architecture::Qwen2,
        eos_token_ids: vec![3],
        ..tiny_config()
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    std::fs::write(dir.join(name), bytes).with_context(|| format!("{}/{name}", dir.display()))
}

fn main() -> Result<()> {
    let out = std::env::args().nth(1).context("usage: seeds OUT_DIR")?;
    let out = Path::new(&out);
    let tmp = tempfile::tempdir()?;

    let models = [
        ("llama-f16", config(Architecture::Llama, 8, 4), DType::F16),
        ("qwen3-q8_0", config(Architecture::Qwen3, 32, 16), DType::parse("q8_0").context("q8_0")?),
    ];
    for (name, config, dtype) in models {
        let spec = TinySpec { config, dtype, seed: 1 };
        let path = tmp.path().join(format!("{name}.gguf"));
        write_gguf(&path, &spec, &random_weights(&spec), &GgufOverrides::default())?;
        write(&out.join("gguf"), &format!("{name}.gguf"), &std::fs::read(&path)?)?;
    }

    for (name, config, dtype) in [
        ("llama-bf16", config(Architecture::Llama, 8, 4), DType::BF16),
        ("qwen2-f32", config(Architecture::Qwen2, 8, 4), DType::F32),
    ] {
        let spec = TinySpec { config, dtype, seed: 1 };
        let dir = tmp.path().join(name);
        write_hf(&dir, &spec, &random_weights(&spec))?;
        let mut bytes = std::fs::read(dir.join("config.json"))?;
        bytes.push(0);
        bytes.extend(std::fs::read(dir.join("model.safetensors"))?);
        write(&out.join("safetensors_header"), &format!("{name}.bin"), &bytes)?;
    }

    let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    for (name, dtype) in [("f32", Dtype::F32), ("f16", Dtype::F16), ("bf16", Dtype::Bf16)] {
        let hidden = strata_proto::encode_f32(&values, 2, 3, dtype)?;
        let chunk = |seq_id, start_pos| SeqChunk { seq_id, start_pos, len: 1, ..Default::default() };
        let request = ForwardRequest {
            plan_epoch: 1,
            batch_id: 7,
            chunks: vec![chunk(1, 0), chunk(2, 5)],
            token_ids: vec![10, 11],
            hidden: Some(hidden),
            term: 1,
            ..Default::default()
        };
        write(&out.join("hidden_codec"), &format!("{name}.pb"), &request.encode_to_vec())?;
    }

    let requests = [
        ("completion", r#"{"model":"m","prompt":"Hello","max_tokens":8,"temperature":0.7,"top_p":0.9,"stop":["\n"]}"#),
        (
            "completion-ids",
            r#"{"prompt":[[1,2,3]],"logprobs":0,"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
        (
            "chat",
            r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_completion_tokens":4,"top_k":-1,"seed":3}"#,
        ),
        ("chat-unsupported", r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}],"n":2}"#),
    ];
    for (name, body) in requests {
        write(&out.join("openai_request"), &format!("{name}.json"), body.as_bytes())?;
    }
    Ok(())
}
