//! Command-line flags of the `stage-worker` binary; every flag has an env fallback.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use strata_stage_worker::{Device, HiddenDtype, LayerRange, WorkerConfig};
use tokio_util::sync::CancellationToken;

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
    /// Layers to serve, START..END (half-open). Without it the worker would wait for placement from etcd,
    /// which is not implemented yet.
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
    /// KV cache capacity in blocks.
    #[arg(long, env = "STRATA_KV_BLOCKS", default_value_t = 256)]
    kv_blocks: usize,
    /// Tokens per KV block.
    #[arg(long, env = "STRATA_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// Compute device: cpu (cuda:N needs a CUDA build).
    #[arg(long, env = "STRATA_DEVICE", default_value = "cpu")]
    device: Device,
    /// Element type of hidden states sent downstream: f32, f16 or bf16.
    #[arg(long, env = "STRATA_HIDDEN_DTYPE", default_value = "f32")]
    hidden_dtype: HiddenDtype,
    /// etcd endpoint (http://host:port) for registration and placement.
    #[arg(long, env = "STRATA_ETCD")]
    etcd: Option<String>,
    /// Address other nodes reach this worker at (host:port); defaults to --listen.
    #[arg(long, env = "STRATA_ADVERTISE")]
    advertise: Option<String>,
    /// Memory available for weights and KV cache, in bytes (suffixes K, M, G, Ki, Mi, Gi accepted).
    #[arg(long, env = "STRATA_MEMORY_LIMIT")]
    memory_limit: Option<String>,
}

impl Args {
    /// Validates the flags and builds the worker config and the listen address.
    pub fn into_config(self) -> anyhow::Result<(WorkerConfig, String)> {
        if let Some(etcd) = &self.etcd {
            let rest = etcd.strip_prefix("http://").or_else(|| etcd.strip_prefix("https://"));
            if rest.is_none_or(|r| r.trim_matches('/').is_empty()) {
                bail!("--etcd {etcd:?} must be an http:// or https:// URL");
            }
        }
        if let Some(adv) = &self.advertise {
            host_port(adv).with_context(|| format!("--advertise {adv:?}"))?;
        }
        host_port(&self.listen).with_context(|| format!("--listen {:?}", self.listen))?;
        if let Some(limit) = &self.memory_limit {
            parse_bytes(limit).with_context(|| format!("--memory-limit {limit:?}"))?;
        }
        if self.layers.is_none() {
            bail!(
                "--layers is required: etcd-driven placement (--etcd) is not implemented yet, so the worker cannot \
                 learn its layer range; pass --layers START..END"
            );
        }
        let config = WorkerConfig {
            next: self.next,
            stage_index: self.stage_index,
            plan_epoch: self.plan_epoch,
            threads: self.threads,
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            hidden_dtype: self.hidden_dtype,
            device: self.device,
            ..WorkerConfig::new(self.node_id, self.model, self.layers)
        };
        config.validate()?;
        Ok((config, self.listen))
    }
}

fn host_port(addr: &str) -> anyhow::Result<()> {
    let (host, port) = addr.rsplit_once(':').context("expected host:port")?;
    if host.is_empty() {
        bail!("missing host");
    }
    port.parse::<u16>().context("bad port")?;
    Ok(())
}

fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let n: u64 = digits.parse().context("expected a number of bytes")?;
    let mult: u64 = match suffix.trim() {
        "" => 1,
        "K" | "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        other => bail!("unknown suffix {other:?}"),
    };
    n.checked_mul(mult).context("too large")
}

/// Cancels `token` on SIGINT or SIGTERM.
pub async fn cancel_on_signal(token: CancellationToken) {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutting down");
    token.cancel();
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
    fn layers_are_required_until_etcd_placement_exists() {
        let err = args(&["--etcd", "http://etcd:2379"]).into_config().err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("not implemented")));
        assert!(args(&["--layers", "0..4"]).into_config().is_ok());
    }

    #[test]
    fn bad_flags_are_rejected() {
        assert!(args(&["--layers", "0..4", "--etcd", "etcd:2379"]).into_config().is_err());
        assert!(args(&["--layers", "0..4", "--advertise", "nohost"]).into_config().is_err());
        assert!(args(&["--layers", "0..4", "--memory-limit", "12X"]).into_config().is_err());
        assert!(args(&["--layers", "0..4", "--device", "cuda:0"]).into_config().is_err());
        assert!(Args::try_parse_from(["stage-worker", "--node-id", "n", "--model", "/m", "--layers", "4..2"]).is_err());
        assert_eq!(parse_bytes("2Gi").ok(), Some(2 << 30));
    }
}
