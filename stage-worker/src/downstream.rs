//! The link to the next stage: one long-lived `Forward` stream, opened on the first batch and reopened
//! after a failure, shared by every upstream stream. Responses are matched to their batch by `batch_id`. HTTP/2
//! keepalive PINGs run on the connection even while it is idle, so a next stage that hangs (stopped, not
//! crashed) closes the stream within the keepalive timeout and its batches fail `UNAVAILABLE`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_proto::pb;
use strata_proto::pb::stage_client::StageClient;
use strata_proto::{Keepalive, ServiceError, Tls, trace_interceptor};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::error::{Error, Result};

/// How long connecting to (or opening a stream on) the next stage may take before batches fail.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a propagated `Release` may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest gRPC message accepted or sent (hidden states of a large prefill batch).
pub const MAX_MESSAGE_BYTES: usize = 512 << 20;
/// Batches queued towards the actor, and requests queued on the stream.
const QUEUE_DEPTH: usize = 64;

/// The answer to one batch sent downstream.
pub type DownstreamReply = Result<pb::ForwardResponse, ServiceError>;

/// Batches waiting for an answer on one stream; `closed` is set (under the same lock) when the stream ends,
/// so no batch can be registered on a stream that will never answer it.
#[derive(Default)]
struct PendingState {
    closed: bool,
    replies: HashMap<u64, oneshot::Sender<DownstreamReply>>,
}

type Pending = Arc<Mutex<PendingState>>;

struct Send {
    batch: pb::ForwardRequest,
    reply: oneshot::Sender<DownstreamReply>,
}

/// Handle to the next stage. Batches go down in the order [`Downstream::send_blocking`] is called.
#[derive(Clone)]
pub struct Downstream {
    address: Arc<str>,
    tx: mpsc::Sender<Send>,
    channel: Channel,
}

impl Downstream {
    /// Starts the link actor for the stage at `uri`, over TLS when `tls` is given (whatever the scheme), with
    /// `keepalive` on its connection; nothing connects until the first batch or release.
    pub fn spawn(uri: &str, tls: Option<&Tls>, keepalive: Keepalive) -> Result<Self> {
        let endpoint = strata_proto::endpoint(uri, tls)
            .map_err(|e| Error::Config(format!("next stage address {uri:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let endpoint = keepalive.endpoint(endpoint);
        let channel = endpoint.connect_lazy();
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let address: Arc<str> = Arc::from(uri);
        tokio::spawn(link_actor(address.clone(), channel.clone(), rx));
        Ok(Downstream { address, tx, channel })
    }

    /// The next stage's address, as given to [`Downstream::spawn`].
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Queues a batch for the next stage, waiting while the link's queue is full, so batches go down in the order
    /// they were computed; the receiver gets the batch's response (or why there is none).
    pub async fn send(&self, batch: pb::ForwardRequest) -> oneshot::Receiver<DownstreamReply> {
        let (reply, rx) = oneshot::channel();
        if let Err(mpsc::error::SendError(Send { reply, .. })) = self.tx.send(Send { batch, reply }).await {
            let _ = reply.send(Err(ServiceError::unavailable("the link to the next stage has stopped")));
        }
        rx
    }

    /// Forwards a release to the next stage.
    pub async fn release(&self, request: pb::ReleaseRequest) -> Result<pb::ReleaseResponse, ServiceError> {
        let mut client = StageClient::with_interceptor(self.channel.clone(), trace_interceptor);
        match tokio::time::timeout(RELEASE_TIMEOUT, client.release(request)).await {
            Ok(Ok(resp)) => Ok(resp.into_inner()),
            Ok(Err(status)) => {
                let err = ServiceError::from(status);
                Err(ServiceError::new(err.code, format!("next stage {}: release: {}", self.address, err.message)))
            }
            Err(_) => Err(ServiceError::unavailable(format!("next stage {}: release timed out", self.address))),
        }
    }
}

/// One open `Forward` stream: where to write batches, and the batches waiting for an answer on it.
struct Link {
    requests: mpsc::Sender<pb::ForwardRequest>,
    pending: Pending,
}

impl Link {
    fn is_open(&self) -> bool {
        !self.requests.is_closed() && !lock(&self.pending).closed
    }
}

async fn link_actor(address: Arc<str>, channel: Channel, mut rx: mpsc::Receiver<Send>) {
    let mut link: Option<Link> = None;
    while let Some(Send { batch, reply }) = rx.recv().await {
        if !link.as_ref().is_some_and(Link::is_open) {
            match open(&address, &channel).await {
                Ok(l) => link = Some(l),
                Err(e) => {
                    tracing::warn!(next = %address, error = %e, "cannot open the stream to the next stage");
                    let _ = reply.send(Err(e));
                    continue;
                }
            }
        }
        let Some(l) = &link else { continue };
        let batch_id = batch.batch_id;
        {
            let mut pending = lock(&l.pending);
            if pending.closed {
                drop(pending);
                let _ = reply
                    .send(Err(ServiceError::unavailable(format!("the stream to the next stage {address} closed"))));
                link = None;
                continue;
            }
            if pending.replies.contains_key(&batch_id) {
                let _ = reply.send(Err(ServiceError::invalid_argument(format!(
                    "batch {batch_id} is already in flight to the next stage"
                ))));
                continue;
            }
            pending.replies.insert(batch_id, reply);
        }
        if l.requests.send(batch).await.is_err() {
            if let Some(reply) = lock(&l.pending).replies.remove(&batch_id) {
                let _ = reply
                    .send(Err(ServiceError::unavailable(format!("the stream to the next stage {address} closed"))));
            }
            link = None;
        }
    }
}

fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, PendingState> {
    // A panic while holding this lock cannot leave the map inconsistent; keep serving.
    pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn open(address: &Arc<str>, channel: &Channel) -> Result<Link, ServiceError> {
    let (requests, rx) = mpsc::channel(QUEUE_DEPTH);
    let mut client = StageClient::with_interceptor(channel.clone(), trace_interceptor)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let opened = tokio::time::timeout(CONNECT_TIMEOUT, client.forward(ReceiverStream::new(rx))).await;
    let mut responses = match opened {
        Ok(Ok(resp)) => resp.into_inner(),
        Ok(Err(status)) => {
            return Err(ServiceError::unavailable(format!(
                "next stage {address} is unreachable: {}",
                status.message()
            )));
        }
        Err(_) => {
            return Err(ServiceError::unavailable(format!(
                "next stage {address} did not answer within {CONNECT_TIMEOUT:?}"
            )));
        }
    };
    tracing::debug!(next = %address, "opened the Forward stream to the next stage");
    let pending: Pending = Arc::default();
    let reader_pending = pending.clone();
    let address = address.clone();
    tokio::spawn(async move {
        let why = loop {
            match responses.message().await {
                Ok(Some(resp)) => match lock(&reader_pending).replies.remove(&resp.batch_id) {
                    Some(reply) => {
                        let _ = reply.send(Ok(resp));
                    }
                    None => {
                        tracing::warn!(batch_id = resp.batch_id, "response for an unknown batch from the next stage")
                    }
                },
                Ok(None) => break ServiceError::unavailable(format!("next stage {address} ended the stream")),
                Err(status) => {
                    break ServiceError::unavailable(format!(
                        "stream to the next stage {address} failed: {}",
                        status.message()
                    ));
                }
            }
        };
        tracing::warn!(next = %address, error = %why, "lost the stream to the next stage");
        let orphans: Vec<_> = {
            let mut pending = lock(&reader_pending);
            pending.closed = true;
            pending.replies.drain().map(|(_, reply)| reply).collect()
        };
        for reply in orphans {
            let _ = reply.send(Err(why.clone()));
        }
    });
    Ok(Link { requests, pending })
}
