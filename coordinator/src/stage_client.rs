//! The coordinator's client of the stages: connecting (with a short timeout, TCP_NODELAY, over TLS when the
//! cluster uses it, trace context injected into every request's metadata), opening the
//! long-lived `Forward` stream, and `Release`.

use std::time::Duration;

use strata_proto::pb::stage_client::StageClient;
use strata_proto::{Keepalive, ServiceError, Tls, pb, trace_interceptor};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

/// How long connecting to a stage may take before the request fails with `UNAVAILABLE`.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Micro-batches that may wait in the outgoing half of a `Forward` stream.
const STREAM_BUFFER: usize = 64;

/// A `Stage` client whose requests carry the current span's trace context.
pub type TracedStageClient = StageClient<InterceptedService<Channel, fn(tonic::Request<()>) -> TracedResult>>;
type TracedResult = Result<tonic::Request<()>, tonic::Status>;

/// Connects to the stage at `address` (`host:port`), over TLS with `tls`, pinging it as `keepalive` says.
pub async fn connect(
    address: &str,
    tls: Option<&Tls>,
    keepalive: Keepalive,
) -> Result<TracedStageClient, ServiceError> {
    let unavailable = |e: &dyn std::fmt::Display| ServiceError::unavailable(format!("stage {address}: {e}"));
    let endpoint = strata_proto::endpoint(address, tls)
        .map_err(|e| ServiceError::invalid_argument(format!("bad stage address {address:?}: {e}")))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    let endpoint = keepalive.endpoint(endpoint);
    let channel = tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| unavailable(&"connect timed out"))?
        .map_err(|e| unavailable(&e))?;
    let interceptor: fn(tonic::Request<()>) -> TracedResult = trace_interceptor;
    Ok(StageClient::with_interceptor(channel, interceptor))
}

/// One open `Forward` stream: batches go in through `tx`, responses come back on `rx`.
pub struct ForwardStream {
    /// Outgoing micro-batches.
    pub tx: mpsc::Sender<pb::ForwardRequest>,
    /// Incoming responses.
    pub rx: tonic::Streaming<pb::ForwardResponse>,
}

/// Opens the `Forward` stream on `client`.
pub async fn open_forward(client: &mut TracedStageClient) -> Result<ForwardStream, ServiceError> {
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let response = tokio::time::timeout(CONNECT_TIMEOUT, client.forward(ReceiverStream::new(rx)))
        .await
        .map_err(|_| ServiceError::unavailable("opening the Forward stream timed out"))?
        .map_err(ServiceError::from)?;
    Ok(ForwardStream { tx, rx: response.into_inner() })
}
