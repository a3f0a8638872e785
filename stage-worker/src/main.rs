//! `stage-worker`: parses flags (each with an env fallback), then serves until SIGINT/SIGTERM.

mod cli;

use clap::Parser;
use strata_membership::EtcdRegistry;
use strata_proto::shutdown_token;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Before the stage allocates anything much (see the function).
    let heap = strata_engine::heap::keep_freed_memory();
    let args = cli::Args::parse();
    let _telemetry = args.log.init("strata-stage-worker");
    tracing::debug!(?heap, "allocator settings");
    let cli::Launch { config, listen, registry } = args.into_config()?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let shutdown = shutdown_token();
    match registry {
        None => strata_stage_worker::run(config, listener, shutdown).await?,
        Some(etcd) => {
            let registry = EtcdRegistry::connect(&etcd.etcd, &etcd.cluster, etcd.connect_timeout).await?;
            strata_stage_worker::run_registered(config, registry, etcd.registration, listener, shutdown).await?;
        }
    }
    Ok(())
}
