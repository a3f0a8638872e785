//! The crate's error type.

use crate::pb::Dtype;

/// Result alias for this crate.
pub type Result<T, E = ProtoError> = std::result::Result<T, E>;

/// Everything that can go wrong in `strata-proto`'s helpers.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// TLS files are missing, unreadable or not PEM.
    #[error("TLS: {0}")]
    Tls(String),
    /// A server address is not a valid `host:port` or URL.
    #[error("bad address {0}")]
    Address(String),
    /// A hidden-state message names no dtype or one this build does not know.
    #[error("hidden states: unsupported dtype {0}")]
    UnsupportedDtype(i32),
    /// A hidden-state shape is not 2-D.
    #[error("hidden states: shape must be [rows, cols], got {shape:?}")]
    BadShape {
        /// The shape received.
        shape: Vec<u32>,
    },
    /// The byte length of a hidden-state message does not match its shape and dtype.
    #[error("hidden states: {rows}x{cols} {dtype:?} needs {expected} bytes, got {actual}")]
    DataLength {
        /// Rows in the shape.
        rows: usize,
        /// Columns in the shape.
        cols: usize,
        /// Element type.
        dtype: Dtype,
        /// Bytes the shape and dtype require.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The number of values to encode does not match `rows * cols`.
    #[error("hidden states: {rows}x{cols} needs {expected} values, got {actual}")]
    ValueCount {
        /// Rows requested.
        rows: usize,
        /// Columns requested.
        cols: usize,
        /// `rows * cols`.
        expected: usize,
        /// Values given.
        actual: usize,
    },
    /// A shape dimension or byte size does not fit the wire format or this machine's `usize`.
    #[error("hidden states: shape {rows}x{cols} is too large")]
    TooLarge {
        /// Rows requested.
        rows: u64,
        /// Columns requested.
        cols: u64,
    },
    /// A value does not fit its wire field, or a layer range to send is empty.
    #[error("{what} {value} cannot go on the wire: {reason}")]
    WireValue {
        /// What the value is.
        what: &'static str,
        /// The value.
        value: String,
        /// Why it cannot be sent.
        reason: &'static str,
    },
    /// The reflection service could not be built from the descriptor set.
    #[error("reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// A tracing span could not take the extracted remote context as its parent.
    #[error("trace context: {0}")]
    SetParent(#[from] tracing_opentelemetry::SetParentError),
}
