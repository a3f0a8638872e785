//! The OpenAI-compatible HTTP API: `/v1/models`, `/v1/completions` and `/v1/chat/completions` (whole responses or
//! server-sent events) through the [`Pipeline`], vLLM's `/tokenize`, `/detokenize` and `/version`, plus `/health`,
//! which runs a one-token generation through every stage (readiness), `/live`, which only says the process answers
//! (liveness), and `/metrics` (Prometheus). With API keys every path but the last three needs one (`crate::auth`).
//! [`serve`] takes a bound listener and a shutdown token, so tests serve on port 0.
//!
//! Requests are validated by [`crate::request::prepare`], the same function the gRPC API uses; every error is
//! answered in OpenAI's shape (`errors`).

pub mod completions;
pub mod errors;
pub mod openai;
pub mod tokenize;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Extension, Json, Router};
use strata_proto::{ServiceError, pb};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use self::completions::Delivery;
use self::errors::ApiError;
use self::openai::{Body, ChatRequest, CompletionRequest, GenerationRequest, ModelCard, ModelList};
use crate::auth::{self, ApiKeys};
use crate::config::DEFAULT_MAX_BODY_BYTES;
use crate::metrics::{self, HttpLabels};
use crate::pipeline::{Pipeline, SeqEvent, SeqRequest};
use crate::request::new_request_id;

/// How long `/health` waits for its one-token generation by default.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// What the HTTP handlers share.
pub struct HttpState {
    pipeline: Arc<Pipeline>,
    created: u64,
    health_timeout: Duration,
    keys: Arc<ApiKeys>,
    max_body_bytes: usize,
}

impl HttpState {
    /// State serving through `pipeline`, with the default `/health` timeout and body limit, and no API keys.
    pub fn new(pipeline: Arc<Pipeline>) -> Self {
        HttpState {
            pipeline,
            created: completions::unix_now(),
            health_timeout: HEALTH_TIMEOUT,
            keys: Arc::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }

    /// Requires the API keys `keys` (see [`crate::auth`]).
    pub fn with_keys(mut self, keys: Arc<ApiKeys>) -> Self {
        self.keys = keys;
        self
    }

    /// Refuses request bodies over `bytes` with 413.
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// Sets how long `/health` waits for its generation.
    pub fn with_health_timeout(mut self, timeout: Duration) -> Self {
        self.health_timeout = timeout;
        self
    }
}

/// The request's id (the client's `x-request-id`, or a fresh one), set by the tracing middleware.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// The API's routes.
pub fn router(state: HttpState) -> Router {
    let state = Arc::new(state);
    Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/completions", post(generate::<CompletionRequest>))
        .route("/v1/chat/completions", post(generate::<ChatRequest>))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/version", get(tokenize::version))
        .route("/health", get(health))
        .route("/metrics", get(render_metrics))
        // Liveness: the process answers. Unlike /health it needs no stage, so a standby coordinator (or one whose
        // stages are down) is not restarted for it.
        .route("/live", get(|| async { Json(serde_json::json!({"status": "alive"})) }))
        .fallback(|req: Request| async move { ApiError::no_route(req.uri().path()) })
        .method_not_allowed_fallback(|| async { ApiError::wrong_method() })
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(middleware::from_fn_with_state(state.clone(), trace_request))
        .with_state(state)
}

/// Serves the API on `listener` until `shutdown` is cancelled (then lets open responses finish); HTTPS when `tls` is
/// given, with no client certificate asked for (see [`crate::tls_listener`]).
pub async fn serve(
    listener: TcpListener,
    state: HttpState,
    tls: Option<strata_proto::Tls>,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    let addr = listener.local_addr().map_err(|e| ServiceError::internal(e.to_string()))?;
    tracing::info!(%addr, tls = tls.is_some(), "HTTP API serving");
    let served = match &tls {
        Some(tls) => {
            let listener = crate::tls_listener::TlsListener::new(listener, tls.https_server_config())
                .map_err(|e| ServiceError::internal(e.to_string()))?;
            axum::serve(listener, router(state)).with_graceful_shutdown(shutdown.cancelled_owned()).await
        }
        None => {
            // Token chunks are small writes; Nagle would hold them back.
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                }
            });
            axum::serve(listener, router(state)).with_graceful_shutdown(shutdown.cancelled_owned()).await
        }
    };
    served.map_err(|e| ServiceError::internal(format!("HTTP API: {e}")))
}

/// One span per request (method, path, request id, the caller's trace context); logs and counts the status.
async fn trace_request(State(state): State<Arc<HttpState>>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(new_request_id, str::to_owned);
    let span = tracing::info_span!("http", method = %req.method(), path = %req.uri().path(), request_id = %id);
    let metadata = tonic::metadata::MetadataMap::from_headers(req.headers().clone());
    let _ = strata_proto::set_parent_from_metadata(&span, &metadata);
    req.extensions_mut().insert(RequestId(id.clone()));
    // The matched route, not the raw path: unknown paths must not grow the label set.
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| "other".to_owned(), |p| p.as_str().to_owned());
    let started = Instant::now();
    let mut response = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| {
        tracing::info!(status = response.status().as_u16(), ms = started.elapsed().as_millis() as u64, "answered")
    });
    let labels = HttpLabels { route, status: response.status().as_u16() };
    state.pipeline.metrics().http_responses.get_or_create(&labels).inc();
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID.clone(), v);
    }
    response
}

/// Refuses requests the API keys do not allow (inside the tracing span, so refusals are logged and counted).
async fn authorize(State(state): State<Arc<HttpState>>, req: Request, next: Next) -> Response {
    // The HTTP API asks for no client certificate, so only keys count here.
    match state.keys.check(req.headers(), &[], auth::http_access(req.uri().path())) {
        Ok(()) => next.run(req).await,
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// `GET /metrics`: Prometheus / OpenMetrics text.
async fn render_metrics(State(state): State<Arc<HttpState>>) -> Response {
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], state.pipeline.metrics().render()).into_response()
}

fn model_card(state: &HttpState) -> ModelCard {
    ModelCard { id: state.pipeline.model().name.clone(), object: "model", created: state.created, owned_by: "strata" }
}

async fn list_models(State(state): State<Arc<HttpState>>) -> Json<ModelList> {
    Json(ModelList { object: "list", data: vec![model_card(&state)] })
}

async fn get_model(State(state): State<Arc<HttpState>>, Path(id): Path<String>) -> Result<Json<ModelCard>, ApiError> {
    tokenize::check_model(&state, Some(id))?;
    Ok(Json(model_card(&state)))
}

/// `POST /v1/completions` and `POST /v1/chat/completions`.
async fn generate<T: GenerationRequest>(
    State(state): State<Arc<HttpState>>,
    Extension(RequestId(id)): Extension<RequestId>,
    body: Body<T>,
) -> Result<Response, ApiError> {
    let (stream, include_usage) = body.common.streaming();
    let params = body.fields.params(&body.common)?;
    completions::respond(&state, T::ENDPOINT, &id, params, Delivery { stream, include_usage }).await
}

/// `GET /health`: 200 once a one-token greedy generation went through every stage within the timeout (or the
/// request queue is full: busy, not broken), else 503 with the error.
async fn health(State(state): State<Arc<HttpState>>) -> Response {
    let started = Instant::now();
    let result = match tokio::time::timeout(state.health_timeout, probe(&state.pipeline)).await {
        Ok(r) => r,
        Err(_) => Err(ServiceError::deadline_exceeded(format!(
            "no token through the pipeline within {:?}",
            state.health_timeout
        ))),
    };
    let model = &state.pipeline.model().name;
    let ms = started.elapsed().as_millis() as u64;
    match result {
        Ok(()) => Json(serde_json::json!({"status": "ok", "model": model, "latency_ms": ms})).into_response(),
        // A full queue means the stages are up and busy: shedding the pod from its Service would only move the
        // load, so a readiness probe must not flap on it.
        Err(e) if e.code == strata_proto::ErrorCode::ResourceExhausted => {
            Json(serde_json::json!({"status": "busy", "model": model, "latency_ms": ms})).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "health check failed");
            let body = errors::from_service(&e).to_json();
            let body =
                serde_json::json!({"status": "unavailable", "model": model, "latency_ms": ms, "error": body["error"]});
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
    }
}

/// One greedy token from a one-token prompt, through every stage. Dropping it (timeout) cancels the sequence.
async fn probe(pipeline: &Pipeline) -> Result<(), ServiceError> {
    let req = SeqRequest {
        prompt_ids: vec![0],
        max_tokens: 1,
        sampling: pb::SamplingParams::default(),
        stop: Vec::new(),
        logprobs: false,
        ignore_eos: false,
    };
    let mut events = pipeline.submit(req).await?;
    loop {
        match events.recv().await {
            Some(SeqEvent::Token { .. }) => {}
            Some(SeqEvent::Done { .. }) => return Ok(()),
            Some(SeqEvent::Failed { error, .. }) => return Err(error),
            None => return Err(ServiceError::internal("the pipeline dropped the health check")),
        }
    }
}
