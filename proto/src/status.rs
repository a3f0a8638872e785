//! The closed set of error codes strata's services use, and their one mapping to and from gRPC status (and to
//! and from the in-stream `pb::Error`). Every hop converts here, so codes stay typed across the pipeline.

use std::fmt;

use tonic::Code;

use crate::error::ProtoError;
use crate::pb;

/// What kind of failure a service error is; maps one to one onto a gRPC code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The request is malformed.
    InvalidArgument,
    /// A named node, sequence or model does not exist.
    NotFound,
    /// KV cache blocks, queue slots or memory are exhausted.
    ResourceExhausted,
    /// The peer or a downstream stage cannot be reached right now.
    Unavailable,
    /// The system is not in a state to serve this (stale plan epoch, cordoned node).
    FailedPrecondition,
    /// The caller cancelled the request.
    Cancelled,
    /// The deadline passed before the request finished.
    DeadlineExceeded,
    /// A bug or unexpected failure on the serving side.
    Internal,
    /// The caller presented no valid credentials (API key).
    Unauthenticated,
    /// The caller's credentials do not allow this call.
    PermissionDenied,
}

impl ErrorCode {
    /// Every code, in wire order.
    pub const ALL: [ErrorCode; 10] = [
        ErrorCode::InvalidArgument,
        ErrorCode::NotFound,
        ErrorCode::ResourceExhausted,
        ErrorCode::Unavailable,
        ErrorCode::FailedPrecondition,
        ErrorCode::Cancelled,
        ErrorCode::DeadlineExceeded,
        ErrorCode::Internal,
        ErrorCode::Unauthenticated,
        ErrorCode::PermissionDenied,
    ];

    /// Whether retrying the same request later may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorCode::Unavailable | ErrorCode::ResourceExhausted)
    }

    /// The snake_case name used in logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::NotFound => "not_found",
            ErrorCode::ResourceExhausted => "resource_exhausted",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::FailedPrecondition => "failed_precondition",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::Internal => "internal",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::PermissionDenied => "permission_denied",
        }
    }

    /// The gRPC code this error code is sent as.
    pub fn to_grpc(self) -> Code {
        match self {
            ErrorCode::InvalidArgument => Code::InvalidArgument,
            ErrorCode::NotFound => Code::NotFound,
            ErrorCode::ResourceExhausted => Code::ResourceExhausted,
            ErrorCode::Unavailable => Code::Unavailable,
            ErrorCode::FailedPrecondition => Code::FailedPrecondition,
            ErrorCode::Cancelled => Code::Cancelled,
            ErrorCode::DeadlineExceeded => Code::DeadlineExceeded,
            ErrorCode::Internal => Code::Internal,
            ErrorCode::Unauthenticated => Code::Unauthenticated,
            ErrorCode::PermissionDenied => Code::PermissionDenied,
        }
    }

    /// The error code a received gRPC code means; codes outside the closed set fold into their nearest member.
    pub fn from_grpc(code: Code) -> Self {
        match code {
            Code::InvalidArgument | Code::OutOfRange => ErrorCode::InvalidArgument,
            Code::NotFound => ErrorCode::NotFound,
            Code::ResourceExhausted => ErrorCode::ResourceExhausted,
            Code::Unavailable | Code::Aborted => ErrorCode::Unavailable,
            Code::FailedPrecondition | Code::AlreadyExists => ErrorCode::FailedPrecondition,
            Code::Unauthenticated => ErrorCode::Unauthenticated,
            Code::PermissionDenied => ErrorCode::PermissionDenied,
            Code::Cancelled => ErrorCode::Cancelled,
            Code::DeadlineExceeded => ErrorCode::DeadlineExceeded,
            Code::Ok | Code::Unknown | Code::Unimplemented | Code::Internal | Code::DataLoss => ErrorCode::Internal,
        }
    }

    /// The wire enum value of this code.
    pub fn to_pb(self) -> pb::ErrorCode {
        match self {
            ErrorCode::InvalidArgument => pb::ErrorCode::InvalidArgument,
            ErrorCode::NotFound => pb::ErrorCode::NotFound,
            ErrorCode::ResourceExhausted => pb::ErrorCode::ResourceExhausted,
            ErrorCode::Unavailable => pb::ErrorCode::Unavailable,
            ErrorCode::FailedPrecondition => pb::ErrorCode::FailedPrecondition,
            ErrorCode::Cancelled => pb::ErrorCode::Cancelled,
            ErrorCode::DeadlineExceeded => pb::ErrorCode::DeadlineExceeded,
            ErrorCode::Internal => pb::ErrorCode::Internal,
            ErrorCode::Unauthenticated => pb::ErrorCode::Unauthenticated,
            ErrorCode::PermissionDenied => pb::ErrorCode::PermissionDenied,
        }
    }

    /// The error code of a wire enum value; unspecified and unknown values mean `Internal`.
    pub fn from_pb(code: i32) -> Self {
        match pb::ErrorCode::try_from(code) {
            Ok(pb::ErrorCode::InvalidArgument) => ErrorCode::InvalidArgument,
            Ok(pb::ErrorCode::NotFound) => ErrorCode::NotFound,
            Ok(pb::ErrorCode::ResourceExhausted) => ErrorCode::ResourceExhausted,
            Ok(pb::ErrorCode::Unavailable) => ErrorCode::Unavailable,
            Ok(pb::ErrorCode::FailedPrecondition) => ErrorCode::FailedPrecondition,
            Ok(pb::ErrorCode::Cancelled) => ErrorCode::Cancelled,
            Ok(pb::ErrorCode::DeadlineExceeded) => ErrorCode::DeadlineExceeded,
            Ok(pb::ErrorCode::Unauthenticated) => ErrorCode::Unauthenticated,
            Ok(pb::ErrorCode::PermissionDenied) => ErrorCode::PermissionDenied,
            Ok(pb::ErrorCode::Internal | pb::ErrorCode::Unspecified) | Err(_) => ErrorCode::Internal,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A service error: a closed code and a message. Services return it; the conversions below turn it into a
/// `tonic::Status` or an in-stream `pb::Error`, and back.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ServiceError {
    /// What kind of failure this is.
    pub code: ErrorCode,
    /// Human-readable detail.
    pub message: String,
}

impl ServiceError {
    /// An error with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    /// An `InvalidArgument` error.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }

    /// A `NotFound` error.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// A `ResourceExhausted` error.
    pub fn resource_exhausted(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::ResourceExhausted, message)
    }

    /// An `Unavailable` error.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unavailable, message)
    }

    /// A `FailedPrecondition` error.
    pub fn failed_precondition(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::FailedPrecondition, message)
    }

    /// A `Cancelled` error.
    pub fn cancelled(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Cancelled, message)
    }

    /// A `DeadlineExceeded` error.
    pub fn deadline_exceeded(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::DeadlineExceeded, message)
    }

    /// An `Internal` error.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    /// An `Unauthenticated` error.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unauthenticated, message)
    }

    /// A `PermissionDenied` error.
    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::PermissionDenied, message)
    }
}

impl From<ServiceError> for tonic::Status {
    fn from(err: ServiceError) -> Self {
        tonic::Status::new(err.code.to_grpc(), err.message)
    }
}

impl From<tonic::Status> for ServiceError {
    fn from(status: tonic::Status) -> Self {
        ServiceError::new(ErrorCode::from_grpc(status.code()), status.message())
    }
}

impl From<ServiceError> for pb::Error {
    fn from(err: ServiceError) -> Self {
        pb::Error { code: err.code.to_pb() as i32, message: err.message }
    }
}

impl From<pb::Error> for ServiceError {
    fn from(err: pb::Error) -> Self {
        ServiceError::new(ErrorCode::from_pb(err.code), err.message)
    }
}

impl From<ProtoError> for ServiceError {
    fn from(err: ProtoError) -> Self {
        let code = match &err {
            ProtoError::UnsupportedDtype(_)
            | ProtoError::BadShape { .. }
            | ProtoError::DataLength { .. }
            | ProtoError::ValueCount { .. }
            | ProtoError::TooLarge { .. }
            | ProtoError::Address(_) => ErrorCode::InvalidArgument,
            // A value this side holds does not fit the wire: our fault, not the request's.
            ProtoError::WireValue { .. }
            | ProtoError::Reflection(_)
            | ProtoError::SetParent(_)
            | ProtoError::Tls(_) => ErrorCode::Internal,
        };
        ServiceError::new(code, err.to_string())
    }
}

impl From<ProtoError> for tonic::Status {
    fn from(err: ProtoError) -> Self {
        ServiceError::from(err).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_through_status_and_pb() {
        for code in ErrorCode::ALL {
            let err = ServiceError::new(code, format!("boom {code}"));
            let status = tonic::Status::from(err.clone());
            assert_eq!(status.code(), code.to_grpc());
            assert_eq!(status.message(), err.message);
            assert_eq!(ServiceError::from(status), err);

            let wire = pb::Error::from(err.clone());
            assert_eq!(ServiceError::from(wire), err);
        }
    }

    #[test]
    fn foreign_codes_fold_into_the_closed_set() {
        let cases = [
            (Code::Unknown, ErrorCode::Internal),
            (Code::Unimplemented, ErrorCode::Internal),
            (Code::Aborted, ErrorCode::Unavailable),
            (Code::OutOfRange, ErrorCode::InvalidArgument),
            (Code::AlreadyExists, ErrorCode::FailedPrecondition),
        ];
        for (grpc, expected) in cases {
            assert_eq!(ServiceError::from(tonic::Status::new(grpc, "x")).code, expected);
        }
        assert_eq!(ErrorCode::from_pb(0), ErrorCode::Internal);
        assert_eq!(ErrorCode::from_pb(99), ErrorCode::Internal);
    }

    #[test]
    fn codec_errors_are_invalid_argument() {
        let err = ProtoError::BadShape { shape: vec![1] };
        assert_eq!(tonic::Status::from(err).code(), Code::InvalidArgument);
    }
}
