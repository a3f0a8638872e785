//! The cluster benchmark's outputs: the JSON report, its tables and the throughput plot.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::host::Host;
use crate::stats::percentile;

/// One concurrency level on one cluster.
#[derive(Serialize, Default, Clone)]
pub(super) struct Run {
    /// Which pass over the local clusters (`--repeat`) this run belongs to, from 1.
    pub pass: usize,
    pub stages: usize,
    /// Whether the local cluster's coordinator cached prompt prefixes (`None`: a `--coordinator`, as it is set).
    pub prefix_caching: Option<bool>,
    /// Micro-batches the local cluster's coordinator kept in flight per stage (`None`: a `--coordinator`, as it is
    /// set).
    pub micro_batches_per_stage: Option<usize>,
    pub threads_per_stage: usize,
    pub concurrency: usize,
    pub requests: usize,
    pub completion_tokens: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p99: f64,
    /// Prompt tokens per request the prefix cache held (from each response's usage): how much of the prompts
    /// the cluster did not compute.
    pub cached_prompt_tokens_per_request: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    /// Mean inter-token latency over the first and the last tenth of each request's tokens (median over requests),
    /// in ms: the scheduler's per-token work must not grow with the output (equal within noise for long outputs).
    pub itl_ms_first_tenth: f64,
    pub itl_ms_last_tenth: f64,
    /// Stage compute (all stages) per micro-batch step, in ms.
    pub compute_ms_per_step: f64,
    /// Per step and stage: from a batch's arrival off its stream to the start of its compute, in µs.
    pub queue_us_per_stage: f64,
    /// Per step and stage: from the end of the compute to the output's hand-off to the next stream, in µs.
    pub handoff_us_per_stage: f64,
    /// Per step and hop: what is left of the round trip outside the stages (gRPC, network, the coordinator's
    /// stream tasks), in µs.
    pub wire_us_per_hop: f64,
    /// Pipeline time minus stage compute, per micro-batch step, in µs.
    pub overhead_us_per_step: f64,
    /// The same divided by the step's hops.
    pub overhead_us_per_hop: f64,
    /// The median over the run's micro-batches of their round trip minus their compute, divided by the hops, in
    /// µs (from the coordinator's `strata_pipeline_overhead_seconds`; local clusters only).
    pub overhead_us_per_hop_p50: Option<f64>,
    /// A step's hops: stages + 1 (to stage 0, from stage to stage, the last stage's answer straight back).
    pub hops_per_step: usize,
    /// (Cluster ITL p50 - single-process decode p50) / hops, for concurrency 1 of a local cluster.
    pub added_us_per_hop_vs_single_process: Option<f64>,
    /// Cluster minus single-process inter-token latency over the first and the last tenth of the tokens (ms), for
    /// concurrency 1 of a local cluster: serving's own per-token cost at the start and the end of an output, with
    /// the model's (attention over a growing context) taken out.
    pub added_ms_first_tenth: Option<f64>,
    pub added_ms_last_tenth: Option<f64>,
    /// The same requests through the engine in this process with all the threads, batched by rounds (every
    /// stream's prompt in one step, then the streams decoded together): tokens generated per second.
    pub engine_tokens_per_s: Option<f64>,
    /// Of that run, the decode steps alone: tokens per second at a batch of `concurrency` sequences.
    pub engine_decode_tokens_per_s: Option<f64>,
    /// `tokens_per_s / engine_tokens_per_s`: what serving keeps of the engine's rate on the same work.
    pub serving_vs_engine: Option<f64>,
}

/// Batch-1 decode latency of the whole model in this process, over the benchmark's prompt and output length.
#[derive(Serialize, Default, Clone, Debug)]
pub(super) struct SingleProcess {
    pub threads: usize,
    pub itl_ms_p50: f64,
    /// Mean latency over the first and the last tenth of the decoded tokens, in ms.
    pub itl_ms_first_tenth: f64,
    pub itl_ms_last_tenth: f64,
}

/// What `strata bench --local/--coordinator` writes.
#[derive(Serialize)]
pub(super) struct Report {
    pub host: Host,
    pub model: String,
    pub prompt_tokens: usize,
    pub shared_prefix_tokens: usize,
    pub max_tokens: usize,
    /// The engine's threads, and every stage's of a local cluster (its stages take turns with every core).
    pub threads_total: usize,
    /// The CPU kernels' instruction set in local clusters and the single-process baseline (`None` for a
    /// `--coordinator`'s, which this process does not see).
    pub cpu_isa: Option<String>,
    /// How tokens were picked (temperature 0: greedily), by the requests and the engine baseline alike.
    pub temperature: f32,
    pub top_p: f32,
    /// The whole model in this process, batch-1 decode, per thread count of the local clusters' stages.
    pub single_process: Vec<SingleProcess>,
    /// Each cluster's layer split and the speed its nodes measured at registration, one line per cluster.
    pub plans: Vec<String>,
    /// Passes over the local clusters (`--repeat`).
    pub repeat: usize,
    /// Each cluster of more than one stage against the one-stage cluster at the same streams, over the passes.
    pub against_one_stage: Vec<AgainstOneStage>,
    pub runs: Vec<Run>,
}

/// A cluster of several stages against the one-stage cluster of the same pass, streams and settings: the median
/// (nearest rank) over the passes of the per-pass ratios.
#[derive(Serialize, Clone, Debug, PartialEq)]
pub(super) struct AgainstOneStage {
    pub stages: usize,
    pub prefix_caching: Option<bool>,
    pub micro_batches_per_stage: Option<usize>,
    pub concurrency: usize,
    /// Passes with both clusters measured.
    pub passes: usize,
    /// Tokens per second over the one-stage cluster's.
    pub tokens_per_s_ratio: f64,
    /// The same with each run's rate divided by the engine's, measured in this process just before it: the
    /// machine's drift between the two runs taken out (`None` without engine rates).
    pub vs_engine_ratio: Option<f64>,
}

/// Every run of more than one stage paired with the one-stage run of its pass, streams and settings, summarised
/// per cluster and streams; empty when the runs include no one-stage cluster.
pub(super) fn against_one_stage(runs: &[Run]) -> Vec<AgainstOneStage> {
    let setting = |r: &Run| (r.stages, r.prefix_caching, r.micro_batches_per_stage, r.concurrency);
    let mut keys: Vec<_> = runs.iter().filter(|r| r.stages > 1).map(setting).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut out = Vec::new();
    for (stages, prefix_caching, micro_batches_per_stage, concurrency) in keys {
        let (mut tokens, mut vs_engine) = (Vec::new(), Vec::new());
        for r in runs.iter().filter(|r| setting(r) == (stages, prefix_caching, micro_batches_per_stage, concurrency)) {
            let Some(one) = runs
                .iter()
                .find(|o| o.pass == r.pass && setting(o) == (1, prefix_caching, micro_batches_per_stage, concurrency))
            else {
                continue;
            };
            tokens.push(r.tokens_per_s / one.tokens_per_s);
            if let (Some(many), Some(one)) = (r.serving_vs_engine, one.serving_vs_engine) {
                vs_engine.push(many / one);
            }
        }
        let Some(tokens_per_s_ratio) = percentile(&mut tokens, 0.5) else { continue };
        out.push(AgainstOneStage {
            stages,
            prefix_caching,
            micro_batches_per_stage,
            concurrency,
            passes: tokens.len(),
            tokens_per_s_ratio,
            vs_engine_ratio: if vs_engine.len() == tokens.len() { percentile(&mut vs_engine, 0.5) } else { None },
        });
    }
    out
}

pub(super) fn print_run(run: Option<&Run>) {
    if let Some(r) = run {
        eprintln!(
            "stages {} prefix caching {} mb/stage {} concurrency {:>3}: {:>7.1} tok/s, TTFT p50 {:.1} ms ({:.0} prompt \
             tokens cached per request), ITL p50 {:.2} ms p99 {:.2} ms, first/last tenth {:.2}/{:.2} ms",
            r.stages,
            on_off(r.prefix_caching),
            as_set(r.micro_batches_per_stage),
            r.concurrency,
            r.tokens_per_s,
            r.ttft_ms_p50,
            r.cached_prompt_tokens_per_request,
            r.itl_ms_p50,
            r.itl_ms_p99,
            r.itl_ms_first_tenth,
            r.itl_ms_last_tenth
        );
    }
}

fn on_off(setting: Option<bool>) -> &'static str {
    match setting {
        Some(true) => "on",
        Some(false) => "off",
        None => "as set",
    }
}

/// A local cluster's setting, or "as set" for a `--coordinator`.
fn as_set(setting: Option<usize>) -> String {
    setting.map_or_else(|| "as set".to_owned(), |v| v.to_string())
}

/// The throughput table, the table of where a step's time went, and the plans.
pub(super) fn table(report: &Report) -> String {
    let opt = |v: Option<f64>, digits: usize| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"));
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| stages | prefix caching | mb/stage | threads/stage | streams | tok/s | engine tok/s, same work | serving / engine | engine decode tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL first/last tenth ms |"
    );
    let _ = writeln!(t, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &report.runs {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2}/{:.2} |",
            r.stages,
            on_off(r.prefix_caching),
            as_set(r.micro_batches_per_stage),
            r.threads_per_stage,
            r.concurrency,
            r.tokens_per_s,
            opt(r.engine_tokens_per_s, 1),
            opt(r.serving_vs_engine, 2),
            opt(r.engine_decode_tokens_per_s, 1),
            r.ttft_ms_p50,
            r.ttft_ms_p99,
            r.itl_ms_p50,
            r.itl_ms_p99,
            r.itl_ms_first_tenth,
            r.itl_ms_last_tenth,
        );
    }
    let _ = writeln!(
        t,
        "\nWhere a micro-batch step's time went (means per step, but for the overhead's median; meaningful at 1 stream, queueing behind other batches at more):\n"
    );
    let _ = writeln!(
        t,
        "| stages | mb/stage | streams | compute ms/step | queue µs/stage | hand-off µs/stage | wire µs/hop | overhead µs/hop | overhead µs/hop p50 | added µs/hop vs 1 process | added ms/token vs 1 process, first/last tenth |"
    );
    let _ = writeln!(t, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &report.runs {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {}/{} |",
            r.stages,
            as_set(r.micro_batches_per_stage),
            r.concurrency,
            r.compute_ms_per_step,
            r.queue_us_per_stage,
            r.handoff_us_per_stage,
            r.wire_us_per_hop,
            r.overhead_us_per_hop,
            opt(r.overhead_us_per_hop_p50, 0),
            opt(r.added_us_per_hop_vs_single_process, 0),
            opt(r.added_ms_first_tenth, 2),
            opt(r.added_ms_last_tenth, 2),
        );
    }
    if !report.against_one_stage.is_empty() {
        let _ = writeln!(
            t,
            "\nAgainst one stage at the same streams (median over {} pass(es); each pass's ratio of tok/s, and of serving / engine, to the one-stage cluster's):\n",
            report.repeat
        );
        let _ = writeln!(
            t,
            "| stages | prefix caching | mb/stage | streams | passes | tok/s ratio | serving / engine ratio |"
        );
        let _ = writeln!(t, "|---:|---|---:|---:|---:|---:|---:|");
        for a in &report.against_one_stage {
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {} | {:.2} | {} |",
                a.stages,
                on_off(a.prefix_caching),
                as_set(a.micro_batches_per_stage),
                a.concurrency,
                a.passes,
                a.tokens_per_s_ratio,
                opt(a.vs_engine_ratio, 2),
            );
        }
    }
    for plan in &report.plans {
        let _ = writeln!(t, "\nPlan: {plan}");
    }
    t
}

/// Throughput vs concurrency, one line per stage count, as a self-contained SVG.
fn svg(report: &Report) -> String {
    let (w, h, left, right, top, bottom) = (640.0, 400.0, 70.0, 150.0, 30.0, 50.0);
    let mut levels: Vec<usize> = report.runs.iter().map(|r| r.concurrency).collect();
    levels.sort_unstable();
    levels.dedup();
    let max_y = report.runs.iter().map(|r| r.tokens_per_s).fold(1.0, f64::max) * 1.1;
    let x = |c: usize| {
        let i = levels.iter().position(|&l| l == c).unwrap_or(0) as f64;
        left + i * (w - left - right) / (levels.len().max(2) - 1) as f64
    };
    let y = |v: f64| h - bottom - v / max_y * (h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">Throughput vs concurrent streams ({} prompt + {} generated tokens)</text>\n",
        w / 2.0,
        report.prompt_tokens,
        report.max_tokens
    );
    let _ = writeln!(
        s,
        "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        h - bottom,
        w - right,
        h - bottom
    );
    let _ = writeln!(s, "<line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>", h - bottom);
    for &c in &levels {
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{c}</text>", x(c), h - bottom + 18.0);
    }
    for i in 0..=4 {
        let v = max_y * f64::from(i) / 4.0;
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.0}</text>", left - 6.0, y(v) + 4.0);
        let _ =
            writeln!(s, "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#ddd\"/>", y(v), w - right, y(v));
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">concurrent streams</text>",
        (left + w - right) / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        "<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">tokens/s</text>",
        h / 2.0,
        h / 2.0
    );
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
    // One line per cluster: its stage count, and its prefix caching and micro-batches per stage when runs compare
    // several.
    let cluster = |r: &Run| (r.stages, r.prefix_caching, r.micro_batches_per_stage);
    let mut clusters: Vec<(usize, Option<bool>, Option<usize>)> = report.runs.iter().map(cluster).collect();
    clusters.sort_unstable();
    clusters.dedup();
    let both = clusters.iter().any(|c| c.1 == Some(false)) && clusters.iter().any(|c| c.1 == Some(true));
    let several_mb = clusters.iter().any(|c| c.2 != clusters[0].2);
    for (k, &(stages, caching, micro_batches)) in clusters.iter().enumerate() {
        let color = colors[k % colors.len()];
        let points: Vec<String> = report
            .runs
            .iter()
            .filter(|r| cluster(r) == (stages, caching, micro_batches))
            .map(|r| format!("{:.1},{:.1}", x(r.concurrency), y(r.tokens_per_s)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        for p in &points {
            let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(s, "<circle cx=\"{px}\" cy=\"{py}\" r=\"3\" fill=\"{color}\"/>");
        }
        let ly = top + 20.0 + 18.0 * k as f64;
        let _ = writeln!(
            s,
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"/>",
            w - right + 15.0,
            w - right + 35.0
        );
        let mut label = if stages == 1 { "1 stage".to_owned() } else { format!("{stages} stages") };
        if both {
            label.push_str(&format!(", cache {}", on_off(caching)));
        }
        if several_mb {
            label.push_str(&format!(", {} mb/stage", as_set(micro_batches)));
        }
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\">{label}</text>", w - right + 40.0, ly + 4.0);
    }
    s.push_str("</svg>\n");
    s
}

pub(super) fn write_outputs(report: &Report, out: &Path) -> Result<()> {
    crate::json_file::write(out, report)?;
    let svg_path = out.with_extension("svg");
    std::fs::write(&svg_path, svg(report)).with_context(|| format!("writing {}", svg_path.display()))?;
    println!("host: {}", report.host.describe());
    println!(
        "model: {}  prompt {} + {} generated tokens per request ({}), {} threads (the engine's, and each stage's){}",
        report.model,
        report.prompt_tokens,
        report.max_tokens,
        if report.temperature == 0.0 {
            "greedy".to_owned()
        } else {
            format!("temperature {}, top-p {}, seeded", report.temperature, report.top_p)
        },
        report.threads_total,
        report.cpu_isa.as_ref().map(|isa| format!(", CPU kernels {isa}")).unwrap_or_default()
    );
    for d in &report.single_process {
        println!(
            "single process, {} thread(s): decode {:.2} ms/token (p50), first/last tenth {:.2}/{:.2} ms",
            d.threads, d.itl_ms_p50, d.itl_ms_first_tenth, d.itl_ms_last_tenth
        );
    }
    print!("{}", table(report));
    eprintln!("wrote {} and {}", out.display(), svg_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report of 8 prompt + 8 generated tokens on 2 threads.
    fn report(plans: Vec<String>, runs: Vec<Run>) -> Report {
        Report {
            host: Host::default(),
            model: "m".into(),
            prompt_tokens: 8,
            shared_prefix_tokens: 0,
            max_tokens: 8,
            threads_total: 2,
            cpu_isa: None,
            temperature: 0.0,
            top_p: 1.0,
            single_process: vec![],
            plans,
            repeat: 1,
            against_one_stage: against_one_stage(&runs),
            runs,
        }
    }

    #[test]
    fn clusters_of_several_stages_are_held_against_one_stage_of_the_same_pass() {
        let run = |pass, stages, concurrency, tokens_per_s, vs_engine| Run {
            pass,
            stages,
            concurrency,
            tokens_per_s,
            serving_vs_engine: Some(vs_engine),
            ..Run::default()
        };
        let runs = vec![
            run(1, 1, 16, 100.0, 1.0),
            run(1, 3, 16, 90.0, 1.2),
            run(2, 1, 16, 200.0, 1.0),
            run(2, 3, 16, 220.0, 0.9),
            run(3, 1, 16, 100.0, 0.5),
            run(3, 3, 16, 130.0, 0.6),
            // No one-stage run at 64 streams in pass 3: that pass leaves the comparison at 64.
            run(1, 1, 64, 100.0, 1.0),
            run(1, 3, 64, 150.0, 1.5),
            run(3, 3, 64, 10.0, 0.1),
        ];
        let against = against_one_stage(&runs);
        let at = |c: usize| against.iter().find(|a| a.concurrency == c).cloned();
        let sixteen = at(16).expect("16 streams");
        // Ratios 0.9, 1.1, 1.3 (tok/s) and 1.2, 0.9, 1.2 (serving / engine): the middle of each.
        assert_eq!((sixteen.stages, sixteen.passes), (3, 3));
        assert!((sixteen.tokens_per_s_ratio - 1.1).abs() < 1e-12, "{sixteen:?}");
        assert!(sixteen.vs_engine_ratio.is_some_and(|r| (r - 1.2).abs() < 1e-12), "{sixteen:?}");
        let sixty_four = at(64).expect("64 streams");
        assert_eq!(sixty_four.passes, 1);
        assert!((sixty_four.tokens_per_s_ratio - 1.5).abs() < 1e-12, "{sixty_four:?}");
        assert_eq!(against.len(), 2);
        let t = table(&report(vec![], runs));
        assert!(t.contains("| 3 | as set | as set | 16 | 3 | 1.10 | 1.20 |"), "{t}");
        // Without a one-stage cluster there is nothing to hold against.
        assert!(against_one_stage(&[run(1, 2, 16, 1.0, 1.0)]).is_empty());
    }

    #[test]
    fn the_plot_has_one_line_per_stage_count() {
        let run = |stages, concurrency, tps| Run { stages, concurrency, tokens_per_s: tps, ..Run::default() };
        let plan = "2 stage(s): a layers 0..19 (1.00 ms/layer), b layers 19..30 (1.00 ms/layer)";
        let report = report(vec![plan.into()], vec![run(1, 1, 10.0), run(1, 4, 30.0), run(2, 1, 9.0), run(2, 4, 28.0)]);
        let s = svg(&report);
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("2 stages") && s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        let t = table(&report);
        // Two tables of 4 runs (header, rule, rows; a blank line and a caption between them), one of the 2-stage
        // cluster against the 1-stage one at 2 levels, then the plan.
        assert_eq!(t.lines().count(), (2 + 4) + 3 + (2 + 4) + 3 + (2 + 2) + 2, "{t}");
        assert!(t.contains("| 2 | as set | as set | 1 | 1 | 0.90 | - |"), "{t}");
        assert!(t.ends_with("Plan: 2 stage(s): a layers 0..19 (1.00 ms/layer), b layers 19..30 (1.00 ms/layer)\n"));
        assert!(!s.contains("mb/stage"), "one setting: the legend does not name it");
    }

    #[test]
    fn clusters_comparing_micro_batches_per_stage_get_a_line_and_a_column_each() {
        let run = |micro_batches, concurrency, tps| Run {
            stages: 2,
            prefix_caching: Some(true),
            micro_batches_per_stage: Some(micro_batches),
            threads_per_stage: 1,
            concurrency,
            tokens_per_s: tps,
            ..Run::default()
        };
        let report = report(vec![], vec![run(1, 1, 10.0), run(1, 4, 30.0), run(2, 1, 9.0), run(2, 4, 28.0)]);
        let s = svg(&report);
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains(">2 stages, 1 mb/stage<") && s.contains(">2 stages, 2 mb/stage<"), "{s}");
        let t = table(&report);
        assert!(t.contains("| 2 | on | 1 | 1 | 4 | 30.0 |") && t.contains("| 2 | on | 2 | 1 | 4 | 28.0 |"), "{t}");
        assert!(t.contains("| 2 | 2 | 4 | 0.00 |"), "the second table names the setting too: {t}");
        let json = serde_json::to_value(&report.runs[2]).unwrap_or_default();
        assert_eq!(json["micro_batches_per_stage"], 2);
        assert_eq!(as_set(None), "as set");
    }
}
