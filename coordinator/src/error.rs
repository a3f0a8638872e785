//! The crate's one error type.

use crate::placement::PlacementError;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the coordinator's control plane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is inconsistent; the message names the field.
    #[error("invalid coordinator config: {0}")]
    Config(String),
    /// The TLS files are missing, unreadable or do not fit together (the message names the file).
    #[error("{0}")]
    Tls(strata_proto::ProtoError),
    /// The model could not be opened or sized.
    #[error("model: {0}")]
    Model(#[from] strata_engine::Error),
    /// The membership registry failed (etcd, a stored record, a plan compare-and-swap, an unknown node).
    #[error(transparent)]
    Membership(#[from] strata_membership::Error),
    /// A public API's address could not be bound.
    #[error("cannot bind the {api} API on {addr}: {source}")]
    Bind {
        /// Which API (`gRPC` or `HTTP`).
        api: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
        /// The socket error.
        source: std::io::Error,
    },
    /// A generation request names a model this cluster does not serve.
    #[error("model {requested:?} is not served (this cluster serves {served:?})")]
    UnknownModel {
        /// The model asked for.
        requested: String,
        /// The model served.
        served: String,
    },
    /// A generation request is malformed or does not fit the model.
    #[error("{message}")]
    InvalidRequest {
        /// The request field at fault, when one is (`prompt`, `messages`, ...).
        param: Option<&'static str>,
        /// What is wrong.
        message: String,
    },
    /// Placement failed.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// The caller presented no API key, or one the coordinator does not know.
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller's API key does not allow the call (an admin call with a plain key).
    #[error("{0}")]
    PermissionDenied(String),
    /// A value does not fit its wire field (a layer index or count beyond `u32`).
    #[error(transparent)]
    Wire(strata_proto::ProtoError),
    /// The pipeline's thread or its runtime could not be started.
    #[error("cannot start the pipeline thread: {0}")]
    Thread(std::io::Error),
}
