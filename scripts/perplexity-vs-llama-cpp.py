#!/usr/bin/env python3
"""Perplexity of GGUF files in strata and in llama.cpp, over the same text, scored the same way.

For each file, runs `strata perplexity` and llama.cpp's `llama-perplexity` (chunks of --ctx tokens, each from an
empty cache, the second half of each scored), and with --f32-twins each file's dequantized twin as well (written
once beside the file by `llama-quantize --allow-requantize FILE TWIN F32`: the same weights without their
quantization, run in floats, activations included): the twin's perplexity is what the 8-bit activations and the
kernels' arithmetic cost on top of the weights' own rounding. Prints a markdown table and writes JSON with the CPU
model and flags.

  scripts/perplexity-vs-llama-cpp.py [--text /usr/share/common-licenses/GPL-3] [--ctx 512] [--chunks N]
                                     [--threads 2] [--strata target/release/strata] [--f32-twins]
                                     [--out target/bench/perplexity-compare.json] GGUF...

The default text is the GPL's (Debian and Ubuntu ship it in base-files): English prose of 7,639 tokens, 14
chunks of 512 for SmolLM2's tokenizer. llama-perplexity and llama-quantize must have been built
(`scripts/llama-cpp-build.sh llama-perplexity llama-quantize`, cached under $STRATA_CACHE).
"""
import argparse, json, os, re, subprocess, sys, tempfile

from bench_host import cpu_info, loadavg

cache = os.environ.get("STRATA_CACHE", "/var/cache/strata")
ap = argparse.ArgumentParser()
ap.add_argument("models", nargs="+", metavar="GGUF")
ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
ap.add_argument("--ctx", type=int, default=512)
ap.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--strata", default=None, help="strata binary (default: $CARGO_TARGET_DIR/release/strata)")
ap.add_argument("--f32-twins", action="store_true", help="also score each file's dequantized F32 twin")
ap.add_argument("--out", default="target/bench/perplexity-compare.json")
a = ap.parse_args()

llama_dir = os.environ.get("STRATA_LLAMA_BIN", f"{cache}/llama.cpp/build/llama-cpp-python-0.3.36/bin")
tools = {t: os.path.join(llama_dir, t) for t in ("llama-perplexity", "llama-quantize")}
for t, path in tools.items():
    if not os.path.exists(path):
        sys.exit(f"{path} not found: run `scripts/llama-cpp-build.sh llama-perplexity llama-quantize` first")
strata = a.strata or os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release", "strata")
if not os.path.exists(strata):
    sys.exit(f"{strata} not found: run `cargo build --release -p strata-cli` or pass --strata")
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama(model):
    cmd = [tools["llama-perplexity"], "-m", model, "-f", a.text, "-c", str(a.ctx), "-t", str(a.threads)]
    if a.chunks:
        cmd += ["--chunks", str(a.chunks)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    m = FINAL.search(out.stdout + out.stderr)
    if out.returncode != 0 or not m:
        sys.exit(f"llama-perplexity failed on {model}:\n{out.stderr[-2000:]}")
    return float(m.group(1)), float(m.group(2))


def ours(model):
    with tempfile.TemporaryDirectory() as d:
        report = os.path.join(d, "ppl.json")
        cmd = [strata, "perplexity", "--model", model, "--file", a.text, "--ctx", str(a.ctx),
               "--threads", str(a.threads), "--out", report]
        if a.chunks:
            cmd += ["--chunks", str(a.chunks)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"strata perplexity failed on {model}:\n{out.stderr[-2000:]}")
        r = json.load(open(report))
    return r["perplexity"], r["std_error"], r["backend"]


def twin(model):
    path = model[: -len(".gguf")] + ".f32.gguf" if model.endswith(".gguf") else model + ".f32"
    if not os.path.exists(path):
        tmp = path + ".partial"
        subprocess.run([tools["llama-quantize"], "--allow-requantize", model, tmp, "F32", "2"],
                       check=True, capture_output=True)
        os.replace(tmp, path)
    return path


host = cpu_info()
rows = []
print(f"host: {host['model']} ({host['cpus']} CPUs; {' '.join(host['simd_flags'])}), load average "
      f"{' '.join(loadavg())}; text {a.text}, ctx {a.ctx}")
for m in a.models:
    row = {"model": m, "strata": ours(m), "llama_cpp": llama(m)}
    if a.f32_twins:
        t = twin(m)
        row["f32_twin"] = {"model": t, "strata": ours(t), "llama_cpp": llama(t)}
    rows.append(row)
    print(f"done {m}", file=sys.stderr)

print()
print("| file | strata PPL | llama.cpp PPL | strata / llama.cpp |" + (" F32 twin: strata | F32 twin: llama.cpp |" if a.f32_twins else ""))
print("|---|---:|---:|---:|" + ("---:|---:|" if a.f32_twins else ""))
for r in rows:
    (s, se, _), (l, le) = r["strata"], r["llama_cpp"]
    line = f"| {os.path.basename(r['model'])} | {s:.4f} ± {se:.4f} | {l:.4f} ± {le:.4f} | {s / l:.4f} |"
    if a.f32_twins:
        t = r["f32_twin"]
        line += f" {t['strata'][0]:.4f} | {t['llama_cpp'][0]:.4f} |"
    print(line)
os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
with open(a.out, "w") as f:
    json.dump({"host": {**host, "loadavg": loadavg()}, "text": a.text,
               "ctx": a.ctx, "chunks": a.chunks, "threads": a.threads, "rows": rows}, f, indent=2)
print(f"wrote {a.out}")
