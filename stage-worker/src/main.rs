//! `stage-worker`: parses flags (each with an env fallback), then serves until SIGINT/SIGTERM.

mod cli;

use clap::Parser;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let args = cli::Args::parse();
    let (config, listen) = args.into_config()?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cli::cancel_on_signal(shutdown.clone()));
    strata_stage_worker::run(config, listener, shutdown).await?;
    Ok(())
}
