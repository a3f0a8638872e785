#!/usr/bin/env bash
# The Python environment of the OpenAI-client test: a venv at ${STRATA_CACHE:-/var/cache/strata}/venv with the
# official `openai` package at the pinned version, created or updated when missing. Prints the venv's python.
# Idempotent; concurrent runs wait for each other.
set -euo pipefail
OPENAI_VERSION=3.57.0
venv="${STRATA_CACHE:-/var/cache/strata}/venv"
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if ! "$py" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  [ -x "$py" ] || python3 -m venv "$venv" >&2
  "$py" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" >&2
fi
echo "$py"
