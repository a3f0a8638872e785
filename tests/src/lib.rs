//! End-to-end test helpers: a test cluster of in-process stage workers on 127.0.0.1 port 0, chained with
//! explicit layer ranges, behind a coordinator serving a static plan on a gRPC and an HTTP port (both port 0),
//! optionally all over TLS; the single-process engine as the reference; a client that collects a whole `Generate`
//! stream; a small HTTP(S) client (`http_client`); grpcurl (`grpcurl`).

pub mod grpcurl;
pub mod http_client;
pub mod netns;
pub mod pki;
pub mod processes;

use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use strata_coordinator::api::{self, CoordinatorApi};
use strata_coordinator::http::{self, HttpState};
use strata_coordinator::{
    ClusterSnapshot, ClusterView, ModelInfo, Pipeline, PipelineOptions, SchedulerLimits, Timeouts,
};
use strata_engine::LayerRange;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::generate::{Engine, GenerateRequest};
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, StageModel};
use strata_engine::sampling::SamplingParams;
use strata_engine::tensor::DType;
use strata_engine::testing::{TinySpec, random_weights, tiny_config, write_hf};
use strata_membership::{Plan, PlanStage};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_proto::pb::stage_client::StageClient;
use strata_proto::{NodeId, PlanEpoch, Tls, TlsFiles, pb};
use strata_stage_worker::{Worker, WorkerConfig};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub use strata_testkit::smollm2;

/// Writes the tiny random model (4 layers, vocab 300, context 256, no tokenizer, no EOS) into a temp dir.
pub fn tiny_model() -> Result<tempfile::TempDir> {
    tiny_model_with_context(256)
}

/// The tiny random model with a `context`-token context (long generations: it never stops before `max_tokens`).
pub fn tiny_model_with_context(context: usize) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    let config = strata_engine::config::ModelConfig { max_position_embeddings: context, ..tiny_config() };
    let spec = TinySpec { config, dtype: DType::F32, seed: 7 };
    write_hf(dir.path(), &spec, &random_weights(&spec))?;
    Ok(dir)
}

/// Worker sizing of a test cluster.
#[derive(Debug, Clone, Copy)]
pub struct StageSizing {
    /// CPU threads per worker (also used by the reference engine, so results are bit-identical).
    pub threads: usize,
    /// KV blocks per worker.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The coordinator's scheduler limits.
    pub limits: SchedulerLimits,
    /// The coordinator's timeouts.
    pub timeouts: Timeouts,
}

impl Default for StageSizing {
    fn default() -> Self {
        StageSizing {
            threads: 1,
            kv_blocks: 64,
            block_size: 4,
            limits: SchedulerLimits::default(),
            timeouts: Timeouts::default(),
        }
    }
}

/// A static plan over `stages` (`address`, layer range), epoch 1.
pub fn static_plan(model: &str, num_layers: usize, stages: &[(String, Range<usize>)]) -> Plan {
    Plan {
        epoch: PlanEpoch(1),
        model: model.to_owned(),
        num_layers: u32::try_from(num_layers).unwrap_or(u32::MAX),
        stages: stages
            .iter()
            .enumerate()
            .map(|(i, (address, r))| PlanStage {
                node_id: NodeId::new(format!("stage-{i}")),
                address: address.clone(),
                layer_start: u32::try_from(r.start).unwrap_or(u32::MAX),
                layer_end: u32::try_from(r.end).unwrap_or(u32::MAX),
            })
            .collect(),
        ..Plan::default()
    }
}

/// Stage workers plus a coordinator (gRPC and HTTP APIs) on 127.0.0.1.
pub struct TestCluster {
    /// The workers, in pipeline order.
    pub workers: Vec<Worker>,
    /// The coordinator gRPC API's address.
    pub addr: SocketAddr,
    /// The coordinator HTTP API's address.
    pub http_addr: SocketAddr,
    /// The coordinator's data path (to switch plans in tests).
    pub pipeline: Arc<Pipeline>,
    /// The TLS every node serves and dials with (and [`TestCluster::client`] presents); `None`: plaintext.
    pub tls: Option<Tls>,
    shutdown: CancellationToken,
    servers: Vec<JoinHandle<Result<(), strata_proto::ServiceError>>>,
}

impl TestCluster {
    /// Starts one worker per window of `bounds` (`[0, 2, 4]` = two stages), last first so each knows its
    /// successor, then the coordinator with the static plan through them.
    pub async fn start(model: &Path, bounds: &[usize], sizing: StageSizing) -> Result<Self> {
        Self::start_with_tls(model, bounds, sizing, None).await
    }

    /// Like [`TestCluster::start`], every worker and the coordinator using `tls` (all the same certificate).
    pub async fn start_with_tls(
        model: &Path,
        bounds: &[usize],
        sizing: StageSizing,
        tls: Option<TlsFiles>,
    ) -> Result<Self> {
        let mut workers = Vec::new();
        let mut next: Option<String> = None;
        for (index, w) in bounds.windows(2).enumerate().rev() {
            let config = WorkerConfig {
                next: next.take(),
                stage_index: Some(u32::try_from(index)?),
                plan_epoch: Some(1),
                threads: sizing.threads,
                kv_blocks: Some(sizing.kv_blocks),
                block_size: sizing.block_size,
                tls: tls.clone(),
                ..WorkerConfig::new(format!("stage-{index}"), model, Some(LayerRange { start: w[0], end: w[1] }))
            };
            let worker = Worker::start(config, "127.0.0.1:0").await?;
            next = Some(worker.local_addr().to_string());
            workers.push(worker);
        }
        workers.reverse();
        let stages: Vec<(String, Range<usize>)> =
            workers.iter().zip(bounds.windows(2)).map(|(wk, w)| (wk.local_addr().to_string(), w[0]..w[1])).collect();
        let tls = tls.map(|files| files.load()).transpose()?;
        let options =
            PipelineOptions { limits: sizing.limits, timeouts: sizing.timeouts, tls, ..PipelineOptions::default() };
        let mut cluster = Self::coordinator_with(model, &stages, options).await?;
        cluster.workers = workers;
        Ok(cluster)
    }

    /// Starts only the coordinator, with a static plan through `stages` (which may not exist).
    pub async fn coordinator(model: &Path, stages: &[(String, Range<usize>)]) -> Result<Self> {
        Self::coordinator_with(model, stages, PipelineOptions::default()).await
    }

    /// Like [`TestCluster::coordinator`], the pipeline run as `options` say (its TLS also serves the APIs).
    pub async fn coordinator_with(
        model: &Path,
        stages: &[(String, Range<usize>)],
        options: PipelineOptions,
    ) -> Result<Self> {
        let tls = options.tls.clone();
        let info = ModelInfo::open(model)?;
        let num_layers = stages.last().map_or(0, |s| s.1.end);
        let plan = static_plan(&info.name, num_layers, stages);
        let shutdown = CancellationToken::new();
        let view = ClusterView::from_snapshot(ClusterSnapshot { plan: Some(plan.clone()), ..Default::default() });
        let pipeline = Arc::new(Pipeline::start_with(info, plan, options, shutdown.clone())?);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let http_listener = TcpListener::bind("127.0.0.1:0").await?;
        let http_addr = http_listener.local_addr()?;
        let service = CoordinatorApi::new(pipeline.clone(), view, None);
        let state = HttpState::new(pipeline.clone());
        let servers = vec![
            tokio::spawn(api::serve(listener, service, tls.clone(), shutdown.clone())),
            tokio::spawn(http::serve(http_listener, state, tls.clone(), shutdown.clone())),
        ];
        Ok(TestCluster { workers: Vec::new(), addr, http_addr, pipeline, tls, shutdown, servers })
    }

    /// A channel to `addr` as this cluster's nodes dial each other (TLS with its certificate when it has one).
    pub async fn channel(&self, addr: SocketAddr) -> Result<Channel> {
        Ok(strata_proto::endpoint(&addr.to_string(), self.tls.as_ref())?.connect().await?)
    }

    /// A client of the coordinator API.
    pub async fn client(&self) -> Result<CoordinatorClient<Channel>> {
        Ok(CoordinatorClient::new(self.channel(self.addr).await?))
    }

    /// `Status` of worker `index`.
    pub async fn stage_status(&self, index: usize) -> Result<pb::StageStatus> {
        let worker = self.workers.get(index).context("no such worker")?;
        let mut client = StageClient::new(self.channel(worker.local_addr()).await?);
        Ok(client.status(pb::StageStatusRequest {}).await?.into_inner())
    }

    /// Runs a greedy `max_tokens` request for every prompt, all at once; returns each one's result.
    pub async fn generate_all(
        &self,
        prompts: &[Vec<u32>],
        max_tokens: u32,
    ) -> Result<Vec<Result<Collected, tonic::Status>>> {
        self.generate_requests(prompts.iter().map(|p| ids_request(p, max_tokens)).collect()).await
    }

    /// Runs every request at once; returns each one's result, in order.
    pub async fn generate_requests(
        &self,
        requests: Vec<pb::GenerateRequest>,
    ) -> Result<Vec<Result<Collected, tonic::Status>>> {
        let client = self.client().await?;
        let tasks: Vec<_> = requests
            .into_iter()
            .map(|req| {
                let mut client = client.clone();
                tokio::spawn(async move { generate(&mut client, req).await })
            })
            .collect();
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await?);
        }
        Ok(out)
    }

    /// Whether every worker's KV cache is entirely free with no batch in flight.
    pub async fn kv_all_free(&self) -> Result<bool> {
        for i in 0..self.workers.len() {
            let s = self.stage_status(i).await?;
            if s.kv_free_blocks != s.kv_total_blocks || s.inflight_batches != 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Stops the coordinator and every worker.
    pub async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        for server in self.servers {
            tokio::time::timeout(Duration::from_secs(10), server).await.context("an API did not stop")???;
        }
        for w in self.workers {
            tokio::time::timeout(Duration::from_secs(10), w.shutdown()).await.context("worker did not stop")??;
        }
        Ok(())
    }
}

/// Greedy single-process generation of every layer: the reference the cluster must match exactly.
pub fn reference(model: &Path, threads: usize, prompt_ids: &[u32], max_tokens: usize) -> Result<Vec<u32>> {
    reference_sampled(model, threads, prompt_ids, max_tokens, SamplingParams::default())
}

/// [`reference()`] with other sampling settings.
pub fn reference_sampled(
    model: &Path,
    threads: usize,
    prompt_ids: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
) -> Result<Vec<u32>> {
    let files = ModelFiles::open(model)?;
    let n = files.config().num_layers;
    let tokenizer = files.tokenizer().ok().map(Arc::new);
    let stage = StageModel::load(&files, 0..n, Arc::new(CpuBackend::new(threads)?), &LoadOptions::default())?;
    let mut engine = Engine::new(stage, tokenizer, 1024)?;
    let req = GenerateRequest { prompt_ids: prompt_ids.to_vec(), max_tokens, sampling, stop: vec![] };
    Ok(engine.generate(&req, |_| {})?.token_ids)
}

/// A whole `Generate` stream.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    /// `prompt_ids` of the first message.
    pub prompt_ids: Vec<u32>,
    /// Every token id.
    pub token_ids: Vec<u32>,
    /// The text deltas joined.
    pub text: String,
    /// The last message's finish reason.
    pub finish_reason: i32,
    /// The last message's usage.
    pub usage: Option<pb::Usage>,
}

/// A greedy token-id request.
pub fn ids_request(ids: &[u32], max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Ids(pb::TokenIds { ids: ids.to_vec() })),
        max_tokens,
        ..Default::default()
    }
}

/// Runs `req` and collects its stream (30 s budget); a non-OK status is returned as the error.
pub async fn generate(
    client: &mut CoordinatorClient<Channel>,
    req: pb::GenerateRequest,
) -> Result<Collected, tonic::Status> {
    let run = async {
        let mut stream = client.generate(req).await?.into_inner();
        let mut out = Collected::default();
        let mut first = true;
        while let Some(msg) = stream.message().await? {
            if first {
                out.prompt_ids = msg.prompt_ids.clone();
                first = false;
            }
            out.token_ids.extend(&msg.token_ids);
            out.text.push_str(&msg.text);
            if msg.finish_reason != 0 {
                out.finish_reason = msg.finish_reason;
                out.usage = msg.usage;
            }
        }
        Ok(out)
    };
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("test budget of 30 s exceeded")))
}

/// Polls `check` every 20 ms until it holds, failing after `within`.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check().await? {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("condition not met within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
