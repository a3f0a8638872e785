//! `strata bench --coordinator URL` / `--local N,..`: serving throughput and latency through a cluster at
//! several concurrency levels: tokens/s, time to first token, inter-token latency (p50/p99), and where each
//! step's time went (stage compute vs transport), per pipeline hop. Writes JSON, a markdown table and an SVG
//! plot of throughput vs concurrency.

mod baseline;
mod overhead;
mod report;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use strata_proto::{TlsArgs, pb};
use tonic::transport::Endpoint;

use strata_coordinator::{CoordinatorConfig, PrefixCaching};
use strata_engine::CpuIsa;
use strata_engine::sampling::SamplingParams;

use self::baseline::{EngineBaseline, EngineRate};
use self::report::{Report, Run, against_one_stage, print_run, write_outputs};
use crate::cluster::LocalCluster;
use crate::connect::{self, Client, Credentials};
use crate::host::Host;

/// What to measure.
pub struct ClusterBench {
    /// A running coordinator, or `None` to start local clusters.
    pub coordinator: Option<String>,
    /// How to dial an `https://` coordinator.
    pub tls: TlsArgs,
    /// The API key sent to a `--coordinator` that requires one (local clusters have none).
    pub credentials: Credentials,
    /// Stage counts of the local clusters to start.
    pub local: Vec<usize>,
    /// The model (needed for local clusters and the single-process baseline).
    pub model: Option<PathBuf>,
    /// Concurrent client streams, one level per run.
    pub concurrency: Vec<usize>,
    /// Requests each client stream sends, one after another.
    pub requests_per_client: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Of those, the first tokens every request shares (a system prompt); a request with them runs first, alone,
    /// so that a cluster with prefix caching has them cached.
    pub shared_prefix_tokens: usize,
    /// Local clusters run once per setting, with the coordinator's prefix caching on or off.
    pub prefix_caching: Vec<bool>,
    /// Local clusters run once per value, with the coordinator keeping this many micro-batches in flight per stage.
    pub micro_batches_per_stage: Vec<usize>,
    /// Passes over the local clusters: each runs once per pass, in turn.
    pub repeat: usize,
    /// Tokens generated per request (EOS is ignored).
    pub max_tokens: usize,
    /// How requests and the engine baseline pick tokens (each request seeded by [`seed`]).
    pub sampling: SamplingParams,
    /// CPU threads of the engine and of every stage of a local cluster (its stages share this machine's cores, and
    /// the cluster keeps only as many micro-batches in flight as can compute at once).
    pub threads: usize,
    /// Instruction set of the CPU kernels (local clusters and the single-process baseline).
    pub cpu_isa: CpuIsa,
    /// JSON report path; the SVG goes beside it.
    pub out: PathBuf,
}

/// One request's measurements.
struct Sample {
    ttft: Duration,
    itl: Vec<Duration>,
    tokens: u64,
    usage: pb::Usage,
}

/// Runs the cluster benchmark.
pub fn run(b: ClusterBench) -> Result<()> {
    if b.concurrency.is_empty() || b.concurrency.contains(&0) {
        bail!("--concurrency needs positive levels");
    }
    if b.repeat == 0 || (b.repeat > 1 && b.coordinator.is_some()) {
        bail!("--repeat takes a positive count, and more than 1 only with --local");
    }
    // A hop's overhead is mostly hand-offs between threads: their cost on this machine goes beside it.
    let loopback = crate::host::loopback_micros()
        .inspect_err(|e| tracing::warn!(error = %e, "cannot measure a loopback message"))
        .ok();
    let host = Host { wake_up_micros: Some(crate::host::wake_up_micros()), loopback, ..Host::detect() };
    eprintln!("host: {}", host.describe());
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let threads_total = strata_engine::backend::cpu::threads_or_cores(b.threads);
    let mut runs = Vec::new();
    let mut baselines = Vec::new();
    let mut plans = Vec::new();
    match &b.coordinator {
        Some(url) => rt.block_on(async {
            let mut client = ready_client(url, &connect::endpoint(url, &b.tls)?, &b.credentials).await?;
            let (stages, plan) = describe_plan(&mut client).await?;
            plans.push(plan);
            for &c in &b.concurrency {
                let run = measure(&client, &b, stages, c, None).await?;
                print_run(Some(&run));
                runs.push(run);
            }
            Ok::<_, anyhow::Error>(())
        })?,
        None => {
            let model = b.model.clone().context("--local needs --model")?;
            if b.local.is_empty() || b.local.contains(&0) {
                bail!("--local needs positive stage counts");
            }
            let max_c = b.concurrency.iter().copied().max().unwrap_or(1);
            // Room for every stream's KV so the run measures serving, not preemption.
            let kv_blocks = (max_c * (b.prompt_tokens + b.max_tokens)).div_ceil(16) + 64;
            // The yardstick for every level: the engine with all the threads, run just before the cluster serves
            // the same level (interleaved, so both see the same machine; it idles while the cluster serves).
            let mut engine =
                EngineBaseline::load(&model, threads_total, b.cpu_isa, max_c, b.prompt_tokens + b.max_tokens)?;
            // Batch-1 latency with a stage's threads (all of them: a local cluster's stages take turns with every
            // core rather than time-slice them, see `LocalCluster`).
            let single = engine.decode_latency(&prompt_ids(0, 0, &b), b.max_tokens, &b.sampling)?;
            baselines.push(single.clone());
            // The engine's first run pays for first touches (its KV cache's pages, its buffers), which made the first
            // cluster's yardstick 15-30 % slower than the later ones': one run of the first level, untimed.
            engine_workload(&mut engine, b.concurrency[0], &b)?;
            let passes = (1..=b.repeat).flat_map(|pass| {
                clusters(&b.local, &b.prefix_caching, &b.micro_batches_per_stage).into_iter().map(move |c| (pass, c))
            });
            for (pass, (stages, caching, micro_batches)) in passes {
                let per_stage = threads_total;
                rt.block_on(async {
                    // Port 0: the cluster binds both APIs itself, so no other process can take a port first.
                    let any = SocketAddr::from(([127, 0, 0, 1], 0));
                    let config = CoordinatorConfig {
                        enable_prefix_caching: if caching { PrefixCaching::On } else { PrefixCaching::Off },
                        micro_batches_per_stage: micro_batches,
                        ..CoordinatorConfig::new(&model, any, any)
                    };
                    let cluster = LocalCluster::start(config, stages, per_stage, kv_blocks, b.cpu_isa).await?;
                    let (grpc, http) = (cluster.grpc, cluster.http);
                    let bench = async {
                        let url = format!("http://{grpc}");
                        let endpoint = strata_proto::endpoint(&url, None)?;
                        let mut client = ready_client(&url, &endpoint, &Credentials::default()).await?;
                        let plan = describe_plan(&mut client).await?.1;
                        plans.push(if b.repeat > 1 { format!("pass {pass}: {plan}") } else { plan });
                        for &c in &b.concurrency {
                            let rate = engine_rate(&mut engine, threads_total, c, &b)?;
                            let mut run = measure(&client, &b, stages, c, Some(http)).await?;
                            run.pass = pass;
                            run.threads_per_stage = per_stage;
                            run.prefix_caching = Some(caching);
                            run.micro_batches_per_stage = Some(micro_batches);
                            run.engine_tokens_per_s = Some(rate.tokens_per_s);
                            run.engine_decode_tokens_per_s = Some(rate.decode_tokens_per_s);
                            run.serving_vs_engine = Some(run.tokens_per_s / rate.tokens_per_s);
                            if c == 1 {
                                let added = (run.itl_ms_p50 - single.itl_ms_p50) * 1e3 / hops(stages) as f64;
                                run.added_us_per_hop_vs_single_process = Some(added);
                                run.added_ms_first_tenth = Some(run.itl_ms_first_tenth - single.itl_ms_first_tenth);
                                run.added_ms_last_tenth = Some(run.itl_ms_last_tenth - single.itl_ms_last_tenth);
                            }
                            print_run(Some(&run));
                            runs.push(run);
                        }
                        Ok::<_, anyhow::Error>(())
                    };
                    // The coordinator's failure (at start, say) ends the run at once, not after the client's wait.
                    cluster.run_while(bench).await
                })?;
            }
        }
    }
    let report = Report {
        host,
        model: b.model.as_ref().map_or_else(|| b.coordinator.clone().unwrap_or_default(), |m| m.display().to_string()),
        prompt_tokens: b.prompt_tokens,
        shared_prefix_tokens: b.shared_prefix_tokens,
        max_tokens: b.max_tokens,
        threads_total,
        cpu_isa: b.coordinator.is_none().then(|| b.cpu_isa.resolve().map(|isa| isa.name().to_owned())).transpose()?,
        temperature: b.sampling.temperature,
        top_p: b.sampling.top_p,
        single_process: baselines,
        plans,
        against_one_stage: against_one_stage(&runs),
        repeat: b.repeat,
        runs,
    };
    write_outputs(&report, &b.out)
}

/// A micro-batch step's hops through `stages` stages: the coordinator to stage 0, one per stage to the next, and
/// the last stage's answer straight back to the coordinator (its `Answers` stream; relayed back through every
/// stage, as before 2026-12-04, a step took two per stage).
fn hops(stages: usize) -> usize {
    stages.max(1) + 1
}

/// The local clusters to start, as (stages, prefix caching, micro-batches per stage): every combination, the
/// settings of one stage count back to back so that their runs see the same machine.
fn clusters(stages: &[usize], caching: &[bool], micro_batches: &[usize]) -> Vec<(usize, bool, usize)> {
    let mut clusters = Vec::new();
    for &s in stages {
        for &c in caching {
            clusters.extend(micro_batches.iter().map(|&m| (s, c, m)));
        }
    }
    clusters
}

/// The engine's rate on the benchmark's workload at `concurrency` streams: the same requests, each round's prompts in
/// one step, then all its sequences decoded together.
fn engine_rate(
    engine: &mut EngineBaseline,
    threads: usize,
    concurrency: usize,
    b: &ClusterBench,
) -> Result<EngineRate> {
    let rate = engine_workload(engine, concurrency, b)?;
    eprintln!(
        "engine in this process, {threads} thread(s), {concurrency} sequences: {:.1} tok/s on the same requests, \
         decode {:.1} tok/s",
        rate.tokens_per_s, rate.decode_tokens_per_s
    );
    Ok(rate)
}

/// The engine's run of the benchmark's requests at `concurrency` streams.
fn engine_workload(engine: &mut EngineBaseline, concurrency: usize, b: &ClusterBench) -> Result<EngineRate> {
    let rounds: Vec<Vec<(u64, Vec<u32>)>> = (0..b.requests_per_client)
        .map(|i| (0..concurrency).map(|client| (seed(client, i), prompt_ids(client, i, b))).collect())
        .collect();
    engine.workload(&rounds, b.max_tokens, &b.sampling)
}

/// The prompt of a client stream's `index`th request: distinct after the shared prefix (ids below 1000 exist in
/// any real vocabulary).
fn prompt_ids(client: usize, index: usize, b: &ClusterBench) -> Vec<u32> {
    let shared = b.shared_prefix_tokens.min(b.prompt_tokens);
    (0..shared)
        .map(|i| ((i * 7919 + 13) % 999 + 1) as u32)
        .chain((shared..b.prompt_tokens).map(|i| ((i * 7919 + client * 104_729 + index * 31 + 17) % 999 + 1) as u32))
        .collect()
}

/// The seed of a client stream's `index`th request, in the cluster and in the engine baseline alike.
fn seed(client: usize, index: usize) -> u64 {
    ((index as u64) << 32) | client as u64
}

fn request(client: usize, index: usize, b: &ClusterBench) -> pb::GenerateRequest {
    let greedy = b.sampling.is_greedy();
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Ids(pb::TokenIds { ids: prompt_ids(client, index, b) })),
        max_tokens: u32::try_from(b.max_tokens).unwrap_or(u32::MAX),
        ignore_eos: true,
        sampling: (!greedy).then(|| pb::SamplingParams {
            temperature: b.sampling.temperature,
            top_p: b.sampling.top_p,
            seed: Some(seed(client, index)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Connects to `endpoint` (the coordinator at `url`) and waits (up to 120 s) until a one-token generation succeeds.
async fn ready_client(url: &str, endpoint: &Endpoint, credentials: &Credentials) -> Result<Client> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let attempt = async {
            let mut client = connect::connect_as(endpoint, credentials).await?;
            let req = pb::GenerateRequest {
                prompt: Some(pb::generate_request::Prompt::Ids(pb::TokenIds { ids: vec![1] })),
                max_tokens: 1,
                ..Default::default()
            };
            let mut stream = client.generate(req).await?.into_inner();
            while stream.message().await?.is_some() {}
            Ok::<_, anyhow::Error>(client)
        };
        let refused = |e: &anyhow::Error| {
            e.downcast_ref::<tonic::Status>()
                .is_some_and(|s| matches!(s.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied))
        };
        match attempt.await {
            Ok(c) => return Ok(c),
            // A missing or wrong API key does not fix itself.
            Err(e) if refused(&e) => return Err(e).context(format!("cluster at {url} refused the --api-key")),
            Err(e) if Instant::now() >= deadline => return Err(e).context(format!("cluster at {url} never served")),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

async fn one_request(mut client: Client, req: pb::GenerateRequest) -> Result<Sample> {
    let start = Instant::now();
    let mut stream = client.generate(req).await?.into_inner();
    let (mut ttft, mut last, mut itl, mut tokens, mut usage) = (None, start, Vec::new(), 0u64, None);
    while let Some(msg) = stream.message().await? {
        if !msg.token_ids.is_empty() {
            let now = Instant::now();
            match ttft {
                None => ttft = Some(now - start),
                Some(_) => itl.push(now - last),
            }
            last = now;
            tokens += msg.token_ids.len() as u64;
        }
        if msg.usage.is_some() {
            usage = msg.usage;
        }
    }
    Ok(Sample { ttft: ttft.context("no token came back")?, itl, tokens, usage: usage.unwrap_or_default() })
}

/// One run of `concurrency` streams; with the coordinator's HTTP API at `metrics`, the median hop too.
async fn measure(
    client: &Client,
    b: &ClusterBench,
    stages: usize,
    concurrency: usize,
    metrics: Option<SocketAddr>,
) -> Result<Run> {
    if b.shared_prefix_tokens > 0 {
        // Not measured: a cache that has seen the shared prefix once, as a serving cluster's has.
        one_request(client.clone(), request(concurrency, 0, b)).await?;
    }
    let overhead_before = match metrics {
        Some(http) => Some(overhead::scrape(http).await?),
        None => None,
    };
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|c| {
            let client = client.clone();
            let reqs: Vec<_> = (0..b.requests_per_client).map(|i| request(c, i, b)).collect();
            tokio::spawn(async move {
                let mut out = Vec::with_capacity(reqs.len());
                for req in reqs {
                    out.push(one_request(client.clone(), req).await?);
                }
                Ok::<_, anyhow::Error>(out)
            })
        })
        .collect();
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.context("bench client task")??);
    }
    let seconds = start.elapsed().as_secs_f64();
    let overhead_median = match (metrics, overhead_before) {
        (Some(http), Some(before)) => overhead::scrape(http).await?.since(&before).median(),
        _ => None,
    };
    let tokens: u64 = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.itl.iter().map(|d| d.as_secs_f64() * 1e3)).collect();
    let steps: u64 = samples.iter().map(|s| u64::from(s.usage.steps)).sum();
    let overhead: u64 =
        samples.iter().map(|s| s.usage.pipeline_micros.saturating_sub(s.usage.stage_compute_micros)).sum();
    let compute: u64 = samples.iter().map(|s| s.usage.stage_compute_micros).sum();
    let queue: u64 = samples.iter().map(|s| s.usage.stage_queue_micros).sum();
    let handoff: u64 = samples.iter().map(|s| s.usage.stage_handoff_micros).sum();
    let cached: u64 = samples.iter().map(|s| u64::from(s.usage.cached_prompt_tokens)).sum();
    let per_step = |micros: u64| if steps == 0 { 0.0 } else { micros as f64 / steps as f64 };
    let overhead_us_per_step = per_step(overhead);
    let (stages_f, hops_per_step) = (stages.max(1) as f64, hops(stages));
    let hops = hops_per_step as f64;
    Ok(Run {
        pass: 1,
        stages,
        concurrency,
        requests: samples.len(),
        completion_tokens: tokens,
        seconds,
        tokens_per_s: tokens as f64 / seconds,
        ttft_ms_p50: percentile(&mut ttft, 0.50),
        ttft_ms_p99: percentile(&mut ttft, 0.99),
        cached_prompt_tokens_per_request: cached as f64 / samples.len().max(1) as f64,
        itl_ms_p50: percentile(&mut itl, 0.50),
        itl_ms_p99: percentile(&mut itl, 0.99),
        itl_ms_first_tenth: tenth_ms(&samples, Tenth::First),
        itl_ms_last_tenth: tenth_ms(&samples, Tenth::Last),
        overhead_us_per_step,
        overhead_us_per_hop: overhead_us_per_step / hops,
        overhead_us_per_hop_p50: overhead_median.map(|s| s * 1e6 / hops),
        hops_per_step,
        queue_us_per_stage: per_step(queue) / stages_f,
        handoff_us_per_stage: per_step(handoff) / stages_f,
        wire_us_per_hop: (overhead_us_per_step - per_step(queue) - per_step(handoff)) / hops,
        compute_ms_per_step: per_step(compute) / 1e3,
        ..Run::default()
    })
}

/// Which end of a request's tokens.
#[derive(Clone, Copy)]
enum Tenth {
    First,
    Last,
}

/// The median over `samples` of the mean inter-token latency over the `which` tenth of a request's tokens (ms);
/// requests with fewer than 10 gaps are left out, and 0 when none is left.
fn tenth_ms(samples: &[Sample], which: Tenth) -> f64 {
    let mut means: Vec<f64> = samples
        .iter()
        .filter_map(|s| tenth_mean(&s.itl.iter().map(|d| d.as_secs_f64() * 1e3).collect::<Vec<_>>(), which))
        .collect();
    percentile(&mut means, 0.5)
}

/// The mean of the `which` tenth of `gaps`; `None` for fewer than 10.
fn tenth_mean(gaps: &[f64], which: Tenth) -> Option<f64> {
    let n = gaps.len() / 10;
    if n == 0 {
        return None;
    }
    let part = match which {
        Tenth::First => &gaps[..n],
        Tenth::Last => &gaps[gaps.len() - n..],
    };
    Some(part.iter().sum::<f64>() / n as f64)
}

/// [`crate::stats::percentile`], 0 for no samples (the report's columns are numbers).
fn percentile(v: &mut [f64], q: f64) -> f64 {
    crate::stats::percentile(v, q).unwrap_or(0.0)
}

/// The number of stages served and the plan as `node layers a..b (x ms/layer)` per stage, printed and kept in the
/// report: how layers were split explains much of a multi-stage result.
async fn describe_plan(client: &mut Client) -> Result<(usize, String)> {
    let s = client.cluster_status(pb::ClusterStatusRequest {}).await?.into_inner();
    let mut nodes: Vec<_> = s.nodes.iter().filter(|n| n.layer_end > n.layer_start).collect();
    nodes.sort_by_key(|n| n.layer_start);
    let stages: Vec<String> = nodes
        .iter()
        .map(|n| {
            format!("{} layers {}..{} ({:.2} ms/layer)", n.node_id, n.layer_start, n.layer_end, n.layer_seconds * 1e3)
        })
        .collect();
    let line = format!("{} stage(s): {}", nodes.len(), stages.join(", "));
    eprintln!("plan: {line}");
    Ok((s.stages.len(), line))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenths_compare_the_start_and_the_end_of_each_request() {
        let ms = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect::<Vec<_>>();
        let sample = |itl: Vec<Duration>| Sample { ttft: Duration::ZERO, itl, tokens: 0, usage: pb::Usage::default() };
        // 20 gaps: the first two average 1 ms, the last two 5 ms.
        let mut gaps = vec![1u64, 1];
        gaps.extend([3; 16]);
        gaps.extend([4, 6]);
        let samples = [sample(ms(&gaps)), sample(ms(&[9; 5]))];
        assert!((tenth_ms(&samples, Tenth::First) - 1.0).abs() < 1e-9);
        assert!((tenth_ms(&samples, Tenth::Last) - 5.0).abs() < 1e-9);
        assert_eq!(tenth_ms(&samples[1..], Tenth::First), 0.0);
    }

    #[test]
    fn every_stage_count_runs_each_setting_back_to_back() {
        assert_eq!(clusters(&[1, 2], &[true], &[1, 2]), [(1, true, 1), (1, true, 2), (2, true, 1), (2, true, 2)]);
        assert_eq!(clusters(&[3], &[false, true], &[1]), [(3, false, 1), (3, true, 1)]);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), 50.0);
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(percentile(&mut [3.0], 0.99), 3.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}
