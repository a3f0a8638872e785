//! Generation stops at every end id a model names, not only at its EOS: a GGUF's `eot_token_id` joins
//! `eos_token_id`, and a Hugging Face directory's `generation_config.json` adds to `config.json`'s.

use anyhow::Result;
use strata_engine::loader::ModelFiles;
use strata_engine::tensor::DType;
use strata_engine::testing::{GgufOverrides, TinySpec, random_weights, tiny_config, write_gguf, write_hf};

fn spec(eos: Vec<u32>) -> TinySpec {
    TinySpec {
        config: strata_engine::config::ModelConfig { eos_token_ids: eos, ..tiny_config() },
        dtype: DType::F32,
        seed: 3,
    }
}

#[test]
fn gguf_eot_is_a_stop_id() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("m.gguf");
    let spec = spec(vec![2, 7]);
    write_gguf(&path, &spec, &random_weights(&spec), &GgufOverrides::default())?;
    assert_eq!(ModelFiles::open(&path)?.config().eos_token_ids, [2, 7]);
    Ok(())
}

#[test]
fn generation_config_adds_stop_ids() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let spec = spec(vec![2]);
    write_hf(dir.path(), &spec, &random_weights(&spec))?;
    std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": [2, 8, 9]}"#)?;
    assert_eq!(ModelFiles::open(dir.path())?.config().eos_token_ids, [2, 8, 9]);
    Ok(())
}
