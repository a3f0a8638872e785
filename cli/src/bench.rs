//! `strata bench`: prefill and decode throughput and peak memory of the CPU engine (the cluster and kernel
//! benchmarks are in `bench_cluster` and `bench_kernels`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::builder::RangedU64ValueParser;
use serde::Serialize;
use strata_coordinator::MAX_MICRO_BATCHES_PER_STAGE;
use strata_engine::backend::Backend;
use strata_engine::backend::cpu::threads_or_cores;
use strata_engine::generate::Engine;
use strata_engine::model::SeqChunk;
use strata_engine::sampling::{Sampler, SamplingParams, TokenHistory, argmax};
use strata_engine::stage_memory::ProcessMemory;
use strata_engine::{CpuIsa, Device, OnBackend};
use strata_proto::TlsArgs;

use crate::host::{Host, memory_read_gb_per_s};
use crate::load::{DeviceArgs, load};

/// Arguments of `strata bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Hugging Face directory, `.gguf` file, or `random:<7b|smollm2|tiny>[:<dtype>]` (seeded random weights); not
    /// needed with --coordinator.
    #[arg(long, env = "STRATA_MODEL")]
    model: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
    /// Benchmark serving through a running coordinator (gRPC URL) instead of the engine in this process.
    #[arg(long, conflicts_with_all = ["local", "kernels"])]
    coordinator: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    api_key: crate::connect::ApiKeyArgs,
    /// Benchmark serving through local clusters of these stage counts (e.g. `1,2,3`), started in this process;
    /// every stage gets --threads threads, and as the stages share this machine's cores the cluster keeps only as
    /// many micro-batches in flight as can compute at once.
    #[arg(long, value_delimiter = ',', conflicts_with = "kernels")]
    local: Vec<usize>,
    /// Concurrent client streams for --coordinator/--local, one run per level.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Requests each client stream sends in turn (--coordinator/--local).
    #[arg(long, default_value_t = 2)]
    requests_per_client: usize,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Of --prompt-tokens, the first tokens every request shares, as a system prompt (--coordinator/--local).
    /// One request with them runs first, unmeasured.
    #[arg(long, default_value_t = 0)]
    shared_prefix_tokens: usize,
    /// Prefix caching of the --local clusters' coordinators: `on`, `off`, or `off,on` to run each cluster both
    /// ways and compare.
    #[arg(long, value_delimiter = ',', default_value = "on", value_parser = parse_on_off)]
    prefix_caching: Vec<bool>,
    /// Micro-batches in flight per stage of the --local clusters' coordinators (1 to 16): `1`, or `1,2` to run each
    /// cluster both ways and compare (bigger batches against more overlap).
    #[arg(long, value_delimiter = ',', default_value = "1",
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_MICRO_BATCHES_PER_STAGE as u64))]
    micro_batches_per_stage: Vec<usize>,
    /// Passes over the --local clusters: each runs once per pass, in turn (1, 2, 3, 1, 2, 3, ...), so that a slower
    /// minute of a shared machine hits every cluster alike; the report adds each stage count's median ratio to one
    /// stage over the passes. With --model alone: prefills timed, one after the other (the median reported).
    #[arg(long, default_value_t = 1, env = "STRATA_BENCH_REPEAT",
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=100))]
    repeat: usize,
    /// Tokens decoded per sequence.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Sampling temperature of the --coordinator/--local requests, and of the engine they are compared with (0:
    /// greedy). Each request is seeded by its place in the run, so every run draws the same tokens.
    #[arg(long, default_value_t = 0.0, env = "STRATA_BENCH_TEMPERATURE")]
    temperature: f32,
    /// Top-p of the --coordinator/--local requests, and of the engine they are compared with (1: off).
    #[arg(long, default_value_t = 1.0, env = "STRATA_BENCH_TOP_P")]
    top_p: f32,
    /// Sequences decoded together in the batched measurement.
    #[arg(long, default_value_t = 8, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    batch: usize,
    /// Where to write the JSON report (default target/bench/engine.json, target/bench/cluster.json with an SVG
    /// plot beside it for --coordinator/--local, target/bench/kernels.json for --kernels).
    #[arg(long)]
    out: Option<PathBuf>,
    /// A llama.cpp baseline JSON (from scripts/llama-cpp-baseline.sh) to print beside the results.
    #[arg(long)]
    compare: Option<PathBuf>,
    #[command(flatten)]
    kernels: crate::bench_kernels::KernelArgs,
}

#[derive(Serialize)]
struct Report {
    engine: &'static str,
    model: String,
    backend: String,
    kv_dtype: String,
    threads: usize,
    load_seconds: f64,
    weight_bytes: usize,
    prompt_tokens: usize,
    decode_tokens: usize,
    batch: usize,
    /// The median of `prefill_tokens_per_s_samples`.
    prefill_tokens_per_s: f64,
    /// Each timed prefill's rate (`--repeat` of them).
    prefill_tokens_per_s_samples: Vec<f64>,
    decode_tokens_per_s_batch1: f64,
    decode_tokens_per_s_batched: f64,
    peak_rss_bytes: u64,
    /// Anonymous memory in transparent huge pages: the CPU backend's copied weights, where the system grants them.
    huge_page_bytes: u64,
    /// Microseconds one token's sampling takes over the model's vocabulary at temperature 1 (OpenAI's default),
    /// from the last batch-1 decode step's logits; the decode rates above pick greedily.
    sample_us_temperature: f64,
    /// The same, greedy (temperature 0: the largest logit).
    sample_us_greedy: f64,
    /// The same with top-p 0.9.
    sample_us_top_p: f64,
    /// Weight bytes read per second by batch-1 decode, which reads every weight once per token.
    decode_batch1_weight_gb_per_s: f64,
    /// What `threads` threads read from memory per second here (CPU only, measured after the run):
    /// batch-1 decode cannot stream its weights faster.
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_read_gb_per_s: Option<f64>,
    host: Host,
}

/// A `key:  N kB` line of a `/proc/self` file, in bytes (0 where absent).
fn proc_self_kib(file: &str, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/self/{file}"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(key)).map(str::to_string))
        .and_then(|l| l[key.len()..].split_whitespace().next().and_then(|kb| kb.parse::<u64>().ok()))
        .map_or(0, |kb| kb * 1024)
}

/// Mean microseconds of one seeded draw with `params` from `logits` (the sampler is handed a fresh copy each
/// time, as serving hands it each step's logits).
fn sampling_us(logits: &[f32], params: SamplingParams) -> f64 {
    const DRAWS: usize = 50;
    let mut sampler = Sampler::new(SamplingParams { seed: Some(1), ..params });
    let history = TokenHistory::new(0);
    let mut copy = logits.to_vec();
    let t = Instant::now();
    for _ in 0..DRAWS {
        copy.copy_from_slice(logits);
        std::hint::black_box(sampler.sample(&mut copy, &history));
    }
    t.elapsed().as_secs_f64() * 1e6 / DRAWS as f64
}

/// Prompt length of each sequence in the batched decode measurement.
const SHORT_PROMPT: usize = 16;

/// Decode steps before the measured ones (at most --decode-tokens), at batch 1 and at --batch.
const WARM_DECODE_STEPS: usize = 48;

/// Starts the sequences `ids`, each with its own `SHORT_PROMPT`-token prompt, and returns each one's greedy next
/// token.
fn start_short<B: Backend>(e: &mut Engine<B>, ids: &[u64], vocab: usize) -> Result<Vec<u32>> {
    ids.iter()
        .map(|&id| {
            let p = synthetic_prompt(SHORT_PROMPT, vocab, id as usize);
            Ok(argmax(&e.step(&[SeqChunk { seq_id: id, start_pos: 0, len: SHORT_PROMPT }], &p)?[0]))
        })
        .collect()
}

/// Decodes `steps` greedy tokens of the sequences `ids` together, from position `start` and fed `nexts` first;
/// returns the last step's logits (`None` after no step).
fn decode_greedy<B: Backend>(
    e: &mut Engine<B>,
    ids: &[u64],
    start: usize,
    steps: usize,
    mut nexts: Vec<u32>,
) -> Result<Option<Vec<Vec<f32>>>> {
    let mut last = None;
    for i in 0..steps {
        let chunks: Vec<SeqChunk> =
            ids.iter().map(|&seq_id| SeqChunk { seq_id, start_pos: start + i, len: 1 }).collect();
        let l = e.step(&chunks, &nexts)?;
        nexts = l.iter().map(|r| argmax(r)).collect();
        last = Some(l);
    }
    Ok(last)
}

/// Deterministic prompt ids spread over the vocabulary (no tokenizer needed).
fn synthetic_prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as u32).collect()
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

/// Runs `strata bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    if a.kernels.kernels {
        let unused = a.unused_by_kernels();
        if !unused.is_empty() {
            // Not an error: these may come from the environment (STRATA_MODEL, STRATA_THREADS) for other commands.
            eprintln!(
                "note: --kernels times random weights on one thread at every level this CPU has; not used: {}",
                unused.join(", ")
            );
        }
        let out = a.out.unwrap_or_else(|| PathBuf::from("target/bench/kernels.json"));
        return crate::bench_kernels::run(&a.kernels, &out);
    }
    if a.coordinator.is_some() || !a.local.is_empty() {
        if a.device.quantize.is_some() {
            bail!("--quantize applies to the in-process benchmark; a cluster's workers take their own --quantize");
        }
        if a.coordinator.is_some() && a.device.cpu_isa != CpuIsa::Auto {
            bail!(
                "--cpu-isa applies to this process's engine and --local clusters; a --coordinator's workers take their own"
            );
        }
        let sampling = SamplingParams { temperature: a.temperature, top_p: a.top_p, ..SamplingParams::default() };
        sampling.validate()?;
        return crate::bench_cluster::run(crate::bench_cluster::ClusterBench {
            coordinator: a.coordinator,
            tls: a.tls,
            credentials: a.api_key.credentials()?,
            local: a.local,
            model: a.model,
            concurrency: a.concurrency,
            requests_per_client: a.requests_per_client,
            prompt_tokens: a.prompt_tokens,
            shared_prefix_tokens: a.shared_prefix_tokens,
            prefix_caching: a.prefix_caching,
            micro_batches_per_stage: a.micro_batches_per_stage,
            repeat: a.repeat,
            max_tokens: a.decode_tokens,
            sampling,
            threads: a.device.threads,
            cpu_isa: a.device.cpu_isa,
            out: a.out.unwrap_or_else(|| PathBuf::from("target/bench/cluster.json")),
        });
    }
    a.device.clone().run(a)
}

impl BenchArgs {
    /// The flags set to something other than their defaults that `--kernels` does not read.
    fn unused_by_kernels(&self) -> Vec<&'static str> {
        let d = &self.device;
        let set = [
            ("--model", self.model.is_some()),
            ("--device", d.device != strata_engine::Device::Cpu),
            ("--dtype", d.dtype.is_some()),
            ("--quantize", d.quantize.is_some()),
            ("--threads", d.threads != 0),
            ("--cpu-isa", d.cpu_isa != CpuIsa::Auto),
            ("--kv-dtype", d.kv_dtype.is_some()),
        ];
        set.into_iter().filter(|(_, on)| *on).map(|(name, _)| name).collect()
    }
}

impl OnBackend for BenchArgs {
    type Out = ();
    type Error = anyhow::Error;

    fn run<B: Backend>(self, backend: Arc<B>) -> Result<()> {
        bench(self, backend)
    }
}

fn bench<B: Backend>(a: BenchArgs, backend: Arc<B>) -> Result<()> {
    let model = a.model.clone().context("--model is required (or --coordinator / --local / --kernels)")?;
    let out = a.out.clone().unwrap_or_else(|| PathBuf::from("target/bench/engine.json"));
    let t0 = Instant::now();
    let loaded = load(&model, &a.device, backend.clone(), false)?;
    let load_seconds = t0.elapsed().as_secs_f64();
    let cfg = loaded.model.config().clone();
    let threads = a.device.threads;
    let weight_bytes = loaded.model.weight_bytes();
    // Every sequence holds whole blocks (16 tokens): size for the longer of the prompts (the batched run uses
    // 16-token prompts), rounded up per sequence.
    let per_seq = (a.prompt_tokens.max(SHORT_PROMPT) + a.decode_tokens + 1).div_ceil(16) * 16;
    let kv_tokens = per_seq * a.batch.max(1);
    let kv_dtype = a.device.kv_dtype(&*backend);
    let mut engine = Engine::with_kv_dtype(loaded.model, None, kv_tokens, kv_dtype)?;
    let vocab = cfg.vocab_size;

    // Every step in the backend's context, as a stage's executor runs its batches.
    let (decode_tokens, batch, prompt_tokens, prefills) = (a.decode_tokens, a.batch, a.prompt_tokens, a.repeat);
    let (prefill_s, decode1_s, decode_b_s, last_logits) = engine.scoped(|e| -> Result<_> {
        // Warm up caches, page in the weights, and grow the heap to a prompt of the measured length (as llama-bench
        // warms up with the whole prompt): the measured prefill pays no first touch of its temporaries.
        let warm = synthetic_prompt(prompt_tokens, vocab, 99);
        let logits = e.step(&[SeqChunk { seq_id: 999, start_pos: 0, len: warm.len() }], &warm)?;
        // And decode, at batch 1 and at `batch`, past the passes in which the backend settles how it runs steps
        // of each size (the CPU times short passes spinning and sleeping, 29 passes), as a server has long since.
        let warm_steps = WARM_DECODE_STEPS.min(decode_tokens);
        decode_greedy(e, &[999], warm.len(), warm_steps, vec![argmax(&logits[0])])?;
        e.release(999);
        let warm_ids: Vec<u64> = (0..batch as u64).map(|s| 1000 + s).collect();
        let nexts = start_short(e, &warm_ids, vocab)?;
        decode_greedy(e, &warm_ids, SHORT_PROMPT, warm_steps, nexts)?;
        for &id in &warm_ids {
            e.release(id);
        }

        // Prefill (`prefills` times, the last one's sequence decoded on) + batch-1 decode.
        let prompt = synthetic_prompt(prompt_tokens, vocab, 0);
        let mut prefill_s = Vec::with_capacity(prefills);
        let mut logits = Vec::new();
        for i in 0..prefills {
            if i > 0 {
                e.release(0);
            }
            let t = Instant::now();
            logits = e.step(&[SeqChunk { seq_id: 0, start_pos: 0, len: prompt.len() }], &prompt)?;
            prefill_s.push(t.elapsed().as_secs_f64());
        }
        let next = argmax(&logits[0]);
        let t = Instant::now();
        let mut last = decode_greedy(e, &[0], prompt.len(), decode_tokens, vec![next])?.unwrap_or(logits);
        let decode1_s = t.elapsed().as_secs_f64();
        e.release(0);

        // Batched decode: `batch` sequences with short prompts, stepped together.
        let ids: Vec<u64> = (1..=batch as u64).collect();
        let nexts = start_short(e, &ids, vocab)?;
        let t = Instant::now();
        decode_greedy(e, &ids, SHORT_PROMPT, decode_tokens, nexts)?;
        let decode_b_s = t.elapsed().as_secs_f64();
        Ok((prefill_s, decode1_s, decode_b_s, last.swap_remove(0)))
    })?;
    let [sample_us_temperature, sample_us_top_p] = [1.0, 0.9]
        .map(|top_p| sampling_us(&last_logits, SamplingParams { temperature: 1.0, top_p, ..Default::default() }));
    let sample_us_greedy = sampling_us(&last_logits, SamplingParams { temperature: 0.0, ..Default::default() });

    let cpu_threads = threads_or_cores(threads);
    let prefill_rates: Vec<f64> = prefill_s.iter().map(|s| a.prompt_tokens as f64 / s).collect();
    let report = Report {
        engine: "strata",
        model: model.display().to_string(),
        backend: backend.name(),
        kv_dtype: kv_dtype.to_string(),
        threads,
        load_seconds,
        weight_bytes,
        prompt_tokens: a.prompt_tokens,
        decode_tokens: a.decode_tokens,
        batch: a.batch,
        prefill_tokens_per_s: crate::stats::percentile(&mut prefill_rates.clone(), 0.5).unwrap_or(0.0),
        prefill_tokens_per_s_samples: prefill_rates,
        decode_tokens_per_s_batch1: a.decode_tokens as f64 / decode1_s,
        decode_tokens_per_s_batched: (a.decode_tokens * a.batch) as f64 / decode_b_s,
        peak_rss_bytes: ProcessMemory::of_self().map_or(0, |m| m.peak),
        huge_page_bytes: proc_self_kib("smaps_rollup", "AnonHugePages:"),
        sample_us_temperature,
        sample_us_greedy,
        sample_us_top_p,
        decode_batch1_weight_gb_per_s: weight_bytes as f64 * a.decode_tokens as f64 / decode1_s / 1e9,
        // After the peak is read: the probe's buffer, the size of the weights, would count in it.
        memory_read_gb_per_s: (a.device.device == Device::Cpu).then(|| memory_read_gb_per_s(weight_bytes, cpu_threads)),
        host: Host::detect(),
    };
    crate::json_file::write(&out, &report)?;
    let baseline: Option<serde_json::Value> = match &a.compare {
        Some(p) => Some(serde_json::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )?),
        None => None,
    };
    let base = |k: &str| {
        baseline.as_ref().and_then(|b| b.get(k)).and_then(|v| v.as_f64()).map_or("-".to_string(), |v| format!("{v:.1}"))
    };
    println!(
        "model: {}  backend: {}  KV: {}  weights: {:.1} MiB",
        report.model,
        report.backend,
        report.kv_dtype,
        weight_bytes as f64 / 1048576.0
    );
    println!("| metric | strata | llama.cpp |");
    println!("|---|---:|---:|");
    let of = if a.repeat > 1 { format!(", median of {}", a.repeat) } else { String::new() };
    println!(
        "| prefill tok/s ({} tokens{of}) | {:.1} | {} |",
        a.prompt_tokens,
        report.prefill_tokens_per_s,
        base("prefill_tokens_per_s")
    );
    println!("| decode tok/s (batch 1) | {:.1} | {} |", report.decode_tokens_per_s_batch1, base("decode_tokens_per_s"));
    println!(
        "| decode tok/s (batch {}) | {:.1} | {} |",
        a.batch,
        report.decode_tokens_per_s_batched,
        base("decode_tokens_per_s_batch8")
    );
    println!("| sampling µs/token (greedy) | {:.1} | - |", report.sample_us_greedy);
    println!("| sampling µs/token (temperature 1) | {:.1} | - |", report.sample_us_temperature);
    println!("| sampling µs/token (temperature 1, top-p 0.9) | {:.1} | - |", report.sample_us_top_p);
    println!("| peak RSS MiB | {:.1} | - |", report.peak_rss_bytes as f64 / 1048576.0);
    println!("| in huge pages MiB | {:.1} | - |", report.huge_page_bytes as f64 / 1048576.0);
    println!("| load s | {:.2} | - |", report.load_seconds);
    println!("| weights read by batch-1 decode GB/s | {:.1} | - |", report.decode_batch1_weight_gb_per_s);
    if let Some(gb) = report.memory_read_gb_per_s {
        println!("| memory read GB/s ({cpu_threads} threads, this machine) | {gb:.1} | - |");
    }
    println!("host: {}", report.host.describe());
    eprintln!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn local_clusters_take_a_list_of_micro_batches_per_stage_from_1_to_16() -> Result<()> {
        let parse = |extra: &[&str]| {
            Cli::try_parse_from([&["bench", "--local", "1,2"][..], extra].concat())
                .map(|c| (c.bench.micro_batches_per_stage, c.bench.prefix_caching))
        };
        assert_eq!(parse(&[])?, (vec![1], vec![true]));
        assert_eq!(
            parse(&["--micro-batches-per-stage", "1,2", "--prefix-caching", "off,on"])?,
            (vec![1, 2], vec![false, true])
        );
        assert!(parse(&["--micro-batches-per-stage", "1,0"]).is_err());
        assert!(parse(&["--micro-batches-per-stage", "17"]).is_err());
        Ok(())
    }

    #[test]
    fn kernels_need_no_model_and_exclude_the_cluster_benchmarks() -> Result<()> {
        assert!(Cli::try_parse_from(["bench", "--kernels"])?.bench.kernels.kernels);
        assert!(Cli::try_parse_from(["bench", "--kernels", "--local", "1"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--kernels", "--coordinator", "http://127.0.0.1:1"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--kernels"])?.bench.unused_by_kernels().is_empty());
        let unused = Cli::try_parse_from(["bench", "--kernels", "--threads", "2", "--cpu-isa", "avx2"])?;
        assert_eq!(unused.bench.unused_by_kernels(), ["--threads", "--cpu-isa"]);
        Ok(())
    }
}
