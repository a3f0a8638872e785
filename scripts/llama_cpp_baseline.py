#!/usr/bin/env python3
"""Summarise llama.cpp benchmark output for scripts/llama-cpp-baseline.sh.

Reads the JSON array written by `llama-bench -o json` and (optionally) the JSONL
lines written by `llama-batched-bench --output-format jsonl`, writes one JSON
summary for comparison with strata's own numbers, and prints a readable table.

Standard library only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from typing import Any


def _load_bench(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    # llama-bench prints the JSON array on stdout; be tolerant of stray log
    # lines around it by slicing from the first '[' to the last ']'.
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise SystemExit(f"llama_cpp_baseline: no JSON array in {path}:\n{text[:2000]}")
    rows = json.loads(text[start : end + 1])
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"llama_cpp_baseline: empty llama-bench result in {path}")
    return rows


def _load_batched(path: str | None) -> list[dict[str, Any]]:
    if not path or not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "speed_tg" in row and "pl" in row:
                rows.append(row)
    return rows


def _pick(rows: list[dict[str, Any]], *, prompt: bool) -> dict[str, Any] | None:
    """The pp (n_gen == 0) or tg (n_prompt == 0) test row."""
    for r in rows:
        if prompt and r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            return r
        if not prompt and r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            return r
    return None


def _r(x: Any, nd: int = 2) -> Any:
    return round(float(x), nd) if x is not None else None


def _median(xs: Any) -> float | None:
    xs = sorted(float(x) for x in xs or [])
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _key(x: Any) -> float:
    return float("-inf") if x is None else float(x)


def _noise_warnings(pp: dict[str, Any], tg: dict[str, Any], busy: str) -> list[str]:
    """Reasons to distrust the numbers (CPU contention shows up as large spread)."""
    out = []
    for name, r in (("prefill", pp), ("decode", tg)):
        avg, sd = r.get("avg_ts"), r.get("stddev_ts")
        if avg and sd is not None and sd / avg > 0.10:
            out.append(f"{name} stddev is {100 * sd / avg:.0f}% of the mean")
    try:
        if float(busy) >= 25:
            out.append(f"CPUs were {float(busy):.0f}% busy just before the run")
    except ValueError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-json", required=True)
    ap.add_argument("--batched-jsonl")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--llama-commit", default="unknown")
    ap.add_argument("--llama-commit-full", default="")
    ap.add_argument("--llama-commit-date", default="")
    ap.add_argument("--source", default="")
    ap.add_argument("--bench-cmd", default="")
    ap.add_argument("--batched-cmd", default="")
    ap.add_argument("--cpu-busy-before", default="", help="percent of all CPUs busy just before")
    ap.add_argument("--loadavg-before", default="")
    ap.add_argument("--loadavg-after", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    rows = _load_bench(args.bench_json)
    pp = _pick(rows, prompt=True)
    tg = _pick(rows, prompt=False)
    if pp is None or tg is None:
        raise SystemExit(f"llama_cpp_baseline: llama-bench result lacks a pp or tg row: {rows}")
    first = rows[0]
    batched = _load_batched(args.batched_jsonl)

    commit = first.get("build_commit") or args.llama_commit
    version = f"{commit}"
    if args.llama_commit_date:
        version += f" ({args.llama_commit_date})"

    summary: dict[str, Any] = {
        "engine": "llama.cpp",
        "version": version,
        "model": os.path.abspath(args.model),
        "threads": args.threads,
        "prefill_tokens_per_s": _r(pp["avg_ts"]),
        "decode_tokens_per_s": _r(tg["avg_ts"]),
        "prefill_tokens_per_s_stddev": _r(pp.get("stddev_ts")),
        "decode_tokens_per_s_stddev": _r(tg.get("stddev_ts")),
        "prefill_tokens_per_s_median": _r(_median(pp.get("samples_ts"))),
        "decode_tokens_per_s_median": _r(_median(tg.get("samples_ts"))),
        "prefill_tokens_per_s_max": _r(max(pp.get("samples_ts") or [None], key=_key)),
        "decode_tokens_per_s_max": _r(max(tg.get("samples_ts") or [None], key=_key)),
        "n_prompt": pp.get("n_prompt"),
        "n_gen": tg.get("n_gen"),
        "llama_cpp": {
            "commit": commit,
            "commit_full": args.llama_commit_full or None,
            "commit_date": args.llama_commit_date or None,
            "source": args.source or None,
            "backends": first.get("backends"),
        },
        "model_info": {
            "file": os.path.basename(args.model),
            "type": first.get("model_type"),
            "size_bytes": first.get("model_size"),
            "n_params": first.get("model_n_params"),
        },
        "bench": {
            "tool": "llama-bench",
            "command": args.bench_cmd,
            "n_batch": first.get("n_batch"),
            "n_ubatch": first.get("n_ubatch"),
            "flash_attn": first.get("flash_attn"),
            "type_k": first.get("type_k"),
            "type_v": first.get("type_v"),
            "repetitions": len(tg.get("samples_ts") or []) or None,
            "prefill_samples_ts": [_r(x) for x in pp.get("samples_ts") or []],
            "decode_samples_ts": [_r(x) for x in tg.get("samples_ts") or []],
        },
        "cpu_info": first.get("cpu_info"),
        "host_cpus": os.cpu_count(),
        "cpu_busy_pct_before": float(args.cpu_busy_before) if args.cpu_busy_before else None,
        "loadavg_before": args.loadavg_before or None,
        "loadavg_after": args.loadavg_after or None,
        "timestamp": first.get("test_time")
        or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "raw": rows,
    }
    warnings = _noise_warnings(pp, tg, args.cpu_busy_before)
    summary["noisy"] = bool(warnings)
    summary["warnings"] = warnings

    if batched:
        by_shape = {(int(r["pp"]), int(r["pl"])): r for r in batched}
        n_prompt = int(pp.get("n_prompt") or 128)
        summary["batched"] = {
            "tool": "llama-batched-bench",
            "command": args.batched_cmd,
            "note": (
                "single run (no repetitions); each sequence decodes after its own "
                "n_prompt-token prefill, so decode runs at KV depth n_prompt..n_prompt+n_gen, "
                "unlike llama-bench tg which starts at depth 0. decode_tokens_per_s is the "
                "aggregate over all parallel sequences."
            ),
            "runs": [
                {
                    "parallel": int(r["pl"]),
                    "n_prompt": r.get("pp"),
                    "n_gen": r.get("tg"),
                    "prefill_tokens_per_s": _r(r.get("speed_pp")),
                    "decode_tokens_per_s": _r(r.get("speed_tg")),
                    "decode_tokens_per_s_per_seq": _r(float(r["speed_tg"]) / int(r["pl"])),
                    "t_prefill_s": _r(r.get("t_pp"), 4),
                    "t_decode_s": _r(r.get("t_tg"), 4),
                }
                for r in batched
            ],
        }
        # 8 sequences, each after its own n_prompt-token prefill (the headline batch-8 number).
        if (n_prompt, 8) in by_shape:
            summary["decode_tokens_per_s_batch8"] = _r(by_shape[(n_prompt, 8)]["speed_tg"])
        # Same shape as strata's `bench` batched decode (8 sequences after 16-token prompts).
        if (16, 8) in by_shape:
            summary["decode_tokens_per_s_batch8_prompt16"] = _r(by_shape[(16, 8)]["speed_tg"])
        # Batch-1 decode after an n_prompt prefill, i.e. at the KV depth strata's
        # batch-1 decode runs at (llama-bench tg starts from an empty cache).
        if (n_prompt, 1) in by_shape:
            summary["decode_tokens_per_s_after_prefill"] = _r(by_shape[(n_prompt, 1)]["speed_tg"])
    else:
        summary["batched"] = None

    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.out)

    # ------------------------------------------------------------ table
    out = sys.stdout
    out.write("\n")
    out.write(f"llama.cpp {summary['version']}  [{args.source}]\n")
    out.write(f"model    {summary['model']}  ({summary['model_info']['type']})\n")
    out.write(f"cpu      {summary['cpu_info']}  threads={args.threads}  "
              f"busy-before {args.cpu_busy_before or '?'}%  loadavg {args.loadavg_before} -> {args.loadavg_after}\n\n")
    hdr = f"| {'tool':<20} | {'test':<20} | {'batch':>5} | {'tokens/s':>10} | {'± stddev':>8} |"
    sep = "|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|"
    out.write(hdr + "\n" + sep + "\n")

    def row(tool: str, test: str, b: int, ts: Any, sd: Any = None) -> None:
        sd_s = f"{sd:8.2f}" if sd is not None else f"{'':>8}"
        out.write(f"| {tool:<20} | {test:<20} | {b:>5} | {ts:>10.2f} | {sd_s} |\n")

    row("llama-bench", f"prefill pp{pp['n_prompt']}", 1, pp["avg_ts"], pp.get("stddev_ts"))
    row("llama-bench", f"decode tg{tg['n_gen']}", 1, tg["avg_ts"], tg.get("stddev_ts"))
    for r in batched:
        row("llama-batched-bench", f"prefill pp{r['pp']}", int(r["pl"]), float(r["speed_pp"]))
        row("llama-batched-bench", f"decode tg{r['tg']} @pp{r['pp']}", int(r["pl"]), float(r["speed_tg"]))
    if warnings:
        out.write("\nWARNING: numbers look contended (other load on the CPUs): "
                  + "; ".join(warnings)
                  + f".\n         median decode {summary['decode_tokens_per_s_median']} t/s, "
                  f"best {summary['decode_tokens_per_s_max']} t/s; re-run on an idle machine "
                  "(e.g. --wait-idle 900 --reps 10).\n")
    out.write(f"\nwrote {os.path.abspath(args.out)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
