//! strata's model engine: loading Llama-family models by layer range (Hugging Face safetensors or GGUF),
//! the backend trait with its CPU reference implementation, the paged KV cache, tokenization and sampling.

pub mod backend;
pub mod config;
pub mod convert;
mod error;
pub mod generate;
pub mod kv_cache;
pub mod layout;
pub mod loader;
pub mod model;
pub mod offload;
pub mod quant;
pub mod sampling;
pub mod tensor;
pub mod testing;
pub mod tokenizer;

pub use error::{Error, Result};
