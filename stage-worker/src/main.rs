//! `stage-worker`: parses flags (each with an env fallback), then serves until SIGINT/SIGTERM.

mod cli;

use clap::Parser;
use strata_membership::EtcdRegistry;
use strata_proto::shutdown_token;

fn main() -> anyhow::Result<()> {
    // Before any other thread starts: one arena for the process cannot take back the arenas of threads that have
    // allocated already, and tokio's workers allocate as they start (see the function).
    let heap = strata_engine::heap::keep_freed_memory();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(serve(heap))
}

async fn serve(heap: strata_engine::heap::HeapTuning) -> anyhow::Result<()> {
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
