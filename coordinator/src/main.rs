//! The `coordinator` binary: parses flags (with env fallbacks), then runs the library until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use strata_coordinator::CoordinatorConfig;
use strata_membership::parse_endpoints;
use strata_proto::{LogArgs, TlsArgs, shutdown_token};

/// strata coordinator: places the model on the stage workers registered in etcd.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// etcd endpoints, comma-separated (`http://10.0.0.1:2379,...`); omitted: embedded registry.
    #[arg(long, env = "STRATA_ETCD")]
    etcd: Option<String>,
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
    args.log.init();
    let mut config = CoordinatorConfig::new(args.model, args.grpc, args.http);
    config.etcd = args.etcd.as_deref().map(parse_endpoints).transpose()?;
    config.min_stages = args.min_stages;
    config.cluster = args.cluster;
    config.model_name = args.model_name;
    config.connect_timeout_ms = args.connect_timeout_ms;
    config.max_concurrent_requests = args.max_concurrent_requests;
    config.max_batch_tokens = args.max_batch_tokens;
    config.tls = args.tls.files()?;
    strata_coordinator::run(config, shutdown_token()).await?;
    Ok(())
}
