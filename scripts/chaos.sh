#!/usr/bin/env bash
# Membership-change chaos run (docs/reliability.md): builds release binaries of strata, coordinator and
# stage-worker, fetches SmolLM2 if it is missing, then runs `strata chaos` with every scenario (crash of the
# first/middle/last stage, a hung stage, a drain and a join under load, etcd paused 30 s, leader coordinator
# killed with a standby) on a fresh cluster of real processes each: etcd, 3 stage workers, coordinators.
# 16 streamed requests per wave (gRPC and HTTP SSE, greedy and seeded) are compared with an undisturbed run.
#
# Writes under ${STRATA_CHAOS_RESULTS:-target/chaos/<UTC date-time>}: chaos.json (every stream's tokens and
# timestamps), chaos.md (the table), logs/<scenario>/*.log (every process's output), command.txt.
# Exits non-zero when a scenario failed a request or changed a token — on today's code, expect that.
# Extra arguments go to `strata chaos` (e.g. --scenario crash-middle --scenario hang --etcd-pause-secs 10).
# Needs etcd on PATH (`scripts/setup test` installs it). Takes about 3-5 min on 2 cores once built.
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(scripts/fetch-model.sh)"
cargo build --release --locked -q -p strata-cli -p strata-coordinator -p strata-stage-worker
bin="${CARGO_TARGET_DIR:-target}/release"
results="${STRATA_CHAOS_RESULTS:-target/chaos/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$results"
cmd=("$bin/strata" chaos --model "$model" --bin-dir "$bin" --json "$results/chaos.json" --logs "$results/logs" "$@")
printf '%q ' "${cmd[@]}" | tee "$results/command.txt"
echo
status=0
"${cmd[@]}" | tee "$results/chaos.md" || status=$?
echo "results in $results (exit status $status)"
exit "$status"
