//! The public `Coordinator` gRPC service (plus health and reflection): `Generate` through the [`Pipeline`],
//! `ClusterStatus` from the [`ClusterView`], and the node administration calls through a [`NodeAdmin`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use strata_engine::tokenizer::ChatMessage;
use strata_proto::pb::coordinator_server::{Coordinator as CoordinatorRpc, CoordinatorServer};
use strata_proto::{
    COORDINATOR_SERVICE, NodeId, ServiceError, Tls, health_service, pb, reflection_services, set_serving,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::{ApiKeys, GrpcAuthLayer};
use crate::coordinator::{ClusterView, cordon_node, drain_node, uncordon_node};
use crate::pipeline::{Pipeline, SeqEvent, SeqRequest};
use crate::request::{self, GenerateParams, Prompt};
use crate::{Error, Result};
use strata_membership::{NodeRecord, Registry};

/// A boxed future returned by [`NodeAdmin`].
pub type AdminFuture<'a> = Pin<Box<dyn Future<Output = Result<NodeRecord>> + Send + 'a>>;

/// The administrative node operations, object-safe so the API does not depend on the registry type.
pub trait NodeAdmin: Send + Sync {
    /// Marks the node DRAINING.
    fn drain<'a>(&'a self, id: &'a NodeId) -> AdminFuture<'a>;
    /// Marks the node CORDONED.
    fn cordon<'a>(&'a self, id: &'a NodeId) -> AdminFuture<'a>;
    /// Makes the node READY again.
    fn uncordon<'a>(&'a self, id: &'a NodeId) -> AdminFuture<'a>;
}

impl<R: Registry> NodeAdmin for R {
    fn drain<'a>(&'a self, id: &'a NodeId) -> AdminFuture<'a> {
        Box::pin(drain_node(self, id))
    }
    fn cordon<'a>(&'a self, id: &'a NodeId) -> AdminFuture<'a> {
        Box::pin(cordon_node(self, id))
    }
    fn uncordon<'a>(&'a self, id: &'a NodeId) -> AdminFuture<'a> {
        Box::pin(uncordon_node(self, id))
    }
}

/// The one place where the coordinator's errors (membership's included) become service errors (and so gRPC
/// statuses).
pub fn service_error(err: &Error) -> ServiceError {
    use strata_membership::Error as M;
    let message = err.to_string();
    match err {
        // An unknown model is NOT_FOUND, as the HTTP API's 404.
        Error::Membership(M::NodeNotFound(_)) | Error::UnknownModel { .. } => ServiceError::not_found(message),
        Error::Config(_)
        | Error::Model(_)
        | Error::InvalidRequest { .. }
        | Error::Membership(
            M::NoEndpoints
            | M::InvalidEndpoint(_)
            | M::InvalidClusterName(_)
            | M::EtcdTls(_)
            | M::EtcdCredentials(_)
            | M::EtcdFlagsWithoutEndpoints,
        ) => ServiceError::invalid_argument(message),
        Error::Membership(M::StaleEpoch { .. } | M::EpochNotNext { .. }) | Error::Placement(_) => {
            ServiceError::failed_precondition(message)
        }
        Error::Membership(
            M::EtcdUnreachable { .. }
            | M::EtcdRefused { .. }
            | M::Etcd { .. }
            | M::LeaseExpired(_)
            | M::Contention { .. }
            | M::Deposed { .. },
        ) => ServiceError::unavailable(message),
        Error::Unauthenticated(_) => ServiceError::unauthenticated(message),
        Error::PermissionDenied(_) => ServiceError::permission_denied(message),
        Error::Membership(M::Decode { .. } | M::Encode { .. } | M::Compacted { .. })
        | Error::Bind { .. }
        | Error::Tls(_)
        | Error::Wire(_)
        | Error::Thread(_) => ServiceError::internal(message),
    }
}

/// The `Coordinator` service.
pub struct CoordinatorApi {
    pipeline: Arc<Pipeline>,
    view: ClusterView,
    admin: Option<Arc<dyn NodeAdmin>>,
    keys: Arc<ApiKeys>,
}

impl CoordinatorApi {
    /// A service generating through `pipeline`, reporting `view`; without `admin` (a static plan) the node calls
    /// answer `FAILED_PRECONDITION`. No API keys: see [`CoordinatorApi::with_keys`].
    pub fn new(pipeline: Arc<Pipeline>, view: ClusterView, admin: Option<Arc<dyn NodeAdmin>>) -> Self {
        Self { pipeline, view, admin, keys: Arc::default() }
    }

    /// Requires the API keys `keys` of every call [`serve`] serves (see [`crate::auth`]).
    pub fn with_keys(mut self, keys: Arc<ApiKeys>) -> Self {
        self.keys = keys;
        self
    }

    /// Turns a wire request into a validated token-space request.
    fn prepare(&self, req: pb::GenerateRequest) -> Result<SeqRequest, ServiceError> {
        let prompt = match req.prompt {
            None => Prompt::Ids(Vec::new()),
            Some(pb::generate_request::Prompt::Ids(ids)) => Prompt::Ids(ids.ids),
            Some(pb::generate_request::Prompt::Text(text)) if req.chat => {
                Prompt::Chat(vec![ChatMessage { role: "user".into(), content: text }])
            }
            Some(pb::generate_request::Prompt::Text(text)) => Prompt::Text(text),
        };
        let params = GenerateParams {
            model: Some(req.model).filter(|m| !m.is_empty()),
            prompt,
            max_tokens: (req.max_tokens != 0).then_some(req.max_tokens as usize),
            sampling: req.sampling.unwrap_or_default(),
            stop: req.stop,
            logprobs: req.logprobs,
            ignore_eos: req.ignore_eos,
        };
        request::prepare(self.pipeline.model(), params).map_err(|e| service_error(&e))
    }

    async fn admin_call(
        &self,
        request: Request<pb::NodeRequest>,
        op: for<'a> fn(&'a dyn NodeAdmin, &'a NodeId) -> AdminFuture<'a>,
    ) -> Result<Response<pb::NodeResponse>, Status> {
        let admin = self.admin.as_ref().ok_or_else(|| {
            ServiceError::failed_precondition("this coordinator serves a static plan without a registry")
        })?;
        let id = NodeId::new(request.into_inner().node_id);
        let record = op(admin.as_ref(), &id).await.map_err(|e| service_error(&e))?;
        let epoch = self.view.snapshot().plan.map_or(0, |p| p.epoch.0);
        Ok(Response::new(pb::NodeResponse { state: pb::NodeState::from(record.state) as i32, plan_epoch: epoch }))
    }
}

type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;

#[tonic::async_trait]
impl CoordinatorRpc for CoordinatorApi {
    type GenerateStream = GenerateStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let span = tracing::info_span!("generate", request_id = tracing::field::Empty);
        let _ = strata_proto::set_parent_from_metadata(&span, request.metadata());
        let req = request.into_inner();
        let request_id = if req.request_id.is_empty() {
            format!("req-{}", request::new_request_id())
        } else {
            req.request_id.clone()
        };
        span.record("request_id", request_id.as_str());
        let seq = span.in_scope(|| self.prepare(req))?;
        let prompt_ids = seq.prompt_ids.clone();
        // Instrumented, not entered: `submit` reads the current span when first polled, after a guard would be gone.
        let events = self.pipeline.submit(seq).instrument(span).await?;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(forward_events(prompt_ids, events, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn cluster_status(
        &self,
        _request: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        let mut status = self.view.snapshot().to_proto();
        fill_stage_facts(&mut status.nodes, self.pipeline.stage_tls()).await;
        Ok(Response::new(status))
    }

    async fn drain_node(&self, request: Request<pb::NodeRequest>) -> Result<Response<pb::NodeResponse>, Status> {
        self.admin_call(request, |a, id| a.drain(id)).await
    }

    async fn cordon_node(&self, request: Request<pb::NodeRequest>) -> Result<Response<pb::NodeResponse>, Status> {
        self.admin_call(request, |a, id| a.cordon(id)).await
    }

    async fn uncordon_node(&self, request: Request<pb::NodeRequest>) -> Result<Response<pb::NodeResponse>, Status> {
        self.admin_call(request, |a, id| a.uncordon(id)).await
    }
}

/// Turns pipeline events into the `Generate` stream; stops (cancelling the sequence) when the client goes away.
async fn forward_events(
    prompt_ids: Vec<u32>,
    mut events: mpsc::Receiver<SeqEvent>,
    tx: mpsc::Sender<Result<pb::GenerateResponse, Status>>,
) {
    let prompt_tokens = u32::try_from(prompt_ids.len()).unwrap_or(u32::MAX);
    let usage = |completion: usize| pb::Usage {
        prompt_tokens,
        completion_tokens: u32::try_from(completion).unwrap_or(u32::MAX),
        ..Default::default()
    };
    if tx.send(Ok(pb::GenerateResponse { prompt_ids, ..Default::default() })).await.is_err() {
        return;
    }
    loop {
        let event = tokio::select! {
            () = tx.closed() => return,
            e = events.recv() => e,
        };
        let messages = match event {
            Some(SeqEvent::Token { id, logprob, text }) => vec![Ok(pb::GenerateResponse {
                token_ids: vec![id],
                text,
                logprobs: logprob.into_iter().collect(),
                ..Default::default()
            })],
            Some(SeqEvent::Done { finish, text, completion_tokens, timing }) => vec![Ok(pb::GenerateResponse {
                text,
                finish_reason: finish.to_pb() as i32,
                usage: Some(pb::Usage {
                    steps: timing.steps,
                    stage_compute_micros: timing.compute_micros,
                    pipeline_micros: timing.pipeline_micros,
                    stage_queue_micros: timing.queue_micros,
                    stage_handoff_micros: timing.handoff_micros,
                    cached_prompt_tokens: timing.cached_tokens,
                    ..usage(completion_tokens)
                }),
                ..Default::default()
            })],
            Some(SeqEvent::Failed { error, completion_tokens }) => vec![
                Ok(pb::GenerateResponse {
                    finish_reason: pb::FinishReason::Error as i32,
                    usage: Some(usage(completion_tokens)),
                    ..Default::default()
                }),
                Err(Status::from(error)),
            ],
            None => vec![Err(Status::from(ServiceError::internal("the pipeline dropped the sequence")))],
        };
        let last = messages.last().is_some_and(|m| m.as_ref().map_or(true, |r| r.finish_reason != 0));
        for m in messages {
            if tx.send(m).await.is_err() {
                return;
            }
        }
        if last {
            return;
        }
    }
}

/// Serves the `Coordinator` service (with health and reflection) on `listener` until `shutdown` is cancelled; over
/// TLS when `tls` is given (with a CA, callers must present a certificate it signed); calls the API's keys do not
/// allow are refused before any service sees them.
pub async fn serve(
    listener: TcpListener,
    api: CoordinatorApi,
    tls: Option<Tls>,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    let (reporter, health) = health_service();
    set_serving(&reporter, COORDINATOR_SERVICE, true).await;
    let (reflection, reflection_v1alpha) = reflection_services().map_err(|e| ServiceError::internal(e.to_string()))?;
    let addr = listener.local_addr().map_err(|e| ServiceError::internal(e.to_string()))?;
    tracing::info!(%addr, tls = tls.is_some(), "coordinator API serving");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let stopping = reporter.clone();
    let auth = GrpcAuthLayer::new(api.keys.clone());
    strata_proto::tls::server(tls.as_ref())
        .map_err(|e| ServiceError::internal(format!("coordinator API: {e}")))?
        .layer(auth)
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(CoordinatorServer::new(api))
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown.cancelled().await;
            set_serving(&stopping, COORDINATOR_SERVICE, false).await;
        })
        .await
        .map_err(|e| ServiceError::internal(format!("coordinator API: {e}")))
}

/// How long `ClusterStatus` waits for a stage's own status.
const STAGE_STATUS_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// Fills in what only the stages know (KV blocks, offloaded layers), asking them all at once; a stage that does not
/// answer in time keeps zeros.
async fn fill_stage_facts(nodes: &mut [pb::NodeInfo], tls: Option<&strata_proto::Tls>) {
    let mut asks = tokio::task::JoinSet::new();
    for (i, n) in nodes.iter().enumerate() {
        let address = n.address.clone();
        let tls = tls.cloned();
        asks.spawn(async move {
            let ask = async {
                let keepalive = strata_proto::Keepalive::DEFAULT;
                let mut client = crate::stage_client::connect(&address, tls.as_ref(), keepalive).await.ok()?;
                client.status(pb::StageStatusRequest {}).await.ok().map(tonic::Response::into_inner)
            };
            (i, tokio::time::timeout(STAGE_STATUS_TIMEOUT, ask).await.ok().flatten())
        });
    }
    while let Some(joined) = asks.join_next().await {
        if let Ok((i, Some(s))) = joined
            && let Some(node) = nodes.get_mut(i)
        {
            node.kv_total_blocks = s.kv_total_blocks;
            node.kv_free_blocks = s.kv_free_blocks;
            node.kv_capacity_tokens = s.kv_capacity_tokens();
            node.offloaded_layers = s.offloaded_layers;
        }
    }
}
