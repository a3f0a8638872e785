//! strata's coordinator (control plane): reads the model, tracks stage workers registered in etcd (or an
//! embedded registry, both from `strata-membership`), elects one active coordinator, places the model's layers on the READY nodes and publishes
//! the plan with an epoch. The data path is `pipeline` (continuous batching over one `Forward` stream to stage 0)
//! behind the `api` (gRPC) and `http` (OpenAI-compatible) services; `request` validates what both accept. See
//! `docs/architecture.md`.

pub mod api;
pub mod auth;
pub mod config;
pub mod coordinator;
mod error;
pub mod http;
pub mod metrics;
pub mod pipeline;
pub mod placement;
pub mod request;
mod serving;
mod sizing;
pub mod stage_client;
pub mod tls_listener;

pub use config::CoordinatorConfig;
pub use coordinator::{
    ClusterSnapshot, ClusterView, Coordinator, bind_api, cordon_node, drain_node, run, run_with_registry,
    serve_with_registry, uncordon_node,
};
pub use error::{Error, Result};
pub use pipeline::{
    MAX_MICRO_BATCHES_PER_STAGE, ModelInfo, Pipeline, PipelineOptions, PrefixCaching, SchedulerLimits, SeqEvent,
    SeqRequest, StepTiming, Suspect, Timeouts,
};
pub use placement::{ModelShape, NodeCapacity, PlacementError, SizeOptions, StageAssignment};
