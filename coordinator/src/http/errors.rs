//! Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), the one mapping from
//! [`ServiceError`] to an HTTP status, and the reading of JSON bodies that reports malformed ones that way too
//! (axum's `Json` answers 415/422 in plain text).

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use strata_proto::{ErrorCode, ServiceError};

use crate::Error;
use crate::api::service_error;

/// An error response of the HTTP API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The body's `error` object.
    pub body: ErrorBody,
}

/// OpenAI's error object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorBody {
    /// What went wrong, for people.
    pub message: String,
    /// The error class (`invalid_request_error`, `rate_limit_error`, `server_error`).
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `rate_limit_exceeded`, ...).
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: &'a ErrorBody,
}

impl ApiError {
    /// A 400 `invalid_request_error` about `param`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            body: ErrorBody {
                message: message.into(),
                kind: "invalid_request_error",
                param: param.map(str::to_owned),
                code: None,
            },
        }
    }

    /// A 404 for a path the API does not have.
    pub fn no_route(path: &str) -> Self {
        let mut e = Self::invalid(format!("no endpoint {path}"), None);
        e.status = StatusCode::NOT_FOUND;
        e.body.code = Some("unknown_url");
        e
    }

    /// A 405 for a method the path does not take.
    pub fn wrong_method() -> Self {
        let mut e = Self::invalid("this endpoint does not take that method", None);
        e.status = StatusCode::METHOD_NOT_ALLOWED;
        e.body.code = Some("method_not_allowed");
        e
    }

    /// The body as JSON, `{"error": {...}}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(Envelope { error: &self.body }).unwrap_or_default()
    }
}

/// The one place a service error becomes an HTTP status, OpenAI error type and code.
pub fn from_service(err: &ServiceError) -> ApiError {
    let (status, kind, code) = match err.code {
        ErrorCode::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
        // Reachable only from a stage (e.g. a sequence it no longer holds): unknown models are `Error::UnknownModel`.
        ErrorCode::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error", Some("not_found")),
        ErrorCode::ResourceExhausted => {
            (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("rate_limit_exceeded"))
        }
        // A plan switch or a stage going away mid-request: worth retrying, like UNAVAILABLE.
        ErrorCode::Unavailable | ErrorCode::FailedPrecondition | ErrorCode::Cancelled => {
            (StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("service_unavailable"))
        }
        ErrorCode::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "server_error", Some("timeout")),
        ErrorCode::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        ErrorCode::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error", Some("invalid_api_key")),
        ErrorCode::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error", Some("insufficient_permissions")),
    };
    ApiError { status, body: ErrorBody { message: err.message.clone(), kind, param: None, code } }
}

impl From<ServiceError> for ApiError {
    fn from(err: ServiceError) -> Self {
        from_service(&err)
    }
}

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        match err {
            Error::UnknownModel { .. } => ApiError {
                status: StatusCode::NOT_FOUND,
                body: ErrorBody {
                    message: err.to_string(),
                    kind: "invalid_request_error",
                    param: Some("model".into()),
                    code: Some("model_not_found"),
                },
            },
            Error::InvalidRequest { param, message } => ApiError::invalid(message, param),
            other => from_service(&service_error(&other)),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry = self.status == StatusCode::TOO_MANY_REQUESTS || self.status == StatusCode::SERVICE_UNAVAILABLE;
        let mut response = (self.status, Json(Envelope { error: &self.body })).into_response();
        if retry {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Reads a request body as one JSON object. Every rejection (unreadable or oversized body, invalid UTF-8,
/// malformed JSON, not an object) is an OpenAI-shaped error; any content type is read as JSON, since `curl -d`
/// sends `application/x-www-form-urlencoded` by default.
pub async fn read_json<S: Send + Sync>(req: Request, state: &S) -> Result<serde_json::Value, ApiError> {
    let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
        let mut e = ApiError::invalid(rejection.body_text(), None);
        e.status = rejection.status();
        if e.status == StatusCode::PAYLOAD_TOO_LARGE {
            e.body.message = "the request body is larger than this server accepts (--max-body-bytes)".into();
            e.body.code = Some("request_too_large");
        }
        e
    })?;
    parse_json(&bytes)
}

/// Parses a request body that must be one JSON object.
pub fn parse_json(bytes: &[u8]) -> Result<serde_json::Value, ApiError> {
    // Checked up front: serde_json does not validate the strings it skips.
    let text = std::str::from_utf8(bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid UTF-8: {e}"), None))?;
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    Ok(value)
}

/// Reads `T` from a parsed body, naming the field at fault when a value has the wrong type.
pub fn from_json<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path);
        ApiError::invalid(format!("invalid request: {}", e.inner()), param.as_deref())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_service_error_code_has_its_status() {
        let status = |code| from_service(&ServiceError::new(code, "x")).status;
        let expected = [
            (ErrorCode::InvalidArgument, 400),
            (ErrorCode::NotFound, 404),
            (ErrorCode::ResourceExhausted, 429),
            (ErrorCode::Unavailable, 503),
            (ErrorCode::FailedPrecondition, 503),
            (ErrorCode::Cancelled, 503),
            (ErrorCode::DeadlineExceeded, 504),
            (ErrorCode::Internal, 500),
            (ErrorCode::Unauthenticated, 401),
            (ErrorCode::PermissionDenied, 403),
        ];
        assert_eq!(expected.len(), ErrorCode::ALL.len());
        for (code, want) in expected {
            assert_eq!(status(code).as_u16(), want, "{code:?}");
        }
    }

    #[test]
    fn an_unknown_model_is_404_model_not_found() {
        let e = ApiError::from(Error::UnknownModel { requested: "a".into(), served: "b".into() });
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.to_json()["error"]["code"], "model_not_found");
        assert_eq!(e.to_json()["error"]["param"], "model");
    }

    #[derive(Debug, serde::Deserialize)]
    struct Body {
        #[allow(dead_code)] // read by the deserializer only
        max_tokens: Option<u32>,
    }

    fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        from_json(&parse_json(bytes)?)
    }

    #[test]
    fn json_errors_are_400_and_name_the_field() {
        let wrong_type = parse(br#"{"max_tokens": "ten"}"#).expect_err("a string is not a u32");
        assert_eq!(wrong_type.status, StatusCode::BAD_REQUEST);
        assert_eq!(wrong_type.body.param.as_deref(), Some("max_tokens"));
        assert!(parse(br#"{"max_tokens": 1} x"#).is_err(), "trailing garbage");
        assert!(parse(b"{\"max_tokens\": 1, \"x\": \"\xff\"}").is_err(), "invalid UTF-8");
        assert!(parse(b"[]").is_err(), "not an object");
        assert!(parse(br#"{"max_tokens": 1, "unknown": [1]}"#).is_ok(), "unknown fields are ignored");
    }
}
