//! strata's model engine: loading Llama-family models by layer range (Hugging Face safetensors or GGUF),
//! the backend trait with its CPU reference implementation, the paged KV cache, tokenization and sampling, and
//! the types users name for them (device, float dtype, layer range). Test model builders are behind the
//! `testing` feature.

pub mod backend;
pub mod config;
pub mod convert;
mod device;
mod dtype;
mod error;
pub mod generate;
pub mod gguf_writer;
pub mod heap;
pub mod kv_cache;
mod layer_range;
pub mod layout;
pub mod loader;
pub mod model;
pub mod offload;
pub mod perplexity;
pub mod quant;
pub mod sampling;
pub mod stage_memory;
pub mod tensor;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;

pub use backend::cpu::CpuIsa;
pub use device::{Device, DeviceSpec, OnBackend, on_device, parse_bytes};
pub use dtype::{FloatDtype, HiddenDtype, KvDtype};
pub use error::{Error, Result};
pub use layer_range::LayerRange;
pub use quant::QuantDtype;
