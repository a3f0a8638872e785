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

/// One open `Forward` stream: batches go in through `tx`, responses come back on `rx`, and, with more than one
/// stage, the last stage's answers on `answers` (its relayed acknowledgements are dropped here).
pub struct ForwardStream {
    /// Outgoing micro-batches.
    pub tx: mpsc::Sender<pb::ForwardRequest>,
    /// Incoming responses.
    pub rx: tonic::Streaming<pb::ForwardResponse>,
    /// The last stage's `Answers` stream, while it is open.
    pub answers: Option<tonic::Streaming<pb::ForwardResponse>>,
}

/// Which way an answer came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Straight from the last stage, on its `Answers` stream.
    Direct,
    /// Back up the `Forward` streams, through every stage before.
    Relayed,
}

impl Via {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Direct => "direct",
            Via::Relayed => "relayed",
        }
    }
}

impl ForwardStream {
    /// The next answer, from either stream, and which it came on; `None` or an error when the `Forward` stream
    /// ends. The `Answers` stream ending is no failure: the last stage relays its answers up the `Forward` streams
    /// again.
    pub async fn next(&mut self) -> Option<Result<(pb::ForwardResponse, Via), tonic::Status>> {
        loop {
            let relayed = match &mut self.answers {
                None => self.rx.message().await,
                Some(answers) => tokio::select! {
                    relayed = self.rx.message() => relayed,
                    direct = answers.message() => match direct {
                        Ok(Some(resp)) => return Some(Ok((resp, Via::Direct))),
                        Ok(None) | Err(_) => {
                            tracing::debug!(ended = ?direct.err(), "the last stage's Answers stream ended; answers come relayed");
                            self.answers = None;
                            continue;
                        }
                    },
                },
            };
            match relayed {
                Ok(Some(resp)) if resp.answered_directly => continue,
                Ok(Some(resp)) => return Some(Ok((resp, Via::Relayed))),
                Ok(None) => return None,
                Err(status) => return Some(Err(status)),
            }
        }
    }
}

/// Opens the `Forward` stream on `client`.
pub async fn open_forward(client: &mut TracedStageClient) -> Result<ForwardStream, ServiceError> {
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let response = tokio::time::timeout(CONNECT_TIMEOUT, client.forward(ReceiverStream::new(rx)))
        .await
        .map_err(|_| ServiceError::unavailable("opening the Forward stream timed out"))?
        .map_err(ServiceError::from)?;
    Ok(ForwardStream { tx, rx: response.into_inner(), answers: None })
}

/// Opens the `Answers` stream of the coordinator of `term` on `client`, the last stage's.
pub async fn open_answers(
    client: &mut TracedStageClient,
    term: u64,
) -> Result<tonic::Streaming<pb::ForwardResponse>, ServiceError> {
    let response = tokio::time::timeout(CONNECT_TIMEOUT, client.answers(pb::AnswersRequest { term }))
        .await
        .map_err(|_| ServiceError::unavailable("opening the Answers stream timed out"))?
        .map_err(ServiceError::from)?;
    Ok(response.into_inner())
}
