#!/usr/bin/env python3
"""Write GGUF copies of the qwen fixtures and of a llama one with q/k/v biases with the `gguf` package, as
llama.cpp's converter would.

Usage:  python3 tests/reference/make_gguf_fixtures.py [--fixtures DIR]

Reads tests/fixtures/<name>/ (written by make_fixtures.py) and writes
tests/fixtures/gguf/<name>.gguf.  Needs numpy and gguf == GGUF_VERSION (the
library llama.cpp's convert_hf_to_gguf.py writes with).  Deterministic: the
same inputs give the same bytes.

What llama.cpp's converter does for these architectures, and this script with
it (see tests/reference/README.md):
* metadata: TextModel.set_gguf_parameters — block_count, context_length,
  embedding_length, feed_forward_length, head_count, head_count_kv,
  rope.freq_base, layer_norm_rms_epsilon, and key_length/value_length only
  when config.json has `head_dim`; file_type; the vocabulary as
  tokenizer.ggml.* (here placeholder tokens: the logits do not depend on them).
* tensor names: gguf's TensorNameMap for the architecture.
* tensor data: unchanged for qwen2/qwen3.  Qwen2Model/Qwen3Model do not
  override modify_tensors with LlamaModel's Q/K permutation: llama.cpp runs
  NEOX-style RoPE for qwen2/qwen3, which rotates halves as Hugging Face does.
  For llama, LlamaModel.modify_tensors interleaves each head's rows of
  q_proj/k_proj, weights and biases alike (`permute` below, written from its
  description: reshape to (heads, 2, rows/heads/2, ...), swap the middle two
  axes, reshape back; k_proj with the KV head count).
* a tied head has no output.weight (the HF files have no lm_head.weight).
"""

import argparse
import importlib.metadata
import json
import os
import sys

import numpy as np

GGUF_VERSION = "0.19.0"

try:
    import gguf
except ImportError:
    sys.exit(f"needs the gguf package: pip install gguf=={GGUF_VERSION}")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import read_safetensors  # noqa: E402  (the fixtures' own independent reader)

# fixture name -> gguf architecture
FIXTURES = {
    "tiny-qwen2-bias": gguf.MODEL_ARCH.QWEN2,
    "tiny-qwen3": gguf.MODEL_ARCH.QWEN3,
    "tiny-llama-bias": gguf.MODEL_ARCH.LLAMA,
}


def permute(data, heads):
    """llama.cpp's row order for one q or k projection (matrix rows, or a bias's elements) of `heads` heads."""
    return data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def stored(name, value, arch, hp):
    """A HF tensor as the GGUF stores it."""
    if arch == gguf.MODEL_ARCH.LLAMA:
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return permute(value, hp["num_attention_heads"])
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return permute(value, hp["num_key_value_heads"])
    return value


def write_gguf(src, out, arch):
    with open(os.path.join(src, "config.json")) as f:
        hp = json.load(f)
    weights = read_safetensors(os.path.join(src, "model.safetensors"))
    n_layers = hp["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_layers)

    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(hp["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if "head_dim" in hp:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<tok{i}>" for i in range(hp["vocab_size"])])
    w.add_token_types([gguf.TokenType.NORMAL] * hp["vocab_size"])
    w.add_token_merges([])
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])

    for name in sorted(weights):
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"{name}: no {gguf.MODEL_ARCH_NAMES[arch]} name")
        value = stored(name, weights[name], arch, hp)
        # The fixtures store f32; the reader widened to f64 exactly, so this narrowing is exact too.
        data = value.astype(np.float32)
        assert np.array_equal(data.astype(np.float64), value), name
        w.add_tensor(new, data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check(path, src, arch):
    """Read the file back with gguf's own reader: every HF tensor is there under its GGUF name, as stored."""
    weights = read_safetensors(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        hp = json.load(f)
    r = gguf.GGUFReader(path)
    arch_field = r.fields["general.architecture"]
    assert bytes(arch_field.parts[arch_field.data[0]]).decode() == gguf.MODEL_ARCH_NAMES[arch]
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == len(weights)
    names = gguf.get_tensor_name_map(arch, len({n.split(".")[2] for n in weights if n.startswith("model.layers.")}))
    for name, value in weights.items():
        t = tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        got = np.asarray(t.data, dtype=np.float64).reshape(value.shape)
        assert np.array_equal(got, stored(name, value, arch, hp)), name


def main():
    installed = importlib.metadata.version("gguf")
    if installed != GGUF_VERSION:
        sys.exit(f"gguf {installed} is installed; this script is pinned to {GGUF_VERSION}")
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--fixtures", default=os.path.normpath(os.path.join(here, "..", "fixtures")))
    args = ap.parse_args()
    out_dir = os.path.join(args.fixtures, "gguf")
    os.makedirs(out_dir, exist_ok=True)
    for name, arch in FIXTURES.items():
        src = os.path.join(args.fixtures, name)
        out = os.path.join(out_dir, f"{name}.gguf")
        write_gguf(src, out, arch)
        check(out, src, arch)
        print(f"{out}: {os.path.getsize(out)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
