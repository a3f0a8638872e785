//! `strata etcd enable-auth`: turns on a fresh etcd's auth with a root user, safely repeatable (the Helm chart runs
//! it as a hook after every install and upgrade; the etcd image has no shell to script `etcdctl` with).

use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use strata_membership::{EtcdArgs, EtcdRegistry};

/// etcd administration.
#[derive(Subcommand)]
pub enum EtcdCommand {
    /// Add user root (password from --etcd-password-file or STRATA_ETCD_PASSWORD) with the root role and enable
    /// auth; with auth already on, only check that the password works.
    EnableAuth(EnableAuthArgs),
}

/// Flags of `strata etcd enable-auth`.
#[derive(Args)]
pub struct EnableAuthArgs {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "STRATA_ETCD")]
    etcd: String,
    /// etcd TLS and user (`--etcd-user root`).
    #[command(flatten)]
    access: EtcdArgs,
    /// How long to keep trying to reach etcd, in milliseconds.
    #[arg(long, env = "STRATA_CONNECT_TIMEOUT_MS", default_value_t = 120_000)]
    connect_timeout_ms: u64,
}

/// Runs an `etcd` subcommand.
pub fn run(command: EtcdCommand) -> anyhow::Result<()> {
    let EtcdCommand::EnableAuth(args) = command;
    let etcd = args.access.options(Some(&args.etcd))?.context("--etcd names no endpoint")?;
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let wait = Duration::from_millis(args.connect_timeout_ms);
    let enabled_now = rt.block_on(EtcdRegistry::enable_auth(&etcd, wait))?;
    println!("{}", if enabled_now { "etcd auth enabled for user root" } else { "etcd auth was already enabled" });
    Ok(())
}
