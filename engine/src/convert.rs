//! Converting a GGUF model into a Hugging Face directory (dequantized), so both formats can be checked
//! against each other and GGUF-only models can be served from safetensors.

use std::path::Path;

use crate::layout::{ModelLayout, TensorId};
use crate::loader::ModelFiles;
use crate::tensor::DType;
use crate::{Error, Result};

/// Writes `config.json`, `model.safetensors`, `tokenizer.json` and `tokenizer_config.json` into `out`.
/// Matrices are stored as `dtype` (f32, f16 or bf16); norms stay f32.
pub fn to_hf_dir(files: &ModelFiles, out: &Path, dtype: DType) -> Result<()> {
    if dtype.is_quantized() {
        return Err(Error::Config(format!("cannot write {dtype} into safetensors; use f32, f16 or bf16")));
    }
    let cfg = files.config();
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let names: Vec<String> = ModelLayout::new(cfg).tensors().into_iter().map(TensorId::hf_name).collect();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let t = files.tensor(&name)?;
        let target = if t.shape.len() == 2 { dtype } else { DType::F32 };
        let t =
            if t.dtype.is_quantized() { crate::tensor::HostTensor::from_f32(t.shape.clone(), &t.to_f32()) } else { t };
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
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
    });
    write("tokenizer_config.json", serde_json::to_string_pretty(&tc).map_err(|e| Error::Config(e.to_string()))?)
}
