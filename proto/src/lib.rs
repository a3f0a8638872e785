//! strata's cluster contract: the `strata.v1` gRPC services (public `Coordinator`, internal `Stage`), wire id
//! newtypes, checked conversions of layer ranges into the wire's integers, the closed set of error codes and
//! their mapping to gRPC status, the hidden-state codec, W3C trace context propagation through gRPC metadata,
//! and the HTTP/2 keepalive of every long-lived connection. See `docs/protocol.md`.

pub mod codec;
pub mod error;
pub mod ids;
pub mod introspection;
pub mod keepalive;
mod layers;
#[cfg(feature = "clap")]
pub mod logging;
#[cfg(feature = "clap")]
pub mod shutdown;
pub mod status;
pub mod tls;
pub mod trace;

/// Generated `strata.v1` messages, clients (`*_client`) and servers (`*_server`).
#[allow(missing_docs, clippy::all, clippy::pedantic, clippy::unwrap_used)]
pub mod pb {
    tonic::include_proto!("strata.v1");

    /// Encoded `FileDescriptorSet` of every `strata.v1` file, served by the reflection service.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("strata_descriptor");
}

impl pb::StageStatus {
    /// The stage's KV cache capacity in tokens: its blocks times the tokens a block holds.
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.kv_total_blocks.saturating_mul(u64::from(self.block_size))
    }
}

pub use codec::{decode_to_f32, dtype_size, encode_f32, validate_hidden};
pub use error::{ProtoError, Result};
pub use ids::{NodeId, PlanEpoch, SeqId};
pub use introspection::{COORDINATOR_SERVICE, STAGE_SERVICE, health_service, reflection_services, set_serving};
pub use keepalive::Keepalive;
pub use layers::{WireLayers, wire_micros, wire_u32};
#[cfg(feature = "clap")]
pub use logging::{LogArgs, LogFormat, Telemetry};
#[cfg(feature = "clap")]
pub use shutdown::{shutdown_signal, shutdown_token};
pub use status::{ErrorCode, ServiceError};
#[cfg(feature = "clap")]
pub use tls::TlsArgs;
pub use tls::{Tls, TlsFiles, endpoint, host_of};
pub use trace::{
    context_from_traceparent, extract_context, inject_context, inject_current_span, set_parent_from_metadata,
    trace_interceptor, traceparent_of,
};
pub use {tonic_health, tonic_reflection};
