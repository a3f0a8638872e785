//! `strata bench --kernels`: the CPU backend's quantized dot-product kernels timed one by one on this machine
//! (`strata_engine::backend::cpu::kernel_bench`), printed as a table under the host line and written as JSON.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;
use strata_engine::backend::cpu::kernel_bench::{self, KernelBench, KernelPath, Outcome};
use strata_engine::quant;
use strata_engine::tensor::DType;

use crate::host::Host;

/// The kernel benchmark's flags of `strata bench`.
#[derive(clap::Args, Debug)]
pub struct KernelArgs {
    /// Time the CPU backend's quantized dot-product kernels instead: every block format on every path at every
    /// x86 level this CPU has (avx2, avx-vnni, avx512-vnni), one thread, random weights, no model (default --out
    /// target/bench/kernels.json).
    #[arg(long, env = "STRATA_BENCH_KERNELS")]
    pub kernels: bool,
    /// Block formats for --kernels (e.g. `q4_0,q4_k`; default: all).
    #[arg(long, value_delimiter = ',', value_parser = parse_format, env = "STRATA_BENCH_KERNEL_FORMATS")]
    kernel_formats: Vec<DType>,
    /// The weight matrix of --kernels, ROWSxCOLS: columns a multiple of 32, of 256 for the K-quants.
    #[arg(long, default_value = "576x1536", value_parser = parse_shape, env = "STRATA_BENCH_KERNEL_SHAPE")]
    kernel_shape: (usize, usize),
    /// Timings per format and path for --kernels (of ~2 ms each); the fastest is reported.
    #[arg(long, default_value_t = 15, env = "STRATA_BENCH_KERNEL_SAMPLES")]
    kernel_samples: usize,
}

fn parse_format(s: &str) -> Result<DType, String> {
    DType::parse(s).filter(|d| d.is_quantized()).ok_or_else(|| {
        let names: Vec<_> = quant::FORMATS.iter().map(|f| f.name).collect();
        format!("{s:?}: expected a block format ({})", names.join(", "))
    })
}

fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    s.split_once('x')
        .and_then(|(r, c)| Some((r.trim().parse().ok()?, c.trim().parse().ok()?)))
        .ok_or_else(|| format!("{s:?}: expected ROWSxCOLS, e.g. 576x1536"))
}

/// What `strata bench --kernels` writes.
#[derive(Serialize)]
struct Report<'a> {
    host: Host,
    #[serde(flatten)]
    bench: &'a KernelBench,
}

/// Runs the kernel benchmark and writes its JSON to `out`.
pub fn run(a: &KernelArgs, out: &Path) -> Result<()> {
    let host = Host::detect();
    println!("host: {}", host.describe());
    let cfg = kernel_bench::Config {
        formats: a.kernel_formats.clone(),
        rows: a.kernel_shape.0,
        cols: a.kernel_shape.1,
        samples: a.kernel_samples,
        ..kernel_bench::Config::default()
    };
    let bench = kernel_bench::run(&cfg)?;
    print!("{}", table(&bench));
    crate::json_file::write(out, &Report { host, bench: &bench })?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

/// The run as a markdown table, one row per format and instruction-set level this CPU has (the scalar oracle's
/// time on each of the format's rows), then the reasons of the paths that did not run.
fn table(b: &KernelBench) -> String {
    let mut s = format!(
        "CPU kernels (dispatch: {}), {} x {} weights, one thread, best of {} timings; ns per (row, 32-element block[, token]); streamed: {} MiB of copies of the weights, read from memory\n\n",
        b.isa,
        b.rows,
        b.cols,
        b.samples,
        b.streamed_bytes >> 20
    );
    s.push_str("| format | isa | decode in cache ns/block | decode streamed ns/block | GB/s streamed | tile 8 tokens ns/block·token | prefill 64 tokens ns/block·token | scalar ns/block |\n");
    s.push_str("|---|---|---:|---:|---:|---:|---:|---:|\n");
    let mut reasons: Vec<String> = Vec::new();
    let mut rows: Vec<(&str, &str)> =
        b.timings.iter().filter(|t| t.path != KernelPath::Scalar).map(|t| (t.format, t.isa)).collect();
    rows.dedup();
    for (format, isa) in rows {
        let of = |path: KernelPath| {
            b.timings
                .iter()
                .find(|t| t.format == format && t.path == path && (t.isa == isa || path == KernelPath::Scalar))
        };
        let mut cell = |path: KernelPath| match of(path).map(|t| &t.outcome) {
            Some(Outcome::Ran { ns_per_block, .. }) => format!("{ns_per_block:.2}"),
            Some(Outcome::NotRun { reason }) => {
                if !reasons.contains(reason) {
                    reasons.push(reason.clone());
                }
                "not run".into()
            }
            None => "-".into(),
        };
        let gb = match of(KernelPath::Streamed).map(|t| &t.outcome) {
            Some(Outcome::Ran { weight_gb_per_s, .. }) => format!("{weight_gb_per_s:.1}"),
            Some(Outcome::NotRun { .. }) => "not run".into(),
            None => "-".into(),
        };
        let cells = [
            cell(KernelPath::Decode),
            cell(KernelPath::Streamed),
            gb,
            cell(KernelPath::Tile),
            cell(KernelPath::Prefill),
            cell(KernelPath::Scalar),
        ];
        // A level this CPU lacks has no row, only its reason below.
        if cells[..cells.len() - 1].iter().all(|c| c == "not run") {
            continue;
        }
        let _ = writeln!(s, "| {format} | {isa} | {} |", cells.join(" | "));
    }
    for reason in reasons {
        let _ = writeln!(s, "\nnot run: {reason}");
    }
    s.push_str(
        "\nDecode attention (one query row; 9 heads sharing 3 KV heads of 64; f32 cache in 16-token blocks), one thread; ns per (position, head)\n\n| context | isa | ns/position·head |\n|---:|---|---:|\n",
    );
    for a in &b.attention {
        let _ = writeln!(s, "| {} | {} | {:.2} |", a.context, a.isa, a.ns_per_position);
    }
    s
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use strata_engine::backend::cpu::kernel_bench::{AttentionTiming, KernelTiming};

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        kernels: KernelArgs,
    }

    #[test]
    fn kernel_flags_parse_formats_and_a_shape() -> Result<()> {
        let a = Cli::try_parse_from(["bench", "--kernels"])?.kernels;
        assert!(a.kernels && a.kernel_formats.is_empty());
        assert_eq!((a.kernel_shape, a.kernel_samples), ((576, 1536), 15));
        let a =
            Cli::try_parse_from(["bench", "--kernels", "--kernel-formats", "q4_0,Q6_K", "--kernel-shape", "8x256"])?;
        assert_eq!(a.kernels.kernel_formats, [DType::Q4_0, DType::Q6_K]);
        assert_eq!(a.kernels.kernel_shape, (8, 256));
        for bad in [["--kernel-formats", "f16"], ["--kernel-formats", "iq2_xs"], ["--kernel-shape", "576"]] {
            assert!(Cli::try_parse_from([&["bench", "--kernels"][..], &bad[..]].concat()).is_err(), "{bad:?}");
        }
        Ok(())
    }

    #[test]
    fn table_has_a_row_per_format_and_level_run_and_says_why_a_level_did_not_run() {
        let timing = |format, isa, path, outcome| KernelTiming { format, isa, path, tokens: 1, outcome };
        let ran = Outcome::Ran { ns_per_block: 1.234, weight_gb_per_s: 27.5 };
        let not_run = Outcome::NotRun { reason: "avx512-vnni: this CPU lacks AVX-512".into() };
        let simd = &kernel_bench::PATHS[..kernel_bench::PATHS.len() - 1];
        let mut timings = Vec::new();
        for format in ["q8_0", "q4_k"] {
            timings.extend(simd.iter().map(|&p| timing(format, "avx2", p, ran.clone())));
            timings.extend(simd.iter().map(|&p| timing(format, "avx512-vnni", p, not_run.clone())));
            timings.push(timing(format, "scalar", KernelPath::Scalar, ran.clone()));
        }
        let attention = vec![AttentionTiming { context: 256, isa: "avx2", ns_per_position: 0.456 }];
        let t = table(&KernelBench {
            isa: "avx2",
            rows: 8,
            cols: 256,
            samples: 1,
            streamed_bytes: 64 << 20,
            timings,
            attention,
        });
        assert!(t.contains("streamed: 64 MiB of copies"), "{t}");
        assert!(t.contains("| q8_0 | avx2 | 1.23 | 1.23 | 27.5 | 1.23 | 1.23 | 1.23 |"), "{t}");
        assert!(!t.contains("| avx512-vnni |") && t.matches("| q4_k |").count() == 1, "{t}");
        assert!(t.contains("\nnot run: avx512-vnni: this CPU lacks AVX-512\n"), "{t}");
        assert!(t.ends_with("|---:|---|---:|\n| 256 | avx2 | 0.46 |\n"), "{t}");
    }
}
