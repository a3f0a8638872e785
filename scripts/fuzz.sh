#!/usr/bin/env bash
# Coverage-guided fuzzing of strata's readers of untrusted input (docs/fuzzing.md): installs cargo-afl (AFL++, which
# runs on the stable toolchain) if missing, builds the targets in fuzz/ with its instrumentation, and runs each from
# its seeds in fuzz/corpus/<target>/ for a bounded time. Fails, printing the inputs, when any target crashed (a panic,
# an abort, or an allocation past the readers' limit); hangs are printed but do not fail (a busy machine makes them).
#   scripts/fuzz.sh [--seconds N] [TARGET...]     N per target, default 60; all four targets by default
# Findings stay under $STRATA_CACHE/fuzz/<target>/ (crashes/, hangs/, queue/) until the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
all=(gguf safetensors_header hidden_codec openai_request)
seconds=60
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    -h | --help) sed -n '2,7p' "$0"; exit 0 ;;
    -*) echo "unknown option $1 (usage: scripts/fuzz.sh [--seconds N] [TARGET...])" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
for t in "${targets[@]}"; do
  [ -d "fuzz/corpus/$t" ] || { echo "no fuzz target $t (one of: ${all[*]})" >&2; exit 2; }
done

# A C compiler and make (AFL++ is built from source), protoc (the proto crate).
scripts/setup fuzz
afl_version=0.18.2
if ! cargo afl --version 2>/dev/null | grep -q "$afl_version"; then
  echo "== installing cargo-afl $afl_version" >&2
  cargo install --locked cargo-afl --version "$afl_version"
fi
# cargo-afl builds AFL++ once per rustc version, into its data directory.
if ! compgen -G "${XDG_DATA_HOME:-$HOME/.local/share}/afl.rs/rustc-$(rustc -V | cut -d' ' -f2)-*/afl.rs-$afl_version/afl/bin/afl-fuzz" >/dev/null; then
  echo "== building AFL++" >&2
  cargo afl config --build
fi

export STRATA_CACHE="${STRATA_CACHE:-/var/cache/strata}"
# Instrumented builds keep their own target directory: their flags differ from every other build's.
export CARGO_TARGET_DIR="${STRATA_FUZZ_TARGET_DIR:-$STRATA_CACHE/target-afl}"
echo "== building the fuzz targets (cargo afl build --release)" >&2
(cd fuzz && cargo afl build --release --locked --bins)

# No terminal UI, no CPU pinning (the machine is shared), and crashes are found without a core-dump handler.
export AFL_NO_UI=1 AFL_NO_AFFINITY=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
# The gguf and safetensors targets write each input to a file for the loaders to map: keep those in memory.
[ -w /dev/shm ] && export TMPDIR=/dev/shm
failed=()
for t in "${targets[@]}"; do
  out="$STRATA_CACHE/fuzz/$t"
  rm -rf "$out"
  mkdir -p "$out"
  echo "== fuzzing $t for ${seconds}s" >&2
  # -t: milliseconds per input, beyond which it is a hang; -m none: the targets bound their own allocations.
  cargo afl fuzz -i "fuzz/corpus/$t" -o "$out" -V "$seconds" -t 2000 -m none \
    -- "$CARGO_TARGET_DIR/release/$t" >"$out/afl.log" 2>&1 || {
    tail -20 "$out/afl.log" >&2
    failed+=("$t (afl-fuzz failed, log: $out/afl.log)")
    continue
  }
  stats="$out/default/fuzzer_stats"
  stat() { sed -n "s/^$1 *: //p" "$stats"; }
  echo "$t: $(stat execs_done) execs ($(stat execs_per_sec)/s), corpus $(stat corpus_count), coverage $(stat bitmap_cvg), crashes $(stat saved_crashes), hangs $(stat saved_hangs)" >&2
  for f in "$out"/default/hangs/id:*; do
    [ -e "$f" ] && echo "  hang (not failing the run): $f" >&2
  done
  crashes=("$out"/default/crashes/id:*)
  if [ -e "${crashes[0]}" ]; then
    printf '  crash: %s\n' "${crashes[@]}" >&2
    echo "  reproduce: $CARGO_TARGET_DIR/release/$t < INPUT" >&2
    failed+=("$t (${#crashes[@]} crashes)")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing found problems: ${failed[*]}" >&2
  exit 1
fi
