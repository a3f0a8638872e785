#!/usr/bin/env bash
# shellcheck disable=SC2317  # the steps are functions called through `step NAME MAX FUNCTION`
# The GPU check of the CUDA backend. On a machine with an NVIDIA GPU and no Rust, no network:
#
#   scripts/gpu-check.sh --bundle .gpu-bundle        # a bundle from scripts/gpu-bundle.sh, built elsewhere
#   scripts/gpu-check.sh                             # from source: builds the bundle first (needs cargo and a driver)
#   scripts/gpu-check.sh --find-cuda                 # only print the CUDA libraries and headers it would use
#
# It needs bash, coreutils and grep/sed/awk (no python, no jq). It finds the NVIDIA driver (libcuda.so.1) and
# CUDA 13's NVRTC, cuBLAS and headers (CUDA_HOME, /usr/local/cuda, or the NVIDIA pip wheels of any python on
# the machine), then runs these steps, printing the elapsed time of each, and goes on after a failed one:
#   ops-f32, ops-f16, ops-bf16  every backend op against the CPU backend on random inputs (float and every
#                               quantized matmul route, embeddings, norms, rope, attention), stated tolerances
#   tiny-model                  random:tiny: GPU = CPU; 2 stages and offloaded layers give the same bits
#   mixed-tiny-model            a tiny GGUF mixing Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 and Q8_0 matrices:
#                               GPU = its f32 twin on the CPU (f32 tolerance), near the CPU's blocks; 2 stages the
#                               same bits
#   model-vs-cpu                the bundle's real-weight model (f32 activations): greedy tokens equal the CPU's
#                               from the bundle (logits within tolerance) and the CPU's computed here
#   kquant-model-vs-cpu         the bundle's model as llama.cpp's Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0): greedy tokens
#                               equal the CPU's computed here (up to a near tie, which it reports)
#   model-splits-offload        the same model: 2 memory-limited backends = 1 stage = offloaded, bit for bit
#   cli-vs-cpu                  `strata generate --device cuda:0` prints what the CPU build printed
#   cluster-1-stage             `strata local` with 1 stage worker on cuda:0: the CPU's greedy tokens
#   cluster-2-stages            2 stage workers on cuda:0 with --gpu-memory-limit each: the same tokens, and
#                               the process's device memory (nvidia-smi) within 2 x the limit + the context
#   cluster-offload             1 worker whose --gpu-memory-limit leaves one layer resident: the same tokens,
#                               device memory within the limit + the context
#   bench-7b                    `strata bench` on random:7b:bf16: prefill 2048 tokens, decode batch 1 and 64,
#                               peak device memory (nvidia-smi)
# then prints one table and writes gpu-check.log, gpu-check.json and bench-7b.json into the output folder.
#
# Options: --bundle DIR; --out DIR (default $OUT, else target/gpu-check); --skip-7b; --only STEP,STEP (run only
#   these steps, e.g. to retry the failed ones); --find-cuda; --help.
# Environment: CUDA_HOME / CUDA_PATH (a toolkit to prefer); STRATA_CUDA_SEARCH_ROOTS (colon-separated folders
#   searched for CUDA libraries and headers *instead of* the default places: toolkit layouts root/lib64,
#   root/include, and wheel layouts root/nvidia/*/lib, root/nvidia/*/include); STRATA_DRIVER_DIRS (folders
#   searched for libcuda.so.1 besides ldconfig's cache, space-separated); GPU_CHECK_BUDGET_S (seconds for all
#   steps, default 450); GPU_CHECK_SKIP_7B=1 (as --skip-7b); GPU_CHECK_PORT (first of 6 loopback ports the
#   clusters use, default 47100); GPU_CHECK_CONTEXT_MIB (device memory a process may hold beyond its stages'
#   --gpu-memory-limit for the CUDA context, cuBLAS and kernels, default 1024); XDG_CACHE_HOME (kernel PTX cache; default a folder under /tmp).
# Exit status: 0 every step passed; 1 a step failed (the table says which); 2 bad arguments or an incomplete
#   bundle; 3 no NVIDIA driver or no GPU answered (nothing was run).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle=""
out="${OUT:-$repo/target/gpu-check}"
skip_7b="${GPU_CHECK_SKIP_7B:-0}"
find_only=false
only=""
usage() { sed -n '3,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --bundle) bundle="${2:?--bundle needs a folder}"; shift 2 ;;
    --bundle=*) bundle="${1#--bundle=}"; shift ;;
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --skip-7b) skip_7b=1; shift ;;
    --only) only="${2:?--only needs step names}"; shift 2 ;;
    --only=*) only="${1#--only=}"; shift ;;
    --find-cuda) find_only=true; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
started=$SECONDS
say() { printf '== gpu-check [%4ds] %s\n' "$((SECONDS - started))" "$*"; }
json_str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\n\t' '  ')"; }

# --- CUDA libraries -------------------------------------------------------------------------------------------
# Sets cuda_lib_dirs (folders for LD_LIBRARY_PATH), cuda_include (holds cuda_fp16.h), cuda_found and
# cuda_missing (what was and was not found, as text). Returns 1 when something is missing.
site_packages() {
  local py
  for py in python3 /opt/*/.venv/bin/python3 /opt/*/bin/python3; do
    command -v "$py" >/dev/null 2>&1 || continue
    "$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null
  done
  local d
  for d in /opt/*/.venv/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages \
    /usr/lib/python3/dist-packages "${STRATA_CACHE:-/var/cache/strata}"/cuda/venv-*/lib/python3*/site-packages; do
    [[ -d "$d" ]] && echo "$d"
  done
}
cuda_roots() {
  if [[ -n "${STRATA_CUDA_SEARCH_ROOTS:-}" ]]; then
    tr ':' '\n' <<<"$STRATA_CUDA_SEARCH_ROOTS"
    return
  fi
  [[ -n "${CUDA_HOME:-}" ]] && echo "$CUDA_HOME"
  [[ -n "${CUDA_PATH:-}" ]] && echo "$CUDA_PATH"
  echo /usr/local/cuda
  compgen -G '/usr/local/cuda-1[3-9]*' | sort -rV
  site_packages
}
# Folders of one root that may hold libraries (kind lib) or headers (kind include): toolkit and wheel layouts.
root_dirs() {
  local root="$1" kind="$2" d
  local subs=(lib64 lib targets/x86_64-linux/lib)
  [[ "$kind" == include ]] && subs=(include targets/x86_64-linux/include)
  for d in "${subs[@]}"; do [[ -d "$root/$d" ]] && echo "$root/$d"; done
  for d in "$root"/nvidia/cu1[3-9]/"$kind" "$root"/nvidia/*/"$kind"; do [[ -d "$d" ]] && echo "$d"; done
  return 0
}
find_cuda() {
  cuda_lib_dirs=() cuda_include="" cuda_found="" cuda_missing=""
  local roots=() root dir lib nvrtc_root="" found
  mapfile -t roots < <(cuda_roots | awk 'NF && !seen[$0]++')
  # libcuda is the driver's (found separately); these come from the toolkit or the wheels.
  for lib in libnvrtc libnvrtc-builtins libcublas libcublasLt; do
    found=""
    for root in "${roots[@]}"; do
      while read -r dir; do
        if compgen -G "$dir/$lib.so.1[3-9]*" >/dev/null; then found="$dir"; break; fi
      done < <(root_dirs "$root" lib)
      if [[ -n "$found" ]]; then
        [[ "$lib" == libnvrtc ]] && nvrtc_root="$root"
        break
      fi
    done
    if [[ -n "$found" ]]; then
      cuda_found+="$lib: $(cd "$found" && compgen -G "$lib.so.1[3-9]*" | sort -V | tail -n1) in $found"$'\n'
      [[ " ${cuda_lib_dirs[*]} " == *" $found "* ]] || cuda_lib_dirs+=("$found")
    else
      cuda_missing+="$lib.so.13 (CUDA 13) "
    fi
  done
  # Headers: preferably from NVRTC's own root, so that both come from one CUDA release.
  for root in ${nvrtc_root:+"$nvrtc_root"} "${roots[@]}"; do
    while read -r dir; do
      if [[ -f "$dir/cuda_fp16.h" && -f "$dir/cuda_bf16.h" ]]; then cuda_include="$dir"; break 2; fi
    done < <(root_dirs "$root" include)
  done
  if [[ -n "$cuda_include" ]]; then
    cuda_found+="headers: $cuda_include"$'\n'
  else
    cuda_missing+="cuda_fp16.h and cuda_bf16.h "
  fi
  [[ -z "$cuda_missing" ]]
}
# The NVRTC release (e.g. 13.0) from its builtins library's name, or "".
nvrtc_release() {
  grep -o 'libnvrtc-builtins\.so\.1[3-9]\.[0-9]*' <<<"$cuda_found" | head -n1 | sed 's/libnvrtc-builtins\.so\.//'
}

if $find_only; then
  find_cuda
  status=$?
  printf '%s' "$cuda_found"
  [[ -n "$cuda_missing" ]] && echo "missing: $cuda_missing"
  echo "LD_LIBRARY_PATH += $(IFS=:; echo "${cuda_lib_dirs[*]}")"
  echo "STRATA_CUDA_INCLUDE = $cuda_include"
  exit "$status"
fi

# --- the driver: libcuda.so.1 from ldconfig's cache or $driver_dirs ---------------------------------------------
driver_dirs="${STRATA_DRIVER_DIRS:-/usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib}"
find_driver() {
  if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then echo "ldconfig"; return 0; fi
  local d
  for d in $driver_dirs; do
    [[ -e "$d/libcuda.so.1" ]] && { echo "$d"; return 0; }
  done
  return 1
}

# --- the bundle -----------------------------------------------------------------------------------------------
if [[ -z "$bundle" ]]; then
  command -v cargo >/dev/null || { echo "gpu-check: no --bundle and no cargo to build one (see --help)" >&2; exit 2; }
  find_driver >/dev/null || { echo "gpu-check: no NVIDIA driver (libcuda.so.1 not found): not building a bundle"; exit 3; }
  bundle="$repo/target/gpu-bundle"
  say "no --bundle: building one in $bundle (scripts/gpu-bundle.sh)"
  "$repo/scripts/gpu-bundle.sh" "$bundle" || { echo "gpu-check: building the bundle failed" >&2; exit 2; }
fi
bundle="$(cd "$bundle" 2>/dev/null && pwd)" || { echo "gpu-check: bundle folder not found" >&2; exit 2; }
strata_gz="$bundle/bin/strata.gz"
tests_gz="$bundle/bin/cuda-tests.gz"
model="$bundle/model.gguf"
kquant_model="$bundle/model-q4_k_m.gguf"
for f in "$strata_gz" "$tests_gz" "$model" "$kquant_model" "$bundle/expect/check.env" "$bundle/expect/cli-cpu.json" "$bundle/manifest.txt"; do
  [[ -s "$f" ]] || { echo "gpu-check: $f missing: rebuild the bundle with scripts/gpu-bundle.sh" >&2; exit 2; }
done
# PROMPT_IDS, MAX_TOKENS, CPU_TOKENS, WORKER_DTYPE, WORKER_KV_BLOCKS, OFFLOAD_GPU_MEMORY_LIMIT, NUM_LAYERS
# shellcheck source=/dev/null
source "$bundle/expect/check.env"

mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
# The bundle carries its binaries gzipped (scripts/gpu-bundle.sh); they run from $work.
strata="$work/bin/strata"
tests="$work/bin/cuda-tests"
mkdir -p "$work/bin"
if ! { gzip -dc "$strata_gz" > "$strata" && gzip -dc "$tests_gz" > "$tests" && chmod +x "$strata" "$tests"; }; then
  echo "gpu-check: cannot unpack the bundle's binaries into $work" >&2
  rm -rf "$work"
  exit 2
fi
log="$out/gpu-check.log"
: > "$log"
rm -f "$out/gpu-check.json" "$out/gpu-check-steps.log" "$out/bench-7b.json"
exec > >(tee -a "$log") 2>&1
bg_pids=()
cleanup() {
  local p
  for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
say "bundle $bundle: $(head -n1 "$bundle/manifest.txt")"
if ! grep -q '^built: .*profile release' "$bundle/manifest.txt"; then
  echo "warning: this bundle is not a release build: its benchmark numbers mean nothing"
fi

# --- the driver -----------------------------------------------------------------------------------------------
no_driver() {
  echo "gpu-check: no NVIDIA driver: $1. This check needs an NVIDIA GPU and its driver; nothing was run."
  echo "{\"result\": \"no-driver\", \"reason\": $(json_str "$1")}" > "$out/gpu-check.json"
  exit 3
}
say "NVIDIA driver"
driver_dir="$(find_driver)" || no_driver "libcuda.so.1 is neither in ldconfig's cache nor in $driver_dirs"
[[ "$driver_dir" == ldconfig ]] || export LD_LIBRARY_PATH="$driver_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for d in /usr/local/nvidia/bin /usr/local/cuda/bin; do [[ -d "$d" ]] && PATH="$PATH:$d"; done
gpu="unknown (no nvidia-smi)"
driver_cuda=""
if command -v nvidia-smi >/dev/null; then
  gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n1)" ||
    no_driver "libcuda.so.1 is there but nvidia-smi found no GPU: $gpu"
  driver_cuda="$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}')"
fi
echo "libcuda.so.1: $driver_dir; GPU: $gpu; driver's CUDA: ${driver_cuda:-unknown}"

# --- steps ----------------------------------------------------------------------------------------------------
budget="${GPU_CHECK_BUDGET_S:-450}"
results=()  # name|status|seconds|detail
failed=0
detail=""
step_deadline=0
# A command with what is left of the step's time; 124 when it ran out.
tmo() {
  local left=$((step_deadline - SECONDS))
  ((left > 0)) || return 124
  timeout -k 5 "$left" "$@"
}
# step NAME MAX_SECONDS FUNCTION: runs FUNCTION with its output in the log, within MAX_SECONDS and the budget.
step() {
  local name="$1" max="$2" fn="$3" left rc t0
  if [[ -n "$only" && ",$only," != *",$name,"* ]]; then
    results+=("$name|skipped|0|not in --only")
    return
  fi
  left=$((budget - (SECONDS - started)))
  if ((left < 15)); then
    results+=("$name|skipped|0|no time left of the ${budget} s budget")
    failed=1
    return
  fi
  ((max > left)) && max=$left
  say "$name (at most $max s)"
  detail=""
  t0=$SECONDS
  step_deadline=$((SECONDS + max))
  "$fn" > "$work/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  if ((rc == 0)); then
    results+=("$name|pass|$took|$detail")
    echo "   pass in $took s${detail:+: $detail}"
  else
    # Without a detail of its own, a failed step says the first error its output names.
    [[ -z "$detail" ]] && detail="$(grep -o -m1 -E '([Ee]rror: |panicked at ).*' "$work/$name.log" | cut -c1-300)"
    ((rc == 124 || rc == 137)) && detail="timed out after $max s; $detail"
    results+=("$name|FAIL|$took|${detail:-exit status $rc}")
    failed=1
    echo "   FAILED (exit status $rc) in $took s${detail:+: $detail}; the end of its output:"
    tail -n 40 "$work/$name.log" | sed 's/^/   | /'
  fi
  { echo "---- $name: exit status $rc, $took s"; cat "$work/$name.log"; } >> "$work/steps.log"
}

say "CUDA libraries"
if find_cuda; then
  cuda_ok=true
else
  cuda_ok=false
fi
printf '%s' "$cuda_found"
[[ -n "$cuda_missing" ]] && echo "missing: $cuda_missing(steps will fail; set CUDA_HOME or install the wheels)"
if ((${#cuda_lib_dirs[@]})); then
  LD_LIBRARY_PATH="$(IFS=:; echo "${cuda_lib_dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
fi
[[ -n "$cuda_include" ]] && export STRATA_CUDA_INCLUDE="$cuda_include"
nvrtc="$(nvrtc_release)"
if [[ -n "$nvrtc" && -n "$driver_cuda" && "$(printf '%s\n%s\n' "$nvrtc" "$driver_cuda" | sort -V | tail -n1)" != "$driver_cuda" ]]; then
  echo "warning: NVRTC $nvrtc is newer than the driver's CUDA $driver_cuda: the driver may reject its PTX"
fi
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$work/cache}"
# anyhow's backtraces of a stripped binary are all <unknown>; panics still follow RUST_BACKTRACE.
export RUST_LIB_BACKTRACE=0
export STRATA_TEST_MODEL="$model" STRATA_GPU_EXPECT="$bundle/expect" STRATA_TEST_KQUANT_MODEL="$kquant_model"
results+=("cuda-libraries|$($cuda_ok && echo pass || echo FAIL)|0|NVRTC ${nvrtc:-?}, driver CUDA ${driver_cuda:-?}${cuda_missing:+; missing $cuda_missing}")
$cuda_ok || failed=1

# The last line of a test's output that matches $2, as the step's detail.
test_detail() { grep -E "$2" "$work/$1.log" | tail -n1 | sed 's/^ *//'; }
gpu_test() { tmo "$tests" --ignored --exact "$1" --nocapture --test-threads=1; }
step_ops_f32() { gpu_test every_op_matches_the_cpu_in_f32; }
step_ops_f16() { gpu_test every_op_matches_the_cpu_in_f16; }
step_ops_bf16() { gpu_test every_op_matches_the_cpu_in_bf16; }
step_tiny() { gpu_test tiny_model_matches_cpu_and_splits_and_offload_change_nothing; }
step_mixed() {
  gpu_test quant::mixed_k_quant_tiny_model_matches_the_cpu || return
  detail="$(test_detail mixed-tiny-model '^mixed tiny model:')"
}
step_kquant() {
  gpu_test quant::q4_k_m_model_greedy_tokens_match_the_cpu || return
  detail="$(test_detail kquant-model-vs-cpu 'greedy tokens equal')"
}
step_model() {
  gpu_test bundle_model_matches_the_cpu_expectations || return
  detail="$(test_detail model-vs-cpu 'greedy tokens equal')"
  # The same against the CPU backend of this machine.
  gpu_test smollm2_greedy_tokens_match_the_cpu
}
step_splits() { gpu_test bundle_model_splits_and_offload_change_nothing; }
token_ids() { grep -o '"token_ids":\[[0-9,]*\]' "$1" | sed 's/.*\[\(.*\)\]/\1/'; }
step_cli() {
  tmo "$strata" --log warn generate --model "$model" --device cuda:0 --dtype "$WORKER_DTYPE" \
    --prompt-ids "$PROMPT_IDS" --max-tokens "$MAX_TOKENS" --format json > "$work/cli-cuda.json" || return
  echo "cpu:  $(cat "$bundle/expect/cli-cpu.json")"
  echo "cuda: $(cat "$work/cli-cuda.json")"
  cmp -s "$work/cli-cuda.json" "$bundle/expect/cli-cpu.json" || { detail="output differs from the CPU's"; return 1; }
  detail="tokens $(token_ids "$work/cli-cuda.json")"
}

port="${GPU_CHECK_PORT:-47100}"
# cluster NAME STAGES [--gpu-memory-limit BYTES]: greedy tokens through `strata local` on cuda:0, compared with
# the CPU's; the cluster's log is kept in $work/NAME-local.log.
cluster() {
  local name="$1" stages="$2" grpc=$port http=$((port + 1)) pid client rc
  shift 2
  port=$((port + 2))
  "$strata" --log info --log-format json local --model "$model" --stages "$stages" --device cuda:0 \
    --dtype "$WORKER_DTYPE" --kv-blocks "$WORKER_KV_BLOCKS" --threads 1 --grpc "127.0.0.1:$grpc" \
    --http "127.0.0.1:$http" "$@" 2> "$work/$name-local.log" &
  pid=$!
  bg_pids+=("$pid")
  tmo "$strata" --log error client generate --coordinator "http://127.0.0.1:$grpc" --prompt-ids "$PROMPT_IDS" \
    --max-tokens "$MAX_TOKENS" --format json --wait "$((step_deadline - SECONDS))" > "$work/$name.json" &
  client=$!
  bg_pids+=("$client")
  # The client waits for the cluster to come up. A cluster that exits, or a stage worker that stops while
  # starting (strata local would wait a minute for it and not say why), ends the wait.
  while kill -0 "$client" 2>/dev/null && kill -0 "$pid" 2>/dev/null &&
    ! grep -q '"message":"stopped"' "$work/$name-local.log" 2>/dev/null; do
    sleep 0.2
  done
  if kill -0 "$client" 2>/dev/null; then
    kill "$client" "$pid" 2>/dev/null
    wait "$client" 2>/dev/null
    wait "$pid" 2>/dev/null
    echo "the cluster failed before answering; its log:"
    tail -n 30 "$work/$name-local.log"
    if grep -q '"message":"stopped"' "$work/$name-local.log"; then
      detail="a stage worker stopped while starting (see cli-vs-cpu for the device error)"
    else
      detail="strata local exited: $(grep -v '^{' "$work/$name-local.log" | tail -n1 | cut -c1-300)"
    fi
    return 1
  fi
  wait "$client"
  rc=$?
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  echo "cluster log:"
  grep -E '"stage loaded"|ERROR|WARN' "$work/$name-local.log" | tail -n 20
  ((rc == 0)) || return "$rc"
  local got
  got="$(token_ids "$work/$name.json")"
  echo "cpu:  $CPU_TOKENS"
  echo "cuda: $got"
  # The CLI stops at an end-of-sequence token; the test's tokens run on past it, so compare the common prefix.
  [[ -n "$got" && "$CPU_TOKENS," == "$got,"* ]] || { detail="tokens $got, CPU $CPU_TOKENS"; return 1; }
  detail="tokens equal the CPU's"
}
# Each stage worker's last "stage loaded" log line: node, layer range, offloaded layers, e.g.
# "local-0 0..2 (offloaded 2..2);local-1 2..4 (offloaded 4..4)".
stages_loaded() {
  grep '"stage loaded"' "$work/$1-local.log" |
    sed -n 's/.*"node":"\([^"]*\)","layers":"\([0-9.]*\)".*"offloaded_layers":"\([0-9.]*\)".*/\1 \2 (offloaded \3)/p' |
    awk '{ last[$1] = $0 } END { for (n in last) print last[n] }' | sort | paste -sd ';'
}
# Device memory of each process while a cluster runs, from nvidia-smi's compute-apps list every 200 ms (the
# CUDA context included, which --gpu-memory-limit does not count: GPU_CHECK_CONTEXT_MIB allows for it).
CONTEXT_MIB="${GPU_CHECK_CONTEXT_MIB:-1024}"
apps_pid=""
apps_start() {
  : > "$work/$1-apps.txt"
  apps_pid=""
  command -v nvidia-smi >/dev/null || return 0
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 \
    > "$work/$1-apps.txt" 2>/dev/null &
  apps_pid=$!
  bg_pids+=("$apps_pid")
}
apps_stop() {
  [[ -n "$apps_pid" ]] || return 0
  kill "$apps_pid" 2>/dev/null
  wait "$apps_pid" 2>/dev/null
  apps_pid=""
}
# within_limit NAME STAGES LIMIT_BYTES: `strata local` runs every stage worker in its one process, so its device
# memory may be STAGES x --gpu-memory-limit plus the context; each process's peak must stay within that.
within_limit() {
  local name="$1" stages="$2" limit_mib=$(($3 >> 20)) allowed worst peaks
  allowed=$((stages * limit_mib + CONTEXT_MIB))
  peaks="$(awk -F', *' '$2 ~ /^[0-9]+$/ { if ($2 > m[$1]) m[$1] = $2 } END { for (p in m) print m[p] }' \
    "$work/$name-apps.txt" 2>/dev/null | sort -n)"
  if [[ -z "$peaks" ]]; then
    detail+="; no per-process device memory from nvidia-smi (not checked)"
    return 0
  fi
  worst="$(tail -n1 <<<"$peaks")"
  detail+="; peak device memory ${worst} MiB per process (allowed ${stages} x ${limit_mib} + ${CONTEXT_MIB} context)"
  ((worst <= allowed)) || { detail="a process peaked at $worst MiB of device memory, over $allowed MiB"; return 1; }
}
step_cluster1() { cluster cluster-1-stage 1 || return; detail+="; stage $(stages_loaded cluster-1-stage)"; }
step_cluster2() {
  local limit=$((2 << 30)) s rc
  apps_start cluster-2-stages
  cluster cluster-2-stages 2 --gpu-memory-limit "$limit"
  rc=$?
  apps_stop
  ((rc == 0)) || return "$rc"
  s="$(stages_loaded cluster-2-stages)"
  detail+="; stages $s"
  [[ "$(tr ';' '\n' <<<"$s" | grep -c .)" == 2 ]] || { detail="expected 2 loaded stages, saw: $s"; return 1; }
  within_limit cluster-2-stages 2 "$limit"
}
step_offload() {
  local s rc
  apps_start cluster-offload
  cluster cluster-offload 1 --gpu-memory-limit "$OFFLOAD_GPU_MEMORY_LIMIT"
  rc=$?
  apps_stop
  ((rc == 0)) || return "$rc"
  s="$(stages_loaded cluster-offload)"
  detail+="; stage $s with --gpu-memory-limit $OFFLOAD_GPU_MEMORY_LIMIT"
  [[ "$s" == *"(offloaded 1..$NUM_LAYERS)"* ]] || { detail="expected layers 1..$NUM_LAYERS offloaded, saw: $s"; return 1; }
  within_limit cluster-offload 1 "$OFFLOAD_GPU_MEMORY_LIMIT"
}
step_bench() {
  local smi="" rc
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$work/memory.txt" 2>/dev/null &
    smi=$!
    bg_pids+=("$smi")
  fi
  tmo "$strata" --log info bench --model random:7b:bf16 --device cuda:0 --dtype bf16 --prompt-tokens 2048 \
    --decode-tokens 64 --batch 64 --out "$out/bench-7b.json"
  rc=$?
  [[ -n "$smi" ]] && kill "$smi" 2>/dev/null
  peak_mib="$(sort -n "$work/memory.txt" 2>/dev/null | tail -n1)"
  return "$rc"
}

step ops-f32 120 step_ops_f32
step ops-f16 60 step_ops_f16
step ops-bf16 60 step_ops_bf16
step tiny-model 60 step_tiny
step mixed-tiny-model 60 step_mixed
step model-vs-cpu 60 step_model
step kquant-model-vs-cpu 60 step_kquant
step model-splits-offload 60 step_splits
step cli-vs-cpu 60 step_cli
step cluster-1-stage 90 step_cluster1
step cluster-2-stages 90 step_cluster2
step cluster-offload 90 step_offload
peak_mib=""
if [[ "$skip_7b" == 1 ]]; then
  results+=("bench-7b|skipped|0|--skip-7b")
else
  step bench-7b 300 step_bench
fi
cp "$work/steps.log" "$out/gpu-check-steps.log" 2>/dev/null

# --- summary --------------------------------------------------------------------------------------------------
num() { grep -o "\"$1\": *[0-9.e+-]*" "$2" 2>/dev/null | head -n1 | sed 's/.*: *//'; }
seconds=$((SECONDS - started))
echo
say "summary"
echo "GPU: $gpu; bundle: $(head -n1 "$bundle/manifest.txt")"
echo
echo "| step | result | s | detail |"
echo "|---|---|---:|---|"
steps_json=""
for r in "${results[@]}"; do
  IFS='|' read -r name status took what <<<"$r"
  echo "| $name | $status | $took | $what |"
  steps_json+="${steps_json:+, }{\"name\": $(json_str "$name"), \"result\": $(json_str "$status"), \"seconds\": $took, \"detail\": $(json_str "$what")}"
done
bench_json="null"
if [[ -s "$out/bench-7b.json" ]]; then
  b="$out/bench-7b.json"
  weights="$(num weight_bytes "$b")"
  d1="$(num decode_tokens_per_s_batch1 "$b")"
  echo
  echo "| 7B bf16 (random weights) | measured | goal |"
  echo "|---|---:|---:|"
  awk -v p="$(num prefill_tokens_per_s "$b")" -v d1="$d1" -v d64="$(num decode_tokens_per_s_batched "$b")" \
    -v w="$weights" -v peak="${peak_mib:-}" 'BEGIN {
      printf "| prefill tok/s (2048 tokens) | %.0f | 20000 |\n", p
      printf "| decode tok/s, batch 1 | %.1f | 250 |\n", d1
      printf "| decode, batch 1: weight bytes read per s | %.0f GB/s | 3440 GB/s (80%% of 4.3 TB/s) |\n", w * d1 / 1e9
      printf "| decode tok/s, batch 64 | %.0f | 5000 |\n", d64
      printf "| peak device memory (nvidia-smi) | %s | - |\n", peak == "" ? "n/a" : sprintf("%.1f GiB", peak / 1024)
    }'
  bench_json="$(tr -d '\n' < "$b")"
fi
{
  echo "{\"result\": $(json_str "$([[ $failed == 0 ]] && echo pass || echo fail)"), \"seconds\": $seconds,"
  echo " \"gpu\": $(json_str "$gpu"), \"driver_cuda\": $(json_str "$driver_cuda"), \"nvrtc\": $(json_str "$nvrtc"),"
  echo " \"bundle\": $(json_str "$(head -n1 "$bundle/manifest.txt")"),"
  echo " \"steps\": [$steps_json],"
  echo " \"bench_7b\": $bench_json, \"bench_7b_peak_device_memory_mib\": ${peak_mib:-null}}"
} > "$out/gpu-check.json"
echo
echo "total $seconds s; wrote gpu-check.json, gpu-check.log, gpu-check-steps.log$([[ -s "$out/bench-7b.json" ]] && echo ", bench-7b.json") in $out"
exit "$failed"
