//! Hugging Face model directories: `config.json` plus one or more safetensors files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::config::ModelConfig;
use crate::tensor::{Bytes, DType, HostTensor};
use crate::{Error, Result};

struct Entry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// An opened Hugging Face directory. Files are memory-mapped; tensor bytes are only touched when asked for.
pub struct HfSource {
    config: ModelConfig,
    maps: Vec<Arc<Mmap>>,
    entries: HashMap<String, Entry>,
}

fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: model files are treated as read-only for the life of the process; strata never writes them.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    Ok(Arc::new(map))
}

impl HfSource {
    /// Opens a directory holding `config.json` and `model.safetensors` (or a sharded index).
    pub fn open(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let mut config = ModelConfig::from_hf_json(&text)?;
        for id in generation_eos_ids(dir)? {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
        let files = safetensors_files(dir)?;
        let mut maps = Vec::new();
        let mut entries = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let map = map_file(path)?;
            let st = safetensors::SafeTensors::deserialize(&map)
                .map_err(|e| Error::Safetensors { path: path.clone(), reason: e.to_string() })?;
            for (name, view) in st.tensors() {
                let dtype = match view.dtype() {
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::BF16 => DType::BF16,
                    other => {
                        return Err(Error::UnsupportedDType { name, dtype: format!("{other:?}") });
                    }
                };
                let offset = view.data().as_ptr() as usize - map.as_ptr() as usize;
                entries.insert(
                    name,
                    Entry { file: i, dtype, shape: view.shape().to_vec(), offset, len: view.data().len() },
                );
            }
            maps.push(map);
        }
        Ok(HfSource { config, maps, entries })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Storage type and shape of a tensor, if present.
    pub fn meta(&self, name: &str) -> Option<(DType, Vec<usize>)> {
        self.entries.get(name).map(|e| (e.dtype, e.shape.clone()))
    }

    /// Reads one tensor (zero-copy where aligned).
    pub fn tensor(&self, name: &str) -> Result<HostTensor> {
        let e = self.entries.get(name).ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        let bytes = Bytes::mapped(self.maps[e.file].clone(), e.offset, e.len);
        HostTensor::new(name, e.dtype, e.shape.clone(), bytes)
    }
}

/// `generation_config.json`'s `eos_token_id` (one id or a list): chat models list their end-of-turn token there
/// (Llama 3's `<|eot_id|>`) while `config.json` names only the end of text, and generation must stop at both.
fn generation_eos_ids(dir: &Path) -> Result<Vec<u32>> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Ids {
        One(u32),
        Many(Vec<u32>),
    }
    #[derive(serde::Deserialize)]
    struct GenerationConfig {
        eos_token_id: Option<Ids>,
    }
    let path = dir.join("generation_config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let cfg: GenerationConfig =
        serde_json::from_str(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
    Ok(match cfg.eos_token_id {
        None => Vec::new(),
        Some(Ids::One(id)) => vec![id],
        Some(Ids::Many(ids)) => ids,
    })
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Safetensors { path: index.clone(), reason: e.to_string() })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Safetensors { path: index.clone(), reason: "no weight_map object".into() })?;
        let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
        files.sort();
        files.dedup();
        if files.iter().any(|f| f.contains('/') || f.contains("..")) {
            return Err(Error::Safetensors {
                path: index,
                reason: "weight_map names a file outside the directory".into(),
            });
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    Err(Error::Config(format!("{} has neither model.safetensors nor model.safetensors.index.json", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_eos_ids_are_one_or_many() {
        let tmp = tempfile::tempdir().expect("temp files");
        assert_eq!(
            generation_eos_ids(tmp.path()).expect("reads generation_config.json"),
            Vec::<u32>::new(),
            "no file, no ids"
        );
        let write = |t: &str| std::fs::write(tmp.path().join("generation_config.json"), t).expect("temp files");
        write(r#"{"bos_token_id": 1, "eos_token_id": [128001, 128008, 128009]}"#);
        assert_eq!(generation_eos_ids(tmp.path()).expect("reads generation_config.json"), vec![128001, 128008, 128009]);
        write(r#"{"eos_token_id": 2}"#);
        assert_eq!(generation_eos_ids(tmp.path()).expect("reads generation_config.json"), vec![2]);
        write(r#"{"eos_token_id": "x"}"#);
        assert!(generation_eos_ids(tmp.path()).is_err());
    }
}
