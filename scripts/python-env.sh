#!/usr/bin/env bash
# The project's Python environment: a venv at ${STRATA_CACHE:-/var/cache/strata}/venv, created when missing (needs
# python3's venv module: scripts/setup). With no argument it also holds the official `openai` package at the pinned
# version (the OpenAI-client test); `--bare` gives just the venv and its pip (fetching the model wheel, so no
# system pip is needed). Prints the venv's python. Idempotent; concurrent runs wait for each other.
set -euo pipefail
OPENAI_VERSION=3.57.0
venv="${STRATA_CACHE:-/var/cache/strata}/venv"
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
[ -x "$py" ] || python3 -m venv "$venv" >&2
if [ "${1:-}" != --bare ] &&
  ! "$py" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  "$py" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" >&2
fi
echo "$py"
