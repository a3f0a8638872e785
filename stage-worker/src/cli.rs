//! Command-line flags of the `stage-worker` binary; every flag has an env fallback.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use strata_engine::{CpuIsa, Device, FloatDtype, HiddenDtype, KvDtype, LayerRange, QuantDtype, parse_bytes};
use strata_membership::{EtcdArgs, EtcdOptions, check_cluster_name};
use strata_proto::{Keepalive, LogArgs, TlsArgs};
use strata_stage_worker::{DEFAULT_MEMORY_FRACTION, RegistrationOptions, WorkerConfig};

/// Serve one contiguous layer range of a model over strata's Stage gRPC service.
#[derive(Debug, Parser)]
#[command(name = "stage-worker", version)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, env = "STRATA_LISTEN", default_value = "0.0.0.0:7000")]
    listen: String,
    /// Unique, stable node id.
    #[arg(long, env = "STRATA_NODE_ID")]
    node_id: String,
    /// Model: a Hugging Face directory or a .gguf file.
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    /// Layers to serve, START..END (half-open). Without it the worker registers with --etcd and serves what
    /// the coordinator's plan assigns it.
    #[arg(long, env = "STRATA_LAYERS")]
    layers: Option<LayerRange>,
    /// Address of the next stage (host:port); absent on the last stage.
    #[arg(long, env = "STRATA_NEXT")]
    next: Option<String>,
    /// Position of this stage in the pipeline (required unless the layers start at 0).
    #[arg(long, env = "STRATA_STAGE_INDEX")]
    stage_index: Option<u32>,
    /// Refuse batches scheduled under another plan epoch.
    #[arg(long, env = "STRATA_PLAN_EPOCH")]
    plan_epoch: Option<u64>,
    /// Compute threads (0: one per core).
    #[arg(long, env = "STRATA_THREADS", default_value_t = 0)]
    threads: usize,
    /// Instruction set of the CPU kernels: auto (the best this CPU has), scalar, avx2, avx-vnni or avx512-vnni
    /// (the CPU must have it).
    #[arg(long, env = "STRATA_CPU_ISA", default_value = "auto")]
    cpu_isa: CpuIsa,
    /// KV cache capacity in blocks (default: whatever the memory budget leaves after the weights and a
    /// profiling batch).
    #[arg(long, env = "STRATA_KV_BLOCKS")]
    kv_blocks: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, env = "STRATA_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// Element type of the KV cache: f32, f16, bf16 or q8_0 (default: f32 on the CPU, the activation type on a
    /// GPU, which stores only that or q8_0). f16/bf16 halve the cache, q8_0 takes 34/128 of f32.
    #[arg(long, env = "STRATA_KV_DTYPE")]
    kv_dtype: Option<KvDtype>,
    /// Compute device: cpu or cuda:N (cuda needs a build with --features cuda).
    #[arg(long, env = "STRATA_DEVICE", default_value = "cpu")]
    device: Device,
    /// Storage type of float weights: f32, f16 or bf16 (on a GPU also the activation type; default bf16 there,
    /// the file's type on the CPU). Quantized GGUF weights stay quantized.
    #[arg(long, env = "STRATA_DTYPE")]
    dtype: Option<FloatDtype>,
    /// Quantize float weight matrices to q8_0, q4_0 or q4_1 as they load (llama.cpp's rounding, this stage's
    /// layers only); matrices already quantized in the file stay as they are.
    #[arg(long, env = "STRATA_QUANTIZE")]
    quantize: Option<QuantDtype>,
    /// GPU memory the stage may use, in bytes (suffixes K, M, G, Ki, Mi, Gi); layers beyond it stay in host
    /// memory and are streamed to the GPU per batch.
    #[arg(long, env = "STRATA_GPU_MEMORY_LIMIT")]
    gpu_memory_limit: Option<String>,
    /// Element type of hidden states sent downstream: f32, f16 or bf16.
    #[arg(long, env = "STRATA_HIDDEN_DTYPE", default_value = "f32")]
    hidden_dtype: HiddenDtype,
    /// etcd endpoints (http://host:port, comma-separated) for registration and placement; used when no
    /// --layers are given.
    #[arg(long, env = "STRATA_ETCD")]
    etcd: Option<String>,
    /// etcd TLS and user.
    #[command(flatten)]
    etcd_access: EtcdArgs,
    /// Cluster name: the worker registers under `/strata/<cluster>/` in etcd.
    #[arg(long, env = "STRATA_CLUSTER", default_value = "default")]
    cluster: String,
    /// How long to keep trying to reach etcd at start, in milliseconds.
    #[arg(long, env = "STRATA_CONNECT_TIMEOUT_MS", default_value_t = 10_000)]
    connect_timeout_ms: u64,
    /// Address other nodes reach this worker at (host:port); defaults to --listen.
    #[arg(long, env = "STRATA_ADVERTISE")]
    advertise: Option<String>,
    /// Memory the worker may hold, in bytes (suffixes K, M, G, Ki, Mi, Gi): all its resident pages, mapped weights
    /// included; the KV cache gets what the weights and a profiling batch leave, and a plan change frees the old
    /// layers before loading new ones. Default: --memory-fraction of the RAM.
    #[arg(long, env = "STRATA_MEMORY_LIMIT")]
    memory_limit: Option<String>,
    /// Share of the RAM (or, on a GPU without --gpu-memory-limit, of the device's memory) the worker offers when
    /// no limit is given, like vLLM's --gpu-memory-utilization.
    #[arg(long, env = "STRATA_MEMORY_FRACTION", default_value_t = DEFAULT_MEMORY_FRACTION)]
    memory_fraction: f64,
    /// Serve Prometheus metrics at `GET /metrics` on this address (`host:port`, e.g. `0.0.0.0:9464`); without it
    /// the worker has no metrics endpoint.
    #[arg(long, env = "STRATA_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Keep at most this many of the stage's layers resident and offload the rest: on the CPU they page in from
    /// the model file as they run and out after (converted weights from a file in TMPDIR), on a GPU they stream
    /// from host memory. Default: as many as the memory budget holds.
    #[arg(long, env = "STRATA_RESIDENT_LAYERS")]
    resident_layers: Option<usize>,
    /// TTL of the worker's etcd lease in seconds: a worker that dies without deregistering leaves the cluster this
    /// long after its last refresh (the coordinator plans around a stage it cannot reach sooner).
    #[arg(long, env = "STRATA_LEASE_TTL_SECS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    lease_ttl_secs: u64,
    /// Milliseconds between HTTP/2 keepalive PINGs on the Stage server's connections and the link to the next
    /// stage.
    #[arg(long, env = "STRATA_KEEPALIVE_INTERVAL_MS", default_value_t = Keepalive::DEFAULT_INTERVAL_MS)]
    keepalive_interval_ms: u64,
    /// Milliseconds a keepalive PING may go unanswered before the connection (and its streams) is closed, so a
    /// hung peer fails its batches with UNAVAILABLE instead of stalling them.
    #[arg(long, env = "STRATA_KEEPALIVE_TIMEOUT_MS", default_value_t = Keepalive::DEFAULT_TIMEOUT_MS)]
    keepalive_timeout_ms: u64,
    /// Testing hook: the executor panics before running a batch after this many (fault-injection tests only).
    #[arg(long, env = "STRATA_FAULT_PANIC_AFTER_BATCHES", hide = true)]
    fault_panic_after_batches: Option<u64>,
    /// TLS for the Stage API and for dialling the next stage.
    #[command(flatten)]
    tls: TlsArgs,
    /// Log filter and format.
    #[command(flatten)]
    pub log: LogArgs,
}

impl Args {
    /// Validates the flags and builds the worker config, the listen address and, without --layers, how to
    /// register with etcd.
    pub fn into_config(self) -> anyhow::Result<Launch> {
        let etcd = self.etcd_access.options(self.etcd.as_deref()).context("--etcd")?;
        if let Some(adv) = &self.advertise {
            host_port(adv).with_context(|| format!("--advertise {adv:?}"))?;
        }
        host_port(&self.listen).with_context(|| format!("--listen {:?}", self.listen))?;
        let memory_limit = self
            .memory_limit
            .as_deref()
            .map(|l| parse_bytes(l).with_context(|| format!("--memory-limit {l:?}")))
            .transpose()?;
        let gpu_memory_limit = self
            .gpu_memory_limit
            .as_deref()
            .map(|l| parse_bytes(l).with_context(|| format!("--gpu-memory-limit {l:?}")))
            .transpose()?;
        let registry = match (&self.layers, etcd) {
            (Some(_), None) => None,
            (Some(_), Some(_)) => {
                bail!("--layers and --etcd exclude each other: with --etcd the plan assigns the layers")
            }
            (None, None) => bail!("pass --layers START..END, or --etcd URL to take the layers from the plan"),
            (None, Some(etcd)) => {
                if self.next.is_some() || self.stage_index.is_some() || self.plan_epoch.is_some() {
                    bail!("--next, --stage-index and --plan-epoch come from the plan when --etcd is used");
                }
                check_cluster_name(&self.cluster).context("--cluster")?;
                Some(Registered {
                    etcd,
                    cluster: self.cluster.clone(),
                    connect_timeout: Duration::from_millis(self.connect_timeout_ms),
                    registration: RegistrationOptions {
                        advertise: self.advertise.clone(),
                        lease_ttl: Duration::from_secs(self.lease_ttl_secs),
                    },
                })
            }
        };
        let config = WorkerConfig {
            next: self.next,
            stage_index: self.stage_index,
            plan_epoch: self.plan_epoch,
            threads: self.threads,
            cpu_isa: self.cpu_isa,
            kv_blocks: self.kv_blocks,
            memory_limit,
            memory_fraction: self.memory_fraction,
            resident_layers: self.resident_layers,
            metrics_listen: self.metrics_listen,
            block_size: self.block_size,
            kv_dtype: self.kv_dtype,
            hidden_dtype: self.hidden_dtype,
            device: self.device,
            dtype: self.dtype,
            quantize: self.quantize,
            gpu_memory_limit,
            tls: self.tls.files()?,
            keepalive_interval_ms: self.keepalive_interval_ms,
            keepalive_timeout_ms: self.keepalive_timeout_ms,
            fault_panic_after_batches: self.fault_panic_after_batches,
            ..WorkerConfig::new(self.node_id, self.model, self.layers)
        };
        match registry {
            None => {
                config.validate()?;
            }
            Some(_) => config.validate_common()?,
        }
        // Bad PEM files stop the worker here, before it binds or loads weights.
        config.tls()?;
        Ok(Launch { config, listen: self.listen, registry })
    }
}

/// What `main` starts.
#[derive(Debug)]
pub struct Launch {
    /// The worker's config.
    pub config: WorkerConfig,
    /// Address to listen on.
    pub listen: String,
    /// Registration with etcd, when the plan assigns the layers.
    pub registry: Option<Registered>,
}

/// Where and how to register.
#[derive(Debug)]
pub struct Registered {
    /// How to reach etcd.
    pub etcd: EtcdOptions,
    /// Cluster name.
    pub cluster: String,
    /// How long to keep trying to reach etcd at start.
    pub connect_timeout: Duration,
    /// How the worker presents itself.
    pub registration: RegistrationOptions,
}

fn host_port(addr: &str) -> anyhow::Result<()> {
    let (host, port) = addr.rsplit_once(':').context("expected host:port")?;
    if host.is_empty() {
        bail!("missing host");
    }
    port.parse::<u16>().context("bad port")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["stage-worker", "--node-id", "n", "--model", "/m"];
        v.extend_from_slice(extra);
        Args::parse_from(v)
    }

    #[test]
    fn dtype_and_gpu_limit_reach_the_config() -> anyhow::Result<()> {
        let launch = args(&["--layers", "0..4", "--dtype", "bf16"]).into_config()?;
        assert_eq!((launch.config.dtype, launch.config.gpu_memory_limit), (Some(FloatDtype::Bf16), None));
        let launch = args(&["--layers", "0..4", "--quantize", "q4_1"]).into_config()?;
        assert_eq!((launch.config.quantize, launch.config.dtype), (Some(QuantDtype::Q4_1), None));
        assert_eq!(launch.config.kv_dtype, None);
        let launch = args(&["--layers", "0..4", "--kv-dtype", "q8_0"]).into_config()?;
        assert_eq!(launch.config.kv_dtype, Some(KvDtype::Q8_0));
        assert_eq!(launch.config.cpu_isa, CpuIsa::Auto);
        let launch = args(&["--layers", "0..4", "--cpu-isa", "scalar"]).into_config()?;
        assert_eq!(launch.config.cpu_isa, "scalar".parse()?);
        if cfg!(feature = "cuda") {
            let launch =
                args(&["--layers", "0..4", "--device", "cuda:1", "--gpu-memory-limit", "40Gi"]).into_config()?;
            assert_eq!((launch.config.device, launch.config.gpu_memory_limit), (Device::Cuda(1), Some(40 << 30)));
        }
        Ok(())
    }

    #[test]
    fn layers_come_from_the_flag_or_from_etcd() -> anyhow::Result<()> {
        let launch = args(&["--layers", "0..4"]).into_config()?;
        assert!(launch.registry.is_none());
        let launch =
            args(&["--etcd", "http://a:2379, http://b:2379", "--advertise", "w:7000", "--memory-limit", "1Gi"])
                .into_config()?;
        assert_eq!(launch.config.memory_limit, Some(1 << 30));
        let etcd = launch.registry.context("registry expected")?;
        assert_eq!(etcd.etcd.endpoints, ["http://a:2379", "http://b:2379"]);
        assert_eq!(etcd.cluster, "default");
        assert_eq!(etcd.registration.advertise.as_deref(), Some("w:7000"));
        assert!(args(&[]).into_config().is_err(), "neither layers nor etcd");
        assert!(args(&["--layers", "0..4", "--etcd", "http://a:2379"]).into_config().is_err());
        assert!(args(&["--etcd", "http://a:2379", "--next", "h:1"]).into_config().is_err());
        assert!(args(&["--etcd", "http://a:2379", "--cluster", "a/b"]).into_config().is_err());
        assert!(args(&["--etcd", "ftp://a:2379"]).into_config().is_err());
        let bare = args(&["--etcd", "etcd:2379"]).into_config()?.registry.map(|r| r.etcd.endpoints);
        assert_eq!(bare, Some(vec!["http://etcd:2379".to_owned()]));
        let tls = args(&["--etcd", "etcd:2379", "--etcd-ca", "/ca.pem"]).into_config()?.registry;
        assert_eq!(tls.map(|r| r.etcd.endpoints), Some(vec!["https://etcd:2379".to_owned()]), "a CA means https");
        assert!(args(&["--layers", "0..4", "--etcd-ca", "/ca.pem"]).into_config().is_err(), "etcd flags need --etcd");
        Ok(())
    }

    #[test]
    fn tls_flags_come_in_pairs_and_name_missing_files() {
        let err = args(&["--layers", "0..4", "--tls-cert", "/c.pem"]).into_config().err().map(|e| format!("{e:#}"));
        assert!(err.as_deref().is_some_and(|e| e.contains("no key") && e.contains("--tls-key")), "{err:?}");
        assert!(args(&["--layers", "0..4", "--tls-ca", "/ca.pem"]).into_config().is_err(), "a CA alone");
        let err = args(&["--layers", "0..4", "--tls-cert", "/nope/c.pem", "--tls-key", "/nope/k.pem"])
            .into_config()
            .err()
            .map(|e| format!("{e:#}"));
        assert!(err.as_deref().is_some_and(|e| e.contains("/nope/c.pem")), "{err:?}");
    }

    #[test]
    fn bad_flags_are_rejected() {
        assert!(args(&["--etcd", "http://"]).into_config().is_err());
        assert!(args(&["--layers", "0..4", "--advertise", "nohost"]).into_config().is_err());
        assert!(args(&["--layers", "0..4", "--memory-limit", "12X"]).into_config().is_err());
        let gpu = args(&["--layers", "0..4", "--device", "cuda:0"]).into_config();
        assert_eq!(gpu.is_ok(), cfg!(feature = "cuda"), "cuda:N is accepted exactly in cuda builds");
        assert!(args(&["--layers", "0..4", "--gpu-memory-limit", "1Gi"]).into_config().is_err(), "cpu device");
        assert!(args(&["--layers", "0..4", "--device", "cuda:0", "--gpu-memory-limit", "0"]).into_config().is_err());
        let bad_dtype = ["stage-worker", "--node-id", "n", "--model", "/m", "--layers", "0..4", "--dtype", "f64"];
        assert!(Args::try_parse_from(bad_dtype).is_err());
        let bad_isa = ["stage-worker", "--node-id", "n", "--model", "/m", "--layers", "0..4", "--cpu-isa", "sse4"];
        assert!(Args::try_parse_from(bad_isa).is_err());
        assert!(Args::try_parse_from(["stage-worker", "--node-id", "n", "--model", "/m", "--layers", "4..2"]).is_err());
        assert_eq!(parse_bytes("2Gi").ok(), Some(2 << 30));
        assert!(args(&["--layers", "0..4", "--keepalive-timeout-ms", "0"]).into_config().is_err());
    }

    #[test]
    fn keepalive_defaults_and_flags_reach_the_config() -> anyhow::Result<()> {
        let launch = args(&["--layers", "0..4"]).into_config()?;
        assert_eq!(launch.config.keepalive()?, Keepalive::DEFAULT);
        assert_eq!((launch.config.keepalive_interval_ms, launch.config.keepalive_timeout_ms), (1000, 2000));
        let launch = args(&["--layers", "0..4", "--keepalive-interval-ms", "250", "--keepalive-timeout-ms", "500"])
            .into_config()?;
        assert_eq!(
            launch.config.keepalive()?,
            Keepalive { interval: Duration::from_millis(250), timeout: Duration::from_millis(500) }
        );
        Ok(())
    }
}
