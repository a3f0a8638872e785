//! The `coordinator` binary: parses flags (with env fallbacks), then runs the library until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use clap::builder::RangedU64ValueParser;
use strata_coordinator::auth::{ApiKey, read_key_file};
use strata_coordinator::config::DEFAULT_MAX_BODY_BYTES;
use strata_coordinator::{CoordinatorConfig, MAX_MICRO_BATCHES_PER_STAGE, PrefixCaching};
use strata_engine::{KvDtype, QuantDtype};
use strata_membership::EtcdArgs;
use strata_proto::{Keepalive, LogArgs, TlsArgs, shutdown_token};

/// strata coordinator: places the model on the stage workers registered in etcd.
#[derive(Parser, Debug)]
#[command(version, about, args_override_self = true)]
struct Args {
    /// etcd endpoints, comma-separated (`http://10.0.0.1:2379,...`); omitted: embedded registry.
    #[arg(long, env = "STRATA_ETCD")]
    etcd: Option<String>,
    /// etcd TLS and user.
    #[command(flatten)]
    etcd_access: EtcdArgs,
    /// Model: a Hugging Face directory or a `.gguf` file.
    #[arg(long, env = "STRATA_MODEL")]
    model: PathBuf,
    /// Name the APIs serve the model under (default: its file or directory name less `.gguf`).
    #[arg(long, env = "STRATA_MODEL_NAME")]
    model_name: Option<String>,
    /// Address of the public gRPC API.
    #[arg(long, env = "STRATA_GRPC", default_value = "0.0.0.0:50051")]
    grpc: SocketAddr,
    /// Address of the HTTP API.
    #[arg(long, env = "STRATA_HTTP", default_value = "0.0.0.0:8080")]
    http: SocketAddr,
    /// READY nodes to wait for before the first plan.
    #[arg(long, env = "STRATA_MIN_STAGES", default_value_t = 1)]
    min_stages: usize,
    /// Cluster name (etcd prefix `/strata/<cluster>/`).
    #[arg(long, env = "STRATA_CLUSTER", default_value = "default")]
    cluster: String,
    /// How long to keep trying to reach etcd at start, in milliseconds.
    #[arg(long, env = "STRATA_CONNECT_TIMEOUT_MS", default_value_t = 10_000)]
    connect_timeout_ms: u64,
    /// Requests running or queued at once; more get RESOURCE_EXHAUSTED (HTTP 429).
    #[arg(long, env = "STRATA_MAX_CONCURRENT_REQUESTS", default_value_t = 128)]
    max_concurrent_requests: usize,
    /// Tokens per micro-batch (prompts longer than this are prefilled in chunks).
    #[arg(long, env = "STRATA_MAX_BATCH_TOKENS", default_value_t = 512)]
    max_batch_tokens: usize,
    /// Keep prompts' KV blocks on the stages and reuse them for prompts that start with the same tokens: `auto`
    /// (where that changes no token: stages whose results do not depend on batching), `on` (also `true`, and the
    /// flag alone), `off` (`false`).
    #[arg(long, env = "STRATA_ENABLE_PREFIX_CACHING", value_enum, default_value_t = PrefixCaching::Auto,
        num_args = 0..=1, default_missing_value = "on")]
    enable_prefix_caching: PrefixCaching,
    /// Micro-batches kept in flight per stage (1 to 16), the running requests split evenly over them: fewer make
    /// bigger batches and a steadier inter-token latency; more lower the time to first token under bursts and
    /// overlap more wire time with compute.
    #[arg(long, env = "STRATA_MICRO_BATCHES_PER_STAGE", default_value_t = 1,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_MICRO_BATCHES_PER_STAGE as u64))]
    micro_batches_per_stage: usize,
    /// The most micro-batches in flight through the whole pipeline (0: no cap, the stages times
    /// --micro-batches-per-stage). For stages that share a host's cores, which cannot all compute at once: the
    /// cores over each stage's threads.
    #[arg(long, env = "STRATA_MAX_BATCHES_IN_FLIGHT", default_value_t = 0)]
    max_batches_in_flight: usize,
    /// Longest sequence served, prompt plus generated tokens (default: the model's context length); longer
    /// requests are refused.
    #[arg(long, env = "STRATA_MAX_MODEL_LEN")]
    max_model_len: Option<usize>,
    /// Tokens of KV cache every stage must hold (default: --max-model-len): placement reserves memory for them,
    /// and a stage that cannot hold them fails its load, naming the shortfall.
    #[arg(long, env = "STRATA_MIN_KV_TOKENS")]
    min_kv_tokens: Option<u64>,
    /// Quantize float weights at load on every stage (q8_0, q4_0 or q4_1; carried in the plan, and placement
    /// sizes layers in that format). Default: each worker's own --quantize.
    #[arg(long, env = "STRATA_QUANTIZE")]
    quantize: Option<QuantDtype>,
    /// KV cache element type on every stage (f32, f16, bf16 or q8_0; carried in the plan, and placement reserves
    /// KV in it). Default: each worker's own --kv-dtype.
    #[arg(long, env = "STRATA_KV_DTYPE")]
    kv_dtype: Option<KvDtype>,
    /// Name this coordinator campaigns under (default `coordinator-<pid>`; the chart uses the pod name).
    #[arg(long, env = "STRATA_CANDIDATE")]
    candidate: Option<String>,
    /// TTL of the leader lease in seconds: a standby takes over this long after the leader dies.
    #[arg(long, env = "STRATA_LEASE_TTL_SECS", default_value_t = 5)]
    lease_ttl_secs: u64,
    /// A micro-batch unanswered this long (ms) means a stage hangs; its sequences are recomputed elsewhere.
    #[arg(long, env = "STRATA_BATCH_TIMEOUT_MS", default_value_t = 30_000)]
    batch_timeout_ms: u64,
    /// How long (ms) requests wait for a working pipeline after a fault before they fail with UNAVAILABLE.
    #[arg(long, env = "STRATA_RECOVERY_TIMEOUT_MS", default_value_t = 120_000)]
    recovery_timeout_ms: u64,
    /// How long (ms) a stage may take to answer Status when the pipeline connects before it is a suspect.
    #[arg(long, env = "STRATA_PROBE_TIMEOUT_MS", default_value_t = 2_000)]
    probe_timeout_ms: u64,
    /// How long (ms) a stage the pipeline could not reach stays out of placement (unless it registers again).
    #[arg(long, env = "STRATA_SUSPECT_MS", default_value_t = 30_000)]
    suspect_ms: u64,
    /// HTTP/2 keep-alive ping interval (ms) towards the stages.
    #[arg(long, env = "STRATA_KEEPALIVE_INTERVAL_MS", default_value_t = Keepalive::DEFAULT_INTERVAL_MS)]
    keepalive_interval_ms: u64,
    /// How long (ms) a keep-alive ping may go unanswered before a stage's connection is closed.
    #[arg(long, env = "STRATA_KEEPALIVE_TIMEOUT_MS", default_value_t = Keepalive::DEFAULT_TIMEOUT_MS)]
    keepalive_timeout_ms: u64,
    /// On SIGTERM, how long (ms) in-flight requests get to finish before the rest fail; new ones are refused.
    #[arg(long, env = "STRATA_SHUTDOWN_GRACE_MS", default_value_t = 30_000)]
    shutdown_grace_ms: u64,
    /// API keys callers must send as `Authorization: Bearer <key>` (HTTP header or gRPC metadata),
    /// comma-separated; none (and no admin key): both APIs are open. Prefer the env var or a file to the flag, which
    /// `ps` shows.
    #[arg(long = "api-key", env = "STRATA_API_KEY", value_delimiter = ',', hide_env_values = true)]
    api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped), added to --api-key.
    #[arg(long, env = "STRATA_API_KEY_FILE")]
    api_key_file: Option<PathBuf>,
    /// Admin API keys, comma-separated: they also work as plain keys, and only they may drain, cordon or
    /// uncordon nodes (with keys set and no admin key, nobody may).
    #[arg(long = "admin-api-key", env = "STRATA_ADMIN_API_KEY", value_delimiter = ',', hide_env_values = true)]
    admin_api_keys: Vec<String>,
    /// A file of admin API keys, one per line, added to --admin-api-key.
    #[arg(long, env = "STRATA_ADMIN_API_KEY_FILE")]
    admin_api_key_file: Option<PathBuf>,
    /// Under mutual TLS (--tls-ca), gRPC callers whose client certificate names one of these (subject common name,
    /// DNS or URI alternative name; comma-separated) are administrators without a key.
    #[arg(long = "admin-cert-identity", env = "STRATA_ADMIN_CERT_IDENTITIES", value_delimiter = ',')]
    admin_cert_identities: Vec<String>,
    /// Largest HTTP request body accepted, in bytes; larger ones get 413.
    #[arg(long, env = "STRATA_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// TLS for both APIs (HTTPS on the HTTP one) and for dialling the stages.
    #[command(flatten)]
    tls: TlsArgs,
    /// Log filter and format.
    #[command(flatten)]
    log: LogArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = args.log.init("strata-coordinator");
    let mut config = CoordinatorConfig::new(args.model, args.grpc, args.http);
    config.etcd = args.etcd_access.options(args.etcd.as_deref())?;
    config.min_stages = args.min_stages;
    config.cluster = args.cluster;
    config.model_name = args.model_name;
    config.connect_timeout_ms = args.connect_timeout_ms;
    config.max_concurrent_requests = args.max_concurrent_requests;
    config.max_batch_tokens = args.max_batch_tokens;
    config.enable_prefix_caching = args.enable_prefix_caching;
    config.micro_batches_per_stage = args.micro_batches_per_stage;
    config.max_batches_in_flight = args.max_batches_in_flight;
    config.max_model_len = args.max_model_len;
    config.min_kv_tokens = args.min_kv_tokens;
    config.quantize = args.quantize;
    config.kv_dtype = args.kv_dtype;
    config.candidate = args.candidate;
    config.lease_ttl_secs = args.lease_ttl_secs;
    config.batch_timeout_ms = args.batch_timeout_ms;
    config.recovery_timeout_ms = args.recovery_timeout_ms;
    config.probe_timeout_ms = args.probe_timeout_ms;
    config.suspect_ms = args.suspect_ms;
    config.keepalive_interval_ms = args.keepalive_interval_ms;
    config.keepalive_timeout_ms = args.keepalive_timeout_ms;
    config.shutdown_grace_ms = args.shutdown_grace_ms;
    config.tls = args.tls.files()?;
    config.api_keys = keys(args.api_keys, args.api_key_file.as_deref())?;
    config.admin_api_keys = keys(args.admin_api_keys, args.admin_api_key_file.as_deref())?;
    config.admin_cert_identities =
        args.admin_cert_identities.iter().map(|n| n.trim()).filter(|n| !n.is_empty()).map(str::to_owned).collect();
    config.max_body_bytes = args.max_body_bytes;
    strata_coordinator::run(config, shutdown_token()).await?;
    Ok(())
}

/// The keys given on the command line (or env; empty entries dropped) and in `file`.
fn keys(given: Vec<String>, file: Option<&std::path::Path>) -> anyhow::Result<Vec<ApiKey>> {
    let mut keys: Vec<ApiKey> = given.iter().map(|k| k.trim()).filter(|k| !k.is_empty()).map(ApiKey::new).collect();
    if let Some(file) = file {
        keys.extend(read_key_file(file)?);
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_from_the_flag_list_and_the_file() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("keys");
        std::fs::write(&file, "# ops team\nfile-key-1\n\n  file-key-2  \n")?;
        let args = Args::try_parse_from([
            "coordinator",
            "--model",
            "m",
            "--api-key",
            "flag-key-1, ,flag-key-2",
            "--admin-api-key-file",
            file.to_str().unwrap_or_default(),
        ])?;
        let plain = keys(args.api_keys, args.api_key_file.as_deref())?;
        assert_eq!(plain, vec![ApiKey::new("flag-key-1"), ApiKey::new("flag-key-2")]);
        let admin = keys(args.admin_api_keys, args.admin_api_key_file.as_deref())?;
        assert_eq!(admin, vec![ApiKey::new("file-key-1"), ApiKey::new("file-key-2")]);
        let missing = keys(Vec::new(), Some(&dir.path().join("nope")));
        assert!(missing.is_err_and(|e| e.to_string().contains("nope")), "a missing key file names itself");
        assert_eq!(args.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        Ok(())
    }

    #[test]
    fn prefix_caching_is_auto_unless_set_and_takes_booleans_too() -> anyhow::Result<()> {
        let parse = |extra: &[&str]| {
            Args::try_parse_from([&["coordinator", "--model", "m"][..], extra].concat())
                .map(|a| a.enable_prefix_caching)
        };
        assert_eq!(parse(&[])?, PrefixCaching::Auto);
        assert_eq!(parse(&["--enable-prefix-caching"])?, PrefixCaching::On);
        assert_eq!(parse(&["--enable-prefix-caching", "false"])?, PrefixCaching::Off);
        assert_eq!(parse(&["--enable-prefix-caching=true"])?, PrefixCaching::On);
        assert_eq!(parse(&["--enable-prefix-caching", "off"])?, PrefixCaching::Off);
        assert!(parse(&["--enable-prefix-caching", "maybe"]).is_err());
        Ok(())
    }

    #[test]
    fn micro_batches_per_stage_is_one_unless_set_and_zero_is_refused() -> anyhow::Result<()> {
        let parse = |extra: &[&str]| {
            Args::try_parse_from([&["coordinator", "--model", "m"][..], extra].concat())
                .map(|a| a.micro_batches_per_stage)
        };
        assert_eq!(parse(&[])?, 1);
        assert_eq!(parse(&["--micro-batches-per-stage", "2"])?, 2);
        assert_eq!(parse(&["--micro-batches-per-stage=16"])?, 16);
        let zero = parse(&["--micro-batches-per-stage", "0"]).map_err(|e| e.to_string());
        assert!(
            zero.as_ref().is_err_and(|e| e.contains("--micro-batches-per-stage") && e.contains("1..=16")),
            "{zero:?}"
        );
        assert!(parse(&["--micro-batches-per-stage", "17"]).is_err());
        assert!(parse(&["--micro-batches-per-stage", "two"]).is_err());
        Ok(())
    }

    #[test]
    fn batches_in_flight_are_uncapped_unless_set() -> anyhow::Result<()> {
        let parse = |extra: &[&str]| {
            Args::try_parse_from([&["coordinator", "--model", "m"][..], extra].concat())
                .map(|a| a.max_batches_in_flight)
        };
        assert_eq!(parse(&[])?, 0);
        assert_eq!(parse(&["--max-batches-in-flight", "1"])?, 1);
        assert!(parse(&["--max-batches-in-flight", "-1"]).is_err());
        Ok(())
    }
}
