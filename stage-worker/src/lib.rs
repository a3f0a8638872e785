//! A strata stage worker: holds one contiguous range of a model's layers and serves it over the `Stage`
//! gRPC service. Micro-batches run on a single executor thread that owns the weights and the KV cache;
//! outputs stream to the next stage over one long-lived `Forward` stream, and the last stage samples.
//! Without a layer range, a worker registers with etcd (or the embedded registry) and serves what the
//! coordinator's plan assigns it (`registration`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), strata_stage_worker::Error> {
//! use strata_engine::LayerRange;
//! use strata_stage_worker::WorkerConfig;
//! let config = WorkerConfig::new("node-a", "/models/m.gguf", Some("0..30".parse::<LayerRange>()?));
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:7000").await?;
//! strata_stage_worker::run(config, listener, tokio_util::sync::CancellationToken::new()).await
//! # }
//! ```

mod answer;
mod config;
mod device;
mod direct;
mod downstream;
mod error;
mod executor;
mod io_runtime;
mod memory;
mod metrics;
mod registration;
mod sampler;
mod server;
mod slot;
mod term;
mod worker;

pub use config::WorkerConfig;
pub use error::{Error, Result};
pub use memory::DEFAULT_MEMORY_FRACTION;
pub use registration::{RegistrationOptions, run_registered};
pub use worker::{Worker, run};
