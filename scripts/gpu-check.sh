#!/usr/bin/env bash
# GPU check of the CUDA backend, from a clean checkout on any machine with an NVIDIA GPU:
#   1. builds strata with --features cuda --release;
#   2. runs the GPU parity tests (every op vs the CPU backend in f32/f16/bf16, a tiny model 1 stage = 2 stages =
#      offloaded, SmolLM2 greedy tokens on cuda:0 = CPU);
#   3. benchmarks decode (batch 1 and 64) and prefill on SmolLM2 and on a 7B-shaped random bf16 model;
#   4. prints a table and writes gpu-check.json (plus each bench's JSON) to $OUT (default target/gpu-check).
# Target: under 8 minutes on an H200 (most of it is the release build).
#
# Needs Rust (rust-toolchain.toml), an NVIDIA driver, and CUDA 13's NVRTC, cuBLAS and headers: from a CUDA
# toolkit (CUDA_HOME or /usr/local/cuda), or NVIDIA's pip wheels, which this script installs into
# $STRATA_CACHE/cuda when they are missing and PyPI is reachable.
#
# Environment: OUT, STRATA_CACHE (default /var/cache/strata), STRATA_TEST_MODEL (SmolLM2 GGUF; fetched with
# scripts/fetch-model.sh otherwise), GPU_CHECK_SKIP_7B=1 (skip the 7B bench), CARGO_TARGET_DIR.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="${OUT:-$repo/target/gpu-check}"
mkdir -p "$out"
export STRATA_CACHE="${STRATA_CACHE:-/var/cache/strata}"
started=$SECONDS
say() { printf '== [%4ds] %s\n' "$((SECONDS - started))" "$*"; }
die() { echo "gpu-check: $*" >&2; exit 1; }

say "device"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this needs an NVIDIA GPU and driver"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
command -v cargo >/dev/null || die "cargo not found: install Rust (see rust-toolchain.toml)"

say "CUDA libraries (NVRTC, cuBLAS, headers)"
have_lib() { ldconfig -p 2>/dev/null | grep -q "$1" || compgen -G "${CUDA_HOME:-/usr/local/cuda}/lib64/$1*" >/dev/null; }
for d in "${CUDA_HOME:-}" /usr/local/cuda; do
  if [[ -n "$d" && -f "$d/include/cuda_fp16.h" ]]; then
    export CUDA_HOME="$d"
    export LD_LIBRARY_PATH="$d/lib64:${LD_LIBRARY_PATH:-}"
    break
  fi
done
if ! have_lib libnvrtc.so || ! have_lib libcublas.so || [[ -z "${CUDA_HOME:-}" ]]; then
  version="${STRATA_CUDA_VERSION:-13.5.37}"
  venv="$STRATA_CACHE/cuda/venv-gpu-$version"
  if [[ ! -f "$venv/.strata-installed" ]]; then
    say "installing CUDA $version wheels into $venv"
    python3 -m venv "$venv" || die "no CUDA toolkit and no python3 venv to install the CUDA wheels"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc==$version" \
      "nvidia-cuda-runtime==$version" "nvidia-cuda-crt==$version" "nvidia-cublas>=13,<14" \
      || die "no CUDA toolkit found and the CUDA wheels could not be installed (is PyPI reachable?)"
    touch "$venv/.strata-installed"
  fi
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  root="$site/nvidia/cu13"
  [[ -f "$root/include/cuda_fp16.h" ]] || die "CUDA wheels installed but $root/include/cuda_fp16.h is missing"
  export STRATA_CUDA_INCLUDE="$root/include"
  export LD_LIBRARY_PATH="$root/lib:${LD_LIBRARY_PATH:-}"
fi
# Kernels compiled by NVRTC are cached here; the first run compiles them (a few seconds per module).
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$STRATA_CACHE/xdg}"

say "build (--features cuda --release)"
cargo build --release --locked --features cuda -p strata-cli
cargo test --release --locked --features cuda -p strata-engine --test cuda --no-run
target="${CARGO_TARGET_DIR:-$repo/target}/release"

say "test model"
export STRATA_TEST_MODEL="${STRATA_TEST_MODEL:-$(scripts/fetch-model.sh)}"
[[ -s "$STRATA_TEST_MODEL" ]] || die "SmolLM2 model not found: set STRATA_TEST_MODEL"

say "GPU parity tests (ops vs CPU, tiny model splits and offload, SmolLM2 cuda = cpu)"
tests_ok=true
if ! cargo test --release --locked --features cuda -p strata-engine --test cuda -- --ignored --test-threads=1 \
    2>&1 | tee "$out/tests.log"; then
  tests_ok=false
fi

say "SmolLM2 through the CLI: cuda:0 (f32 activations) vs cpu, greedy"
prompt=(--prompt "The capital of France is" --max-tokens 24 --format json)
"$target/strata" generate --model "$STRATA_TEST_MODEL" --device cpu "${prompt[@]}" > "$out/smollm2-cpu.json"
"$target/strata" generate --model "$STRATA_TEST_MODEL" --device cuda:0 --dtype f32 "${prompt[@]}" > "$out/smollm2-cuda.json"
cli_same=false
if cmp -s "$out/smollm2-cpu.json" "$out/smollm2-cuda.json"; then cli_same=true; fi
echo "cpu:  $(cat "$out/smollm2-cpu.json")"
echo "cuda: $(cat "$out/smollm2-cuda.json")"

bench() {  # name model dtype decode_tokens batch
  "$target/strata" bench --model "$2" --device cuda:0 --dtype "$3" --prompt-tokens 128 --decode-tokens "$4" \
    --batch "$5" --out "$out/bench-$1.json"
}
say "bench SmolLM2 (bf16 activations, Q4_1 weights)"
bench smollm2 "$STRATA_TEST_MODEL" bf16 128 64
if [[ "${GPU_CHECK_SKIP_7B:-0}" != 1 ]]; then
  say "bench 7B-shaped random model (bf16, ~13 GB of weights generated in memory)"
  bench 7b random:7b:bf16 bf16 64 64
fi

say "summary"
python3 - "$out" "$tests_ok" "$cli_same" "$((SECONDS - started))" <<'PY'
import glob, json, os, sys
out, tests_ok, cli_same, seconds = sys.argv[1], sys.argv[2] == "true", sys.argv[3] == "true", int(sys.argv[4])
benches = {}
for p in sorted(glob.glob(os.path.join(out, "bench-*.json"))):
    benches[os.path.basename(p)[6:-5]] = json.load(open(p))
print(f"| model | prefill tok/s | decode tok/s (batch 1) | decode tok/s (batch 64) | weights GiB |")
print(f"|---|---:|---:|---:|---:|")
for name, b in benches.items():
    print(f"| {name} | {b['prefill_tokens_per_s']:.0f} | {b['decode_tokens_per_s_batch1']:.1f} | "
          f"{b['decode_tokens_per_s_batched']:.1f} | {b['weight_bytes'] / 2**30:.2f} |")
print(f"parity tests: {'pass' if tests_ok else 'FAIL'}; SmolLM2 cli cuda = cpu: {cli_same}; {seconds} s")
gpu = open(os.path.join(out, "gpu.txt")).read().strip()
json.dump({"gpu": gpu, "tests_passed": tests_ok, "smollm2_cli_cuda_equals_cpu": cli_same,
           "seconds": seconds, "bench": benches}, open(os.path.join(out, "gpu-check.json"), "w"), indent=2)
PY
echo "wrote $out/gpu-check.json"
if ! $tests_ok || ! $cli_same; then die "GPU check failed (see $out/tests.log)"; fi
