//! `strata`: generate text, benchmark, and convert models from the command line.

mod bench;
mod bench_cluster;
mod bench_kernels;
mod chaos;
mod client;
mod cluster;
mod connect;
mod drain;
mod etcd;
mod generate;
mod host;
mod http;
mod json_file;
mod load;
mod perplexity;
mod plan;
mod retry;
mod stats;

use clap::{Parser, Subcommand};
use strata_proto::LogArgs;

#[derive(Parser)]
#[command(name = "strata", version, about = "Serve and run Llama-family models split across machines")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter and format (logs go to stderr).
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt in this process.
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode speed and peak memory, serving through a cluster (--coordinator, --local), or the
    /// CPU kernels alone (--kernels).
    Bench(bench::BenchArgs),
    /// Convert a model: GGUF or Hugging Face directory into a Hugging Face directory (dequantized safetensors) or a
    /// GGUF file (a float type, or quantized with --quantize as llama.cpp does).
    Convert(load::ConvertArgs),
    /// A model's perplexity over a text file, scored as llama.cpp's llama-perplexity scores it (chunks of --ctx
    /// tokens, each from an empty cache, the second half of each scored).
    Perplexity(perplexity::PerplexityArgs),
    /// What-if placement: how the coordinator would split a model over nodes of given memory (and speed).
    Plan(plan::PlanArgs),
    /// Run a whole cluster in this process: stage workers and a coordinator over loopback gRPC.
    Local(cluster::LocalArgs),
    /// Talk to a running coordinator.
    #[command(subcommand)]
    Client(ClientCommand),
    /// Inspect and manage a cluster's stage nodes.
    #[command(subcommand)]
    Nodes(cluster::NodesCommand),
    /// Inject faults (crashes, hangs, drains, joins, etcd pauses, leader failover) into a real cluster of
    /// processes under streamed load and compare every stream with an undisturbed run.
    Chaos(chaos::ChaosArgs),
    /// etcd administration: `enable-auth` turns on a fresh etcd's auth with a root user.
    #[command(subcommand)]
    Etcd(etcd::EtcdCommand),
}

#[derive(Subcommand)]
enum ClientCommand {
    /// Generate through the cluster (same flags and output as `strata generate`).
    Generate(client::ClientGenerateArgs),
}

fn main() {
    // `bench`, `generate` and `local` run the engine in this process (see the function).
    let heap = strata_engine::heap::keep_freed_memory();
    let cli = Cli::parse();
    let telemetry = cli.log.init("strata");
    tracing::debug!(?heap, "allocator settings");
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Convert(a) => load::convert(a),
        Command::Local(a) => cluster::local(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Client(ClientCommand::Generate(a)) => client::client_generate(a),
        Command::Nodes(c) => cluster::nodes(c),
        Command::Chaos(a) => chaos::run(a),
        Command::Etcd(c) => etcd::run(c),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        // `exit` skips destructors: flush the spans first.
        drop(telemetry);
        std::process::exit(1);
    }
}
