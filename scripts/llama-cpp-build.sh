#!/usr/bin/env bash
# Builds llama.cpp tools from the source vendored in the PyPI sdist of llama-cpp-python, cached under
# ${STRATA_CACHE:-/var/cache/strata}/llama.cpp: the sdist, the extracted source and one CMake build tree shared by
# every caller (scripts/llama-cpp-baseline.sh builds llama-bench and llama-batched-bench; scripts/test builds
# llama-quantize and llama-completion for engine/tests/{quantize_fidelity,gguf_kquants}.rs). Every step is skipped
# when its output is there already, so a second run only checks the targets are up to date (seconds).
#
# Usage: scripts/llama-cpp-build.sh TARGET...
# Prints, on stdout, shell assignments for the caller to eval: LLAMA_BIN (the directory holding the built tools),
# LLAMA_COMMIT, LLAMA_COMMIT_FULL, LLAMA_COMMIT_DATE. Logs go to stderr.
#
# Environment:
#   STRATA_CACHE               cache root (default /var/cache/strata)
#   LLAMA_CPP_PYTHON_VERSION   llama-cpp-python sdist to take llama.cpp from
#                              (default 0.3.36 -> ggml-org/llama.cpp@0c1e57098)
#   LLAMA_CPP_ISA              native (default: every instruction set this CPU has but AMX) or avx2 (AVX2, FMA, F16C
#                              and no AVX-512 or VNNI, as on an AVX2-only CPU; its own build tree, -avx2)
#   BUILD_JOBS                 parallel compile jobs (default 2, capped at 2)
#   NICE                       nice level for the compile (default 19)
set -euo pipefail

# One brace group, so editing this file while a (long) build runs cannot derail that run.
{
[ $# -gt 0 ] || { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
TARGETS=("$@")
CACHE_ROOT="${STRATA_CACHE:-/var/cache/strata}"
LC_DIR="${CACHE_ROOT}/llama.cpp"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BUILD_JOBS="${BUILD_JOBS:-2}"
if [ "${BUILD_JOBS}" -gt 2 ] 2>/dev/null; then BUILD_JOBS=2; fi
NICE_LEVEL="${NICE:-19}"
LLAMA_ISA="${LLAMA_CPP_ISA:-native}"
NO_AMX="-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
case "${LLAMA_ISA}" in
    # Without AMX: at 0c1e57098 ggml's AMX matrix product (picked by -march=native on Sapphire Rapids and later)
    # segfaults on SmolLM2 (seen 2026-12-05 on a Xeon VM with amx_int8: llama-completion died in
    # ggml_backend_amx_mul_mat), so the tests' references and the benchmark's baseline run ggml's AVX-512 kernels.
    # Undefining the macros leaves ggml's AMX sources out; every other instruction set stays native.
    native) ISA_ARGS=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=${NO_AMX}" "-DCMAKE_CXX_FLAGS=${NO_AMX}"); ISA_SUFFIX="" ;;
    # The AVX2 level of strata's kernels (--cpu-isa avx2), for comparing like with like on a newer CPU.
    avx2) ISA_ARGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                    -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                    -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
          ISA_SUFFIX="-avx2" ;;
    *) echo "llama-cpp-build: LLAMA_CPP_ISA must be native or avx2, not '${LLAMA_ISA}'" >&2; exit 2 ;;
esac

log() { printf '[llama-cpp-build] %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null 2>&1 || { echo "llama-cpp-build: '$1' is required but not installed${2:+ ($2)}" >&2; exit 1; }; }

need python3
need tar
need cmake "apt-get install -y cmake"
need c++ "apt-get install -y build-essential"

# A fresh Debian has python3 but no pip: use the project venv's then (scripts/fetch-model.sh does the same).
PY=python3
python3 -m pip --version >/dev/null 2>&1 || PY="$("$(dirname "${BASH_SOURCE[0]}")/python-env.sh" --bare)"
PIP=("${PY}" -m pip)

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
    SDIST="$(find_sdist)" || { echo "llama-cpp-build: sdist not found after pip download" >&2; exit 1; }
fi

SRC_ROOT="${LC_DIR}/src/llama_cpp_python-${LCP_VERSION}"
LLAMA_SRC="${SRC_ROOT}/vendor/llama.cpp"
if [ ! -f "${SRC_ROOT}/.strata-extracted" ]; then
    log "extracting $(basename "${SDIST}")"
    rm -rf "${SRC_ROOT}"
    tmp_src="$(mktemp -d "${LC_DIR}/src/.extract.XXXXXX")"
    tar -xzf "${SDIST}" -C "${tmp_src}"
    top="$(find "${tmp_src}" -mindepth 1 -maxdepth 1 -type d | head -n1)"
    [ -f "${top}/vendor/llama.cpp/CMakeLists.txt" ] || { echo "llama-cpp-build: sdist has no vendor/llama.cpp" >&2; exit 1; }
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
BUILD_DIR="${LC_DIR}/build/llama-cpp-python-${LCP_VERSION}${ISA_SUFFIX}"
CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    "${ISA_ARGS[@]}"
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

for t in "${TARGETS[@]}"; do
    [ -x "${BUILD_DIR}/bin/${t}" ] || { echo "llama-cpp-build: ${BUILD_DIR}/bin/${t} was not built" >&2; exit 1; }
done
printf 'LLAMA_BIN=%q\nLLAMA_COMMIT=%q\nLLAMA_COMMIT_FULL=%q\nLLAMA_COMMIT_DATE=%q\n' \
    "${BUILD_DIR}/bin" "${LLAMA_COMMIT}" "${LLAMA_COMMIT_FULL}" "${LLAMA_COMMIT_DATE}"
exit 0
}
