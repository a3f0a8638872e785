#!/usr/bin/env bash
# Serving benchmark on loopback: SmolLM2 through local clusters of 1, 2 and 3 stages at 1, 4, 16 and 64
# concurrent streams, plus the single-process decode baseline. Run it on an idle machine; it writes
# target/bench/cluster.{json,svg} and prints the markdown table used in docs/performance.md.
# Extra arguments go to `strata bench` (e.g. --threads 2 --concurrency 1,16).
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(scripts/fetch-model.sh)"
cargo build --release --locked -q -p strata-cli
exec "${CARGO_TARGET_DIR:-target}/release/strata" bench --model "$model" --local 1,2,3 --concurrency 1,4,16,64 \
  --requests-per-client 2 --prompt-tokens 32 --decode-tokens 64 --threads 2 "$@"
