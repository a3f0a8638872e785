//! The crate's one error type: what the registry, its backends and the cluster-address checks can fail with.

use std::time::Duration;

use strata_proto::{NodeId, PlanEpoch};

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in membership.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An etcd registry was asked for without any endpoint.
    #[error("no etcd endpoint given (omit the etcd endpoints to use the embedded registry)")]
    NoEndpoints,
    /// An etcd endpoint is not `host:port` or an `http://` / `https://` URL.
    #[error("etcd endpoint {0:?} must be host:port or an http:// or https:// URL")]
    InvalidEndpoint(String),
    /// A cluster name that cannot be a key segment.
    #[error("cluster {0:?} must be non-empty and use only [A-Za-z0-9._-]")]
    InvalidClusterName(String),
    /// The etcd TLS settings do not fit together or their files cannot be used: an `https://` endpoint without a
    /// CA, a CA with an `http://` endpoint, a certificate without its key, an unreadable PEM file.
    #[error("etcd TLS: {0}")]
    EtcdTls(String),
    /// etcd TLS or user flags without any etcd endpoint (they would be silently unused).
    #[error("--etcd-ca, --etcd-cert, --etcd-key, --etcd-user and --etcd-password-file need --etcd (STRATA_ETCD)")]
    EtcdFlagsWithoutEndpoints,
    /// The etcd user settings are incomplete: a user without a password or the reverse, an empty name.
    #[error("etcd user: {0}")]
    EtcdCredentials(String),
    /// etcd answered but refused us for good (wrong password, authentication required, a certificate it does not
    /// trust): retrying cannot help, so connecting stops at once.
    #[error("etcd at {endpoints} refused the connection: {reason}")]
    EtcdRefused {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// What was wrong, with what to check.
        reason: String,
    },
    /// No etcd endpoint answered within the start-up window.
    #[error("etcd unreachable at {endpoints} after {waited:?} ({attempts} attempts): {last_error}")]
    EtcdUnreachable {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// How long we kept trying.
        waited: Duration,
        /// Connection attempts made.
        attempts: u32,
        /// The last failure seen.
        last_error: String,
    },
    /// An etcd request failed.
    #[error("etcd {op}: {source}")]
    Etcd {
        /// The operation, e.g. `put /strata/c/plan`.
        op: String,
        /// The client error.
        source: etcd_client::Error,
    },
    /// A stored record is not valid JSON for its type.
    #[error("corrupt record at {key}: {source}")]
    Decode {
        /// The key whose value did not parse.
        key: String,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// A record could not be encoded.
    #[error("cannot encode record for {key}: {source}")]
    Encode {
        /// The key being written.
        key: String,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// The plan's compare-and-swap failed: the stored epoch is not the one the writer expected.
    #[error("stale plan epoch: expected stored {expected}, found {found}")]
    StaleEpoch {
        /// The epoch the writer based its plan on.
        expected: PlanEpoch,
        /// The epoch actually stored (0 when there is no plan).
        found: PlanEpoch,
    },
    /// A fenced write by a leader whose term is over: the leader key it was elected under is gone (another
    /// candidate may lead now). The writer must stop acting as leader.
    #[error("deposed: the leadership of term {term} is over")]
    Deposed {
        /// The term the write was made under.
        term: u64,
    },
    /// A new plan's epoch is not exactly one past the previous one.
    #[error("plan epoch {new} does not follow {previous}")]
    EpochNotNext {
        /// The stored epoch.
        previous: PlanEpoch,
        /// The epoch offered.
        new: PlanEpoch,
    },
    /// The named node is not registered.
    #[error("node {0} is not registered")]
    NodeNotFound(NodeId),
    /// A read-modify-write kept losing to concurrent writers.
    #[error("too many concurrent updates of {key}")]
    Contention {
        /// The key being updated.
        key: String,
    },
    /// The lease backing a registration or leadership no longer exists.
    #[error("lease {0:x} expired")]
    LeaseExpired(i64),
    /// The embedded store's watch history no longer reaches back to the requested revision.
    #[error("watch revision {requested} is compacted (oldest kept {oldest})")]
    Compacted {
        /// Revision asked for.
        requested: i64,
        /// Oldest revision still in history.
        oldest: i64,
    },
}

impl Error {
    /// Wraps an etcd client error with the operation that failed.
    pub(crate) fn etcd(op: impl Into<String>) -> impl FnOnce(etcd_client::Error) -> Error {
        let op = op.into();
        move |source| Error::Etcd { op, source }
    }
}
