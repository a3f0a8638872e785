#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh needs on a GPU machine that has no Rust toolchain and no network, into one
# folder (default .gpu-bundle, git-ignored):
#   bin/strata.gz      the CLI, release, --features cuda, stripped, gzipped (generate, bench, local, client)
#   bin/cuda-tests.gz  engine/tests/cuda.rs built the same way (the GPU parity tests, run with --ignored); both
#                      gzipped because the transfer limit counts bytes (a third of them), gpu-check.sh unpacks them
#   model.gguf         a real-weight slice of SmolLM2-135M (Q4_1): its first GPU_BUNDLE_LAYERS layers and the
#                      first GPU_BUNDLE_VOCAB rows of its vocabulary (scripts/gguf-slice.py)
#   model-q4_k_m.gguf  a GPU_BUNDLE_KQUANT_LAYERS-layer slice as llama.cpp's Q4_K_M (`llama-quantize
#                      --allow-requantize`: Q4_K and, in layer 2, Q6_K down projections, Q5_0/Q8_0 elsewhere), for
#                      the K-quant kernels
#   expect/            what the CPU backend of this very build gives for that model: expect.json (greedy tokens,
#                      top-2 margins, the offload limit of the cluster check), cpu-logits.f32, cli-cpu.json
#                      (`strata generate --device cpu`), check.env (the same facts as shell variables)
#   manifest.txt       commit, build date, toolchain, minimum glibc, sizes
# It checks that every binary needs no glibc newer than GPU_BUNDLE_MAX_GLIBC (the GPU machine's) and that the
# bundle plus the working tree fit the GPU machine's transfer limit (64 MiB), and prints both.
#
# Usage: scripts/gpu-bundle.sh [DIR]
# Environment: CARGO_TARGET_DIR; STRATA_TEST_MODEL (the full SmolLM2 GGUF; scripts/fetch-model.sh otherwise);
#   STRATA_LLAMA_BIN (a folder holding llama-quantize; scripts/llama-cpp-build.sh builds it, cached, otherwise);
#   GPU_BUNDLE_LAYERS (default 4), GPU_BUNDLE_KQUANT_LAYERS (default 3: llama.cpp gives layer 2 of 3 its Q6_K
#   down projection; fewer layers would have none), GPU_BUNDLE_VOCAB (default 6144), GPU_BUNDLE_MAX_GLIBC (default 2.39, Ubuntu
#   24.04), GPU_BUNDLE_LIMIT_BYTES (default 67108864), GPU_BUNDLE_PROFILE (cargo profile, default release; CI
#   uses dev, which its tests have mostly built already: such a bundle checks the build and the sizes, and its
#   benchmark numbers mean nothing).
# Exit status: 0 built and fits; 1 a build or check failed (the message says which).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
dir="${1:-.gpu-bundle}"
layers="${GPU_BUNDLE_LAYERS:-4}"
kquant_layers="${GPU_BUNDLE_KQUANT_LAYERS:-3}"
vocab="${GPU_BUNDLE_VOCAB:-6144}"
max_glibc="${GPU_BUNDLE_MAX_GLIBC:-2.39}"
limit="${GPU_BUNDLE_LIMIT_BYTES:-67108864}"
profile="${GPU_BUNDLE_PROFILE:-release}"
started=$SECONDS
say() { printf '== gpu-bundle [%3ds] %s\n' "$((SECONDS - started))" "$*"; }
die() { echo "gpu-bundle: $*" >&2; exit 1; }
for tool in cargo python3 strip objdump git gzip; do
  command -v "$tool" >/dev/null || die "$tool not found (scripts/setup installs what the build needs)"
done

# The executable paths cargo reports for a build (JSON messages on stdout), one per line.
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}

say "build: strata ($profile profile, --features cuda)"
bin_json="$(cargo build --profile "$profile" --locked --features cuda -p strata-cli --message-format=json-render-diagnostics)"
strata_bin="$(executables <<<"$bin_json" | awk '$1 == "strata" { print $2 }' | tail -n1)"
[[ -x "$strata_bin" ]] || die "cargo reported no strata executable"

say "build: GPU tests (engine/tests/cuda.rs, $profile profile, --features cuda)"
test_json="$(cargo test --profile "$profile" --locked --features cuda -p strata-engine --test cuda --no-run \
  --message-format=json-render-diagnostics)"
tests_bin="$(executables <<<"$test_json" | awk '$1 == "cuda" { print $2 }' | tail -n1)"
[[ -x "$tests_bin" ]] || die "cargo reported no executable for engine/tests/cuda.rs"

say "assemble $dir"
if [[ -d "$dir" && ! -f "$dir/.gpu-bundle" && -n "$(ls -A "$dir")" ]]; then
  die "$dir exists and is not a bundle (no .gpu-bundle marker): refusing to replace it"
fi
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/expect"
: > "$dir/.gpu-bundle"
cp "$strata_bin" "$dir/bin/strata"
cp "$tests_bin" "$dir/bin/cuda-tests"
strip "$dir/bin/strata" "$dir/bin/cuda-tests"

say "minimum glibc"
glibc="$(objdump -T "$dir"/bin/* | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n1)"
[[ -n "$glibc" ]] || die "no GLIBC_ symbol versions found in the binaries (objdump -T)"
echo "binaries need glibc >= $glibc (GPU machine: $max_glibc; this machine: $(ldd --version | head -n1 | awk '{print $NF}'))"
if [[ "$(printf '%s\n%s\n' "$glibc" "$max_glibc" | sort -V | tail -n1)" != "$max_glibc" ]]; then
  die "the binaries need glibc $glibc, newer than the GPU machine's $max_glibc"
fi

say "model: SmolLM2-135M's first $layers layers, first $vocab vocabulary rows"
full="${STRATA_TEST_MODEL:-$(scripts/fetch-model.sh)}"
[[ -s "$full" ]] || die "SmolLM2 GGUF not found: set STRATA_TEST_MODEL or run scripts/fetch-model.sh"
python3 scripts/gguf-slice.py "$full" "$dir/model.gguf" --layers "$layers" --vocab "$vocab"

say "model: its first $kquant_layers layers as llama.cpp's Q4_K_M"
LLAMA_BIN="${STRATA_LLAMA_BIN:-}"
# Built once into the cache (what scripts/test builds for engine/tests/gguf_kquants.rs); sets LLAMA_BIN.
[[ -n "$LLAMA_BIN" ]] || eval "$(scripts/llama-cpp-build.sh llama-quantize)"
python3 scripts/gguf-slice.py "$full" "$dir/kquant-source.gguf" --layers "$kquant_layers" --vocab "$vocab"
"$LLAMA_BIN/llama-quantize" --allow-requantize "$dir/kquant-source.gguf" "$dir/model-q4_k_m.gguf" Q4_K_M 2 \
  > "$dir/llama-quantize.log" 2>&1 || { cat "$dir/llama-quantize.log" >&2; die "llama-quantize Q4_K_M failed"; }
rm -f "$dir/llama-quantize.log" "$dir/kquant-source.gguf"

say "CPU expectations (the CPU backend of this build)"
STRATA_TEST_MODEL="$dir/model.gguf" STRATA_GPU_EXPECT="$dir/expect" \
  "$dir/bin/cuda-tests" --ignored --exact write_cpu_expectations --nocapture --test-threads=1
# The facts gpu-check.sh needs, as shell assignments (it runs without python or jq).
python3 - "$dir/expect/expect.json" > "$dir/expect/check.env" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))
print(f"PROMPT_IDS={','.join(map(str, e['prompt_ids']))}")
print(f"MAX_TOKENS={len(e['tokens'])}")
print(f"CPU_TOKENS={','.join(map(str, e['tokens']))}")
print(f"WORKER_DTYPE={e['worker']['dtype']}")
print(f"WORKER_KV_BLOCKS={e['worker']['kv_blocks']}")
print(f"OFFLOAD_GPU_MEMORY_LIMIT={e['worker']['offload_gpu_memory_limit']}")
print(f"NUM_LAYERS={e['num_layers']}")
PY
cat "$dir/expect/check.env"
# shellcheck source=/dev/null
source "$dir/expect/check.env"
"$dir/bin/strata" --log warn generate --model "$dir/model.gguf" --device cpu --prompt-ids "$PROMPT_IDS" \
  --max-tokens "$MAX_TOKENS" --format json > "$dir/expect/cli-cpu.json"
echo "cli: $(cat "$dir/expect/cli-cpu.json")"

say "compress the binaries (gpu-check.sh unpacks them)"
gzip -9 -n "$dir/bin/strata" "$dir/bin/cuda-tests"

say "size"
bundle_bytes="$(du -sb "$dir" | cut -f1)"
tree_bytes="$( (git ls-files -z; git ls-files -z --others --exclude-standard) | sort -zu |
  xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')"
total=$((bundle_bytes + tree_bytes))
{
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(rustc --version), profile $profile"
  echo "glibc: >= $glibc"
  echo "model: $(basename "$full"), layers $layers, vocab $vocab"
  du -b "$dir"/bin/* "$dir"/model*.gguf "$dir"/expect/* | sed "s|$dir/||"
  echo "bundle bytes: $bundle_bytes"
} > "$dir/manifest.txt"
cat "$dir/manifest.txt"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "bundle $(mib "$bundle_bytes") + working tree $(mib "$tree_bytes") = $(mib "$total") of $(mib "$limit")"
((total <= limit)) || die "bundle and working tree ($total bytes) exceed the $limit-byte limit"
say "done: $dir (carry it with the working tree; run scripts/gpu-check.sh --bundle $dir on the GPU machine)"
