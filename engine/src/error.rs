//! The engine's one error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` (or GGUF metadata) is malformed or incomplete.
    #[error("invalid model config: {0}")]
    Config(String),
    /// The architecture is not one this engine implements.
    #[error("unsupported architecture {name:?} (supported: {supported})")]
    UnsupportedArchitecture {
        /// The name the model gives (`gguf:` and the `general.architecture` for a GGUF file).
        name: String,
        /// The names this engine runs, from [`crate::config::Architecture::ALL`].
        supported: String,
    },
    /// A safetensors file is malformed (truncated, bad header, bad offsets).
    #[error("invalid safetensors file {path}: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// A GGUF file is malformed.
    #[error("invalid GGUF file {path}: {reason}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the model needs is absent.
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    /// A tensor has the wrong shape for the config.
    #[error("tensor {name:?} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Shape in the file.
        actual: Vec<usize>,
        /// Shape the config implies.
        expected: Vec<usize>,
    },
    /// A tensor element type this engine cannot hold.
    #[error("tensor {name:?} has unsupported type {dtype}")]
    UnsupportedDType {
        /// Tensor name.
        name: String,
        /// The type as named by the file format.
        dtype: String,
    },
    /// `--model ORG/NAME[@REVISION]` named no existing path and no snapshot in the Hugging Face cache.
    #[error("model {spec:?} is neither a path nor in the Hugging Face cache: {reason}")]
    NotInHubCache {
        /// What was asked for.
        spec: String,
        /// Where it was looked for and what was missing.
        reason: String,
    },
    /// The tokenizer could not be built or failed to encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be rendered.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A request that cannot be served as given (empty prompt, id outside the vocab, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A request parameter out of its range (a sampling parameter, `max_tokens`): named so an API can point at it.
    #[error("invalid request: {message}")]
    InvalidParam {
        /// The parameter, by its API name (`min_p`, `top_p`, ...).
        param: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The KV cache has no free block left.
    #[error("KV cache exhausted: need {needed} blocks, {free} free")]
    KvExhausted {
        /// Blocks asked for.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// A KV cache type whose blocks do not tile a cached row.
    #[error("a {dtype} KV cache needs kv_dim (KV heads × head width) to be a multiple of {block}, got {kv_dim}")]
    KvDim {
        /// The KV type asked for.
        dtype: crate::KvDtype,
        /// The row width: KV heads × head width.
        kv_dim: usize,
        /// Elements per block of that type.
        block: usize,
    },
    /// A KV cache type this backend cannot store.
    #[error("{device} cannot keep its KV cache as {dtype}: {reason}")]
    KvDtypeUnsupported {
        /// The backend's device name.
        device: String,
        /// The KV type asked for.
        dtype: crate::KvDtype,
        /// Why, and what would work instead.
        reason: String,
    },
    /// The prefix cache on this stage does not match what the coordinator asked of it (it has restarted or missed
    /// a batch): the batch must be recomputed after the coordinator resets the cache.
    #[error("prefix cache out of step with the coordinator: {0}")]
    PrefixCache(String),
    /// A sequence id the KV cache does not know.
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    /// The layer range is empty or outside the model.
    #[error("invalid layer range {start}..{end} for a model of {layers} layers")]
    LayerRange {
        /// First layer.
        start: usize,
        /// One past the last layer.
        end: usize,
        /// Layers in the model.
        layers: usize,
    },
    /// An input tensor does not have the shape an op expects.
    #[error("{op}: {reason}")]
    Shape {
        /// The op.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The requested device or backend is not available here.
    #[error("device unavailable: {0}")]
    Device(String),
    /// A CUDA device was asked for, but this build has only the CPU backend.
    #[error("device {device}: this build has no CUDA support (build with --features cuda)")]
    CudaNotCompiled {
        /// The device asked for.
        device: String,
    },
    /// A value given as text or on the wire (a device, a dtype, a layer range) is not valid.
    #[error("invalid {what} {value:?}: expected {expected}")]
    InvalidValue {
        /// What the value names.
        what: &'static str,
        /// The value as given.
        value: String,
        /// What would have been accepted.
        expected: &'static str,
    },
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
