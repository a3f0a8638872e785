//! Opening a model from disk: a Hugging Face directory or a GGUF file, behind one interface that hands out
//! tensors by their Hugging Face names.

pub mod gguf;
pub mod hf;
pub mod hub;
pub mod synthetic;

use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::tensor::{DType, HostTensor};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// An opened model: config, tensor index and tokenizer source. Tensor data is read on demand.
pub enum ModelFiles {
    /// A Hugging Face directory.
    Hf {
        /// The directory.
        dir: PathBuf,
        /// Its safetensors index.
        source: hf::HfSource,
    },
    /// A GGUF file.
    Gguf(gguf::GgufSource),
    /// Seeded random weights in a known layout (`random:<preset>[:<dtype>]`), for benchmarks.
    Synthetic(synthetic::SyntheticSource),
}

impl ModelFiles {
    /// Opens `path`: a directory with `config.json`, a `.gguf` file, `random:<preset>[:<dtype>]`, or a Hugging
    /// Face name `ORG/NAME[@REVISION]` found in the local hub cache ([`hub`]).
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(spec) = path.to_str().filter(|p| p.starts_with(synthetic::PREFIX)) {
            return Ok(ModelFiles::Synthetic(synthetic::SyntheticSource::open(spec)?));
        }
        let resolved = hub::resolve_model_path(path, hub::HubCache::from_env().as_ref())?;
        let path = resolved.as_path();
        if path.is_dir() {
            return Ok(ModelFiles::Hf { dir: path.to_path_buf(), source: hf::HfSource::open(path)? });
        }
        if !path.exists() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        Ok(ModelFiles::Gguf(gguf::GgufSource::open(path)?))
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelFiles::Hf { source, .. } => source.config(),
            ModelFiles::Gguf(g) => g.config(),
            ModelFiles::Synthetic(s) => s.config(),
        }
    }

    /// Reads a tensor by Hugging Face name.
    pub fn tensor(&self, name: &str) -> Result<HostTensor> {
        match self {
            ModelFiles::Hf { source, .. } => source.tensor(name),
            ModelFiles::Gguf(g) => g.tensor(name),
            ModelFiles::Synthetic(s) => s.tensor(name),
        }
    }

    /// Storage type and shape of a tensor, without reading (or generating) its data.
    pub fn tensor_meta(&self, name: &str) -> Result<(DType, Vec<usize>)> {
        let meta = match self {
            ModelFiles::Hf { source, .. } => source.meta(name),
            ModelFiles::Gguf(g) => g.meta(name),
            ModelFiles::Synthetic(s) => s.meta(name),
        };
        meta.ok_or_else(|| Error::MissingTensor(name.to_string()))
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        match self {
            ModelFiles::Hf { source, .. } => source.contains(name),
            ModelFiles::Gguf(g) => g.contains(name),
            ModelFiles::Synthetic(s) => s.contains(name),
        }
    }

    /// Builds the model's tokenizer.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        match self {
            ModelFiles::Hf { dir, source } => Tokenizer::from_hf_dir(dir, source.config().bos_token_id),
            ModelFiles::Gguf(g) => Tokenizer::from_gguf(&g.metadata),
            ModelFiles::Synthetic(_) => Err(Error::Tokenizer("a synthetic (random:) model has no tokenizer".into())),
        }
    }
}
