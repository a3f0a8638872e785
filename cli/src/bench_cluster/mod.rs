//! `strata bench --coordinator URL` / `--local N,..`: serving throughput and latency through a cluster at
//! several concurrency levels: tokens/s, time to first token, inter-token latency (p50/p99), and where each
//! step's time went (stage compute vs transport), per pipeline hop. Writes JSON, a markdown table and an SVG
//! plot of throughput vs concurrency.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use strata_proto::{TlsArgs, pb};
use tonic::transport::Endpoint;

use strata_coordinator::{CoordinatorConfig, PrefixCaching};

use crate::cluster::LocalCluster;
use crate::connect::{self, Client, Credentials};

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
    /// Tokens generated per request (EOS is ignored).
    pub max_tokens: usize,
    /// CPU threads in total, split evenly over a local cluster's stages.
    pub threads: usize,
    /// JSON report path; the SVG goes beside it.
    pub out: PathBuf,
}

#[derive(Serialize, Default, Clone)]
struct Run {
    stages: usize,
    /// Whether the local cluster's coordinator cached prompt prefixes (`None`: a `--coordinator`, as it is set).
    prefix_caching: Option<bool>,
    threads_per_stage: usize,
    concurrency: usize,
    requests: usize,
    completion_tokens: u64,
    seconds: f64,
    tokens_per_s: f64,
    ttft_ms_p50: f64,
    ttft_ms_p99: f64,
    itl_ms_p50: f64,
    itl_ms_p99: f64,
    /// Mean inter-token latency over the first and the last tenth of each request's tokens (median over requests),
    /// in ms: the scheduler's per-token work must not grow with the output (equal within noise for long outputs).
    itl_ms_first_tenth: f64,
    itl_ms_last_tenth: f64,
    /// Stage compute (all stages) per micro-batch step, in ms.
    compute_ms_per_step: f64,
    /// Pipeline time minus stage compute, per micro-batch step, in µs.
    overhead_us_per_step: f64,
    /// The same divided by the step's hops (2 per stage: down the pipeline and back).
    overhead_us_per_hop: f64,
    /// (Cluster ITL p50 - single-process decode p50) / hops, for concurrency 1 of a local cluster.
    added_us_per_hop_vs_single_process: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    model: String,
    prompt_tokens: usize,
    shared_prefix_tokens: usize,
    max_tokens: usize,
    threads_total: usize,
    /// Single-process batch-1 decode latency per token (p50, ms) by thread count.
    single_process_itl_ms_p50: Vec<(usize, f64)>,
    /// Each cluster's layer split and the speed its nodes measured at registration, one line per cluster.
    plans: Vec<String>,
    runs: Vec<Run>,
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
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let threads_total =
        if b.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { b.threads };
    let mut runs = Vec::new();
    let mut baselines = Vec::new();
    let mut plans = Vec::new();
    match &b.coordinator {
        Some(url) => rt.block_on(async {
            let mut client = ready_client(url, &connect::endpoint(url, &b.tls)?, &b.credentials).await?;
            let (stages, plan) = describe_plan(&mut client).await?;
            plans.push(plan);
            for &c in &b.concurrency {
                let run = measure(&client, &b, stages, c).await?;
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
            for (&stages, &caching) in b.local.iter().flat_map(|s| b.prefix_caching.iter().map(move |c| (s, c))) {
                let per_stage = (threads_total / stages).max(1);
                let single = match baselines.iter().find(|(t, _)| *t == per_stage) {
                    Some((_, ms)) => *ms,
                    None => {
                        let ms = single_process_itl_ms(&model, per_stage, b.prompt_tokens, b.max_tokens)?;
                        baselines.push((per_stage, ms));
                        ms
                    }
                };
                rt.block_on(async {
                    let grpc = free_addr()?;
                    let http = free_addr()?;
                    let config = CoordinatorConfig {
                        enable_prefix_caching: if caching { PrefixCaching::On } else { PrefixCaching::Off },
                        ..CoordinatorConfig::new(&model, grpc, http)
                    };
                    let cluster = LocalCluster::start(config, stages, per_stage, kv_blocks, None).await?;
                    let bench = async {
                        let url = format!("http://{grpc}");
                        let endpoint = strata_proto::endpoint(&url, None)?;
                        let mut client = ready_client(&url, &endpoint, &Credentials::default()).await?;
                        plans.push(describe_plan(&mut client).await?.1);
                        for &c in &b.concurrency {
                            let mut run = measure(&client, &b, stages, c).await?;
                            run.threads_per_stage = per_stage;
                            run.prefix_caching = Some(caching);
                            if c == 1 {
                                let added = (run.itl_ms_p50 - single) * 1e3 / (2 * stages) as f64;
                                run.added_us_per_hop_vs_single_process = Some(added);
                            }
                            print_run(Some(&run));
                            runs.push(run);
                        }
                        Ok::<_, anyhow::Error>(())
                    };
                    let result = bench.await;
                    cluster.run_until(std::future::ready(())).await?;
                    result
                })?;
            }
        }
    }
    let report = Report {
        model: b.model.as_ref().map_or_else(|| b.coordinator.clone().unwrap_or_default(), |m| m.display().to_string()),
        prompt_tokens: b.prompt_tokens,
        shared_prefix_tokens: b.shared_prefix_tokens,
        max_tokens: b.max_tokens,
        threads_total,
        single_process_itl_ms_p50: baselines,
        plans,
        runs,
    };
    write_outputs(&report, &b.out)
}

fn free_addr() -> Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn request(client: usize, index: usize, b: &ClusterBench) -> pb::GenerateRequest {
    // Distinct prompts per request after the shared prefix (ids below 1000 exist in any real vocabulary).
    let shared = b.shared_prefix_tokens.min(b.prompt_tokens);
    let ids = (0..shared)
        .map(|i| ((i * 7919 + 13) % 999 + 1) as u32)
        .chain((shared..b.prompt_tokens).map(|i| ((i * 7919 + client * 104_729 + index * 31 + 17) % 999 + 1) as u32))
        .collect();
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Ids(pb::TokenIds { ids })),
        max_tokens: u32::try_from(b.max_tokens).unwrap_or(u32::MAX),
        ignore_eos: true,
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

async fn measure(client: &Client, b: &ClusterBench, stages: usize, concurrency: usize) -> Result<Run> {
    if b.shared_prefix_tokens > 0 {
        // Not measured: a cache that has seen the shared prefix once, as a serving cluster's has.
        one_request(client.clone(), request(concurrency, 0, b)).await?;
    }
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
    let tokens: u64 = samples.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.itl.iter().map(|d| d.as_secs_f64() * 1e3)).collect();
    let steps: u64 = samples.iter().map(|s| u64::from(s.usage.steps)).sum();
    let overhead: u64 =
        samples.iter().map(|s| s.usage.pipeline_micros.saturating_sub(s.usage.stage_compute_micros)).sum();
    let compute: u64 = samples.iter().map(|s| s.usage.stage_compute_micros).sum();
    let overhead_us_per_step = if steps == 0 { 0.0 } else { overhead as f64 / steps as f64 };
    Ok(Run {
        stages,
        concurrency,
        requests: samples.len(),
        completion_tokens: tokens,
        seconds,
        tokens_per_s: tokens as f64 / seconds,
        ttft_ms_p50: percentile(&mut ttft, 0.50),
        ttft_ms_p99: percentile(&mut ttft, 0.99),
        itl_ms_p50: percentile(&mut itl, 0.50),
        itl_ms_p99: percentile(&mut itl, 0.99),
        itl_ms_first_tenth: tenth_ms(&samples, Tenth::First),
        itl_ms_last_tenth: tenth_ms(&samples, Tenth::Last),
        overhead_us_per_step,
        overhead_us_per_hop: overhead_us_per_step / (2 * stages.max(1)) as f64,
        compute_ms_per_step: if steps == 0 { 0.0 } else { compute as f64 / steps as f64 / 1e3 },
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
        .filter(|s| s.itl.len() >= 10)
        .map(|s| {
            let n = s.itl.len() / 10;
            let part = match which {
                Tenth::First => &s.itl[..n],
                Tenth::Last => &s.itl[s.itl.len() - n..],
            };
            part.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e3 / n as f64
        })
        .collect();
    percentile(&mut means, 0.5)
}

/// Nearest-rank percentile (`q` in 0..=1); 0 for no samples.
fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Batch-1 decode latency per token (p50, ms) of the whole model in this process.
fn single_process_itl_ms(model: &Path, threads: usize, prompt_tokens: usize, max_tokens: usize) -> Result<f64> {
    use strata_engine::generate::Engine;
    use strata_engine::model::SeqChunk;
    use strata_engine::sampling::argmax;
    let backend = std::sync::Arc::new(strata_engine::backend::cpu::CpuBackend::new(threads)?);
    let device = crate::load::DeviceArgs {
        device: strata_engine::Device::Cpu,
        dtype: None,
        quantize: None,
        threads,
        kv_dtype: None,
    };
    let loaded = crate::load::load(model, &device, backend, false)?;
    let vocab = loaded.model.config().vocab_size;
    let mut engine = Engine::new(loaded.model, None, prompt_tokens + max_tokens + 1)?;
    let prompt: Vec<u32> = (0..prompt_tokens).map(|i| ((i * 7919 + 13) % 999 + 1) as u32 % vocab as u32).collect();
    let logits = engine.step(&[SeqChunk { seq_id: 0, start_pos: 0, len: prompt.len() }], &prompt)?;
    let mut next = argmax(&logits[0]);
    let mut times = Vec::with_capacity(max_tokens);
    for i in 0..max_tokens {
        let t = Instant::now();
        let l = engine.step(&[SeqChunk { seq_id: 0, start_pos: prompt.len() + i, len: 1 }], &[next])?;
        next = argmax(&l[0]);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(percentile(&mut times, 0.5))
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

fn print_run(run: Option<&Run>) {
    if let Some(r) = run {
        eprintln!(
            "stages {} prefix caching {} concurrency {:>3}: {:>7.1} tok/s, TTFT p50 {:.1} ms, ITL p50 {:.2} ms \
             p99 {:.2} ms, first/last tenth {:.2}/{:.2} ms",
            r.stages,
            on_off(r.prefix_caching),
            r.concurrency,
            r.tokens_per_s,
            r.ttft_ms_p50,
            r.itl_ms_p50,
            r.itl_ms_p99,
            r.itl_ms_first_tenth,
            r.itl_ms_last_tenth
        );
    }
}

fn on_off(setting: Option<bool>) -> &'static str {
    match setting {
        Some(true) => "on",
        Some(false) => "off",
        None => "as set",
    }
}

fn table(report: &Report) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| stages | prefix caching | threads/stage | streams | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL first/last tenth ms | compute ms/step | overhead µs/hop | added µs/hop vs 1 process |"
    );
    let _ = writeln!(t, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &report.runs {
        let added = r.added_us_per_hop_vs_single_process.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2}/{:.2} | {:.2} | {:.0} | {added} |",
            r.stages,
            on_off(r.prefix_caching),
            r.threads_per_stage,
            r.concurrency,
            r.tokens_per_s,
            r.ttft_ms_p50,
            r.ttft_ms_p99,
            r.itl_ms_p50,
            r.itl_ms_p99,
            r.itl_ms_first_tenth,
            r.itl_ms_last_tenth,
            r.compute_ms_per_step,
            r.overhead_us_per_hop
        );
    }
    for plan in &report.plans {
        let _ = writeln!(t, "\nPlan: {plan}");
    }
    t
}

/// Throughput vs concurrency, one line per stage count, as a self-contained SVG.
fn svg(report: &Report) -> String {
    let (w, h, left, right, top, bottom) = (640.0, 400.0, 70.0, 150.0, 30.0, 50.0);
    let mut levels: Vec<usize> = report.runs.iter().map(|r| r.concurrency).collect();
    levels.sort_unstable();
    levels.dedup();
    let max_y = report.runs.iter().map(|r| r.tokens_per_s).fold(1.0, f64::max) * 1.1;
    let x = |c: usize| {
        let i = levels.iter().position(|&l| l == c).unwrap_or(0) as f64;
        left + i * (w - left - right) / (levels.len().max(2) - 1) as f64
    };
    let y = |v: f64| h - bottom - v / max_y * (h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">Throughput vs concurrent streams ({} prompt + {} generated tokens)</text>\n",
        w / 2.0,
        report.prompt_tokens,
        report.max_tokens
    );
    let _ = writeln!(
        s,
        "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        h - bottom,
        w - right,
        h - bottom
    );
    let _ = writeln!(s, "<line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>", h - bottom);
    for &c in &levels {
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{c}</text>", x(c), h - bottom + 18.0);
    }
    for i in 0..=4 {
        let v = max_y * f64::from(i) / 4.0;
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.0}</text>", left - 6.0, y(v) + 4.0);
        let _ =
            writeln!(s, "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#ddd\"/>", y(v), w - right, y(v));
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">concurrent streams</text>",
        (left + w - right) / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        "<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">tokens/s</text>",
        h / 2.0,
        h / 2.0
    );
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
    // One line per cluster: its stage count, and its prefix caching when runs compare both.
    let mut clusters: Vec<(usize, Option<bool>)> = report.runs.iter().map(|r| (r.stages, r.prefix_caching)).collect();
    clusters.sort_unstable();
    clusters.dedup();
    let both = clusters.iter().any(|c| c.1 == Some(false)) && clusters.iter().any(|c| c.1 == Some(true));
    for (k, &(stages, caching)) in clusters.iter().enumerate() {
        let color = colors[k % colors.len()];
        let points: Vec<String> = report
            .runs
            .iter()
            .filter(|r| (r.stages, r.prefix_caching) == (stages, caching))
            .map(|r| format!("{:.1},{:.1}", x(r.concurrency), y(r.tokens_per_s)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        for p in &points {
            let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(s, "<circle cx=\"{px}\" cy=\"{py}\" r=\"3\" fill=\"{color}\"/>");
        }
        let ly = top + 20.0 + 18.0 * k as f64;
        let _ = writeln!(
            s,
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"/>",
            w - right + 15.0,
            w - right + 35.0
        );
        let mut label = if stages == 1 { "1 stage".to_owned() } else { format!("{stages} stages") };
        if both {
            label.push_str(&format!(", cache {}", on_off(caching)));
        }
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\">{label}</text>", w - right + 40.0, ly + 4.0);
    }
    s.push_str("</svg>\n");
    s
}

fn write_outputs(report: &Report, out: &Path) -> Result<()> {
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(out, serde_json::to_string_pretty(report)?).with_context(|| format!("writing {}", out.display()))?;
    let svg_path = out.with_extension("svg");
    std::fs::write(&svg_path, svg(report)).with_context(|| format!("writing {}", svg_path.display()))?;
    println!(
        "model: {}  prompt {} + {} generated tokens per request, {} threads in total",
        report.model, report.prompt_tokens, report.max_tokens, report.threads_total
    );
    for (threads, ms) in &report.single_process_itl_ms_p50 {
        println!("single process, {threads} thread(s): decode {ms:.2} ms/token (p50)");
    }
    print!("{}", table(report));
    eprintln!("wrote {} and {}", out.display(), svg_path.display());
    Ok(())
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
    fn percentiles_use_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), 50.0);
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(percentile(&mut [3.0], 0.99), 3.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }

    #[test]
    fn the_plot_has_one_line_per_stage_count() {
        let run = |stages, concurrency, tps| Run { stages, concurrency, tokens_per_s: tps, ..Run::default() };
        let report = Report {
            model: "m".into(),
            prompt_tokens: 8,
            shared_prefix_tokens: 0,
            max_tokens: 8,
            threads_total: 2,
            single_process_itl_ms_p50: vec![],
            plans: vec!["2 stage(s): a layers 0..19 (1.00 ms/layer), b layers 19..30 (1.00 ms/layer)".into()],
            runs: vec![run(1, 1, 10.0), run(1, 4, 30.0), run(2, 1, 9.0), run(2, 4, 28.0)],
        };
        let s = svg(&report);
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("2 stages") && s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        let t = table(&report);
        assert_eq!(t.lines().count(), 2 + 4 + 2);
        assert!(t.ends_with("Plan: 2 stage(s): a layers 0..19 (1.00 ms/layer), b layers 19..30 (1.00 ms/layer)\n"));
    }
}
