//! The crate's one error type, and how engine errors map onto the wire's closed set of codes.

use strata_proto::{ErrorCode, ServiceError};

/// Everything that can stop a worker from starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error("invalid worker config: {0}")]
    Config(String),
    /// No layer range was given and no registry supplies one.
    #[error(
        "no layer range given: pass the layers to serve (--layers START..END), or --etcd to take them from the plan"
    )]
    NoLayers,
    /// The membership registry (etcd or embedded) failed.
    #[error("registry: {0}")]
    Registry(#[from] strata_membership::Error),
    /// Loading the model or building the backend failed.
    #[error("engine: {0}")]
    Engine(#[from] strata_engine::Error),
    /// The TLS files are missing, unreadable or do not fit together.
    #[error("{0}")]
    Tls(strata_proto::ProtoError),
    /// Building the gRPC introspection services failed.
    #[error("proto: {0}")]
    Proto(#[from] strata_proto::ProtoError),
    /// The gRPC server failed.
    #[error("gRPC transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// A socket operation failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The compute thread could not be started or stopped unexpectedly.
    #[error("executor: {0}")]
    Executor(String),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Maps an engine error raised while running a batch onto a wire error.
pub fn engine_to_service(err: &strata_engine::Error) -> ServiceError {
    use strata_engine::Error as E;
    let code = match err {
        E::InvalidRequest(_) | E::InvalidParam { .. } | E::Shape { .. } | E::LayerRange { .. } => {
            ErrorCode::InvalidArgument
        }
        E::KvExhausted { .. } => ErrorCode::ResourceExhausted,
        // The coordinator resets the cache and recomputes, as after any stage fault.
        E::PrefixCache(_) => ErrorCode::FailedPrecondition,
        E::UnknownSequence(_) => ErrorCode::NotFound,
        E::Device(_) => ErrorCode::Unavailable,
        _ => ErrorCode::Internal,
    };
    ServiceError::new(code, err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_keep_their_meaning() {
        let kv = strata_engine::Error::KvExhausted { needed: 3, free: 1 };
        assert_eq!(engine_to_service(&kv).code, ErrorCode::ResourceExhausted);
        let shape = strata_engine::Error::Shape { op: "forward", reason: "x".into() };
        assert_eq!(engine_to_service(&shape).code, ErrorCode::InvalidArgument);
        assert_eq!(engine_to_service(&strata_engine::Error::UnknownSequence(4)).code, ErrorCode::NotFound);
        let prefix = strata_engine::Error::PrefixCache("x".into());
        assert_eq!(engine_to_service(&prefix).code, ErrorCode::FailedPrecondition);
        assert_eq!(engine_to_service(&strata_engine::Error::Config("x".into())).code, ErrorCode::Internal);
    }
}
