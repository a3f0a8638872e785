//! `stage-worker`: parses flags (each with an env fallback), then serves until SIGINT/SIGTERM.

mod cli;

use clap::Parser;
use strata_coordinator::EtcdRegistry;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Operators see info logs unless RUST_LOG says otherwise.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let args = cli::Args::parse();
    let cli::Launch { config, listen, registry } = args.into_config()?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cli::cancel_on_signal(shutdown.clone()));
    match registry {
        None => strata_stage_worker::run(config, listener, shutdown).await?,
        Some(etcd) => {
            let registry = EtcdRegistry::connect(&etcd.endpoints, &etcd.cluster, etcd.connect_timeout).await?;
            strata_stage_worker::run_registered(config, registry, etcd.registration, listener, shutdown).await?;
        }
    }
    Ok(())
}
