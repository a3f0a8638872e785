#!/usr/bin/env python3
"""Generate tiny random-weight Llama-family fixtures and their reference logits.

Usage:  python3 tests/reference/make_fixtures.py [--out DIR]

numpy only (no torch).  Deterministic: every model has a fixed seed and the
output is byte-identical on re-run.  See tests/reference/README.md.

Reference semantics = Hugging Face LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM / Qwen3ForCausalLM (eager attention, no sliding window), computed in float64
from the weights *as stored* (bf16/f16 weights are upcast exactly).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------
# Model specifications
# ---------------------------------------------------------------------------

BOS, EOS = 1, 2
N_DECODE = 3

MODELS = [
    dict(
        name="tiny-llama-mha-tied", seed=1001, arch="LlamaForCausalLM", model_type="llama",
        hidden=32, inter=64, layers=2, heads=4, kv_heads=4, head_dim=None, vocab=128,
        eps=1e-5, theta=10000.0, rope_scaling=None, tied=True, dtype="F32",
        bias=False, sharded=False, prompt_len=7,
    ),
    dict(
        name="tiny-llama-gqa-untied", seed=1002, arch="LlamaForCausalLM", model_type="llama",
        hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=None, vocab=112,
        eps=1e-6, theta=10000.0, rope_scaling=None, tied=False, dtype="F32",
        bias=False, sharded=True, prompt_len=8,
    ),
    dict(
        name="tiny-qwen2-bias", seed=1003, arch="Qwen2ForCausalLM", model_type="qwen2",
        hidden=32, inter=96, layers=2, heads=4, kv_heads=2, head_dim=None, vocab=120,
        eps=1e-6, theta=1000000.0, rope_scaling=None, tied=True, dtype="F32",
        bias=True, sharded=False, prompt_len=6,
    ),
    dict(
        name="tiny-llama3-rope-scaling", seed=1004, arch="LlamaForCausalLM", model_type="llama",
        hidden=32, inter=64, layers=2, heads=2, kv_heads=1, head_dim=None, vocab=128,
        eps=1e-5, theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16, "rope_type": "llama3"},
        tied=True, dtype="F32", bias=False, sharded=False, prompt_len=9,
    ),
    dict(
        name="tiny-mistral-headdim", seed=1005, arch="MistralForCausalLM", model_type="mistral",
        hidden=48, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=96,
        eps=1e-5, theta=10000.0, rope_scaling=None, tied=True, dtype="F32",
        bias=False, sharded=False, prompt_len=5,
    ),
    dict(
        name="tiny-llama-bf16", seed=1006, arch="LlamaForCausalLM", model_type="llama",
        hidden=32, inter=64, layers=3, heads=4, kv_heads=2, head_dim=None, vocab=128,
        eps=1e-5, theta=10000.0, rope_scaling=None, tied=False, dtype="BF16",
        bias=False, sharded=False, prompt_len=7,
    ),
    dict(
        name="tiny-llama-f16", seed=1007, arch="LlamaForCausalLM", model_type="llama",
        hidden=32, inter=64, layers=3, heads=4, kv_heads=2, head_dim=None, vocab=128,
        eps=1e-5, theta=10000.0, rope_scaling=None, tied=True, dtype="F16",
        bias=False, sharded=False, prompt_len=8,
    ),
    # Qwen3: RMSNorm per query/key head before RoPE; head_dim 16 != 32/4; GQA; untied head.
    dict(
        name="tiny-qwen3", seed=1008, arch="Qwen3ForCausalLM", model_type="qwen3",
        hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=136,
        eps=1e-6, theta=1000000.0, rope_scaling=None, tied=False, dtype="F32",
        bias=False, qk_norm=True, sharded=False, prompt_len=7,
    ),
    # Llama with q/k/v biases (`attention_bias`): in a GGUF, llama.cpp interleaves the q and k biases per head.
    dict(
        name="tiny-llama-bias", seed=1009, arch="LlamaForCausalLM", model_type="llama",
        hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=None, vocab=104,
        eps=1e-5, theta=10000.0, rope_scaling=None, tied=True, dtype="F32",
        bias=True, sharded=False, prompt_len=6,
    ),
]

TORCH_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def head_dim_of(spec):
    return spec["head_dim"] if spec["head_dim"] is not None else spec["hidden"] // spec["heads"]


# ---------------------------------------------------------------------------
# dtype conversion (stored representation <-> exact float64 value)
# ---------------------------------------------------------------------------

def f32_to_bf16_bits(a):
    """Round-to-nearest-even f32 -> bf16, returned as uint16 bit patterns."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    assert np.all(np.isfinite(a))
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype("<u2")


def bf16_bits_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view("<f4").astype(np.float64)


class Stored:
    """A tensor as it is stored in the file: raw bytes + exact f64 value."""

    def __init__(self, f32_values, dtype):
        a = np.asarray(f32_values, dtype=np.float32)
        self.shape = list(a.shape)
        self.dtype = dtype
        if dtype == "F32":
            arr = a.astype("<f4")
            self.value = arr.astype(np.float64)
        elif dtype == "F16":
            arr = a.astype("<f2")
            assert np.all(np.isfinite(arr))
            self.value = arr.astype(np.float64)
        elif dtype == "BF16":
            arr = f32_to_bf16_bits(a)
            self.value = bf16_bits_to_f64(arr)
        else:
            raise ValueError(dtype)
        self.raw = np.ascontiguousarray(arr).tobytes()


# ---------------------------------------------------------------------------
# safetensors writer (own, minimal)
# ---------------------------------------------------------------------------

def write_safetensors(path, tensors):
    """tensors: dict name -> Stored.  Tensors are laid out contiguously in
    sorted-name order; offsets are relative to the start of the data section.
    The JSON header is padded with spaces to a multiple of 8 bytes (as the
    reference implementation does)."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for n in names:
        t = tensors[n]
        header[n] = {"dtype": t.dtype, "shape": t.shape,
                     "data_offsets": [offset, offset + len(t.raw)]}
        offset += len(t.raw)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for n in names:
            f.write(tensors[n].raw)
    return offset


def read_safetensors(path):
    """Independent re-reader used as a self-check of the writer."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        end_max = max(end_max, e)
        raw = body[s:e]
        if info["dtype"] == "F32":
            v = np.frombuffer(raw, "<f4").astype(np.float64)
        elif info["dtype"] == "F16":
            v = np.frombuffer(raw, "<f2").astype(np.float64)
        elif info["dtype"] == "BF16":
            v = bf16_bits_to_f64(np.frombuffer(raw, "<u2"))
        else:
            raise ValueError(info["dtype"])
        out[name] = v.reshape(info["shape"])
    assert end_max == len(body), "data section must be exactly covered"
    return out


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

def make_weights(spec):
    rng = np.random.default_rng(spec["seed"])
    H, I, V = spec["hidden"], spec["inter"], spec["vocab"]
    nh, nkv, hd = spec["heads"], spec["kv_heads"], head_dim_of(spec)
    dt = spec["dtype"]
    w = {}

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w["model.embed_tokens.weight"] = Stored(normal((V, H), 0.3), dt)
    for i in range(spec["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = Stored(norm_w(H), dt)
        w[p + "self_attn.q_proj.weight"] = Stored(normal((nh * hd, H), 0.3), dt)
        w[p + "self_attn.k_proj.weight"] = Stored(normal((nkv * hd, H), 0.3), dt)
        w[p + "self_attn.v_proj.weight"] = Stored(normal((nkv * hd, H), 0.2), dt)
        w[p + "self_attn.o_proj.weight"] = Stored(normal((H, nh * hd), 0.25), dt)
        if spec["bias"]:
            w[p + "self_attn.q_proj.bias"] = Stored(normal((nh * hd,), 0.2), dt)
            w[p + "self_attn.k_proj.bias"] = Stored(normal((nkv * hd,), 0.2), dt)
            w[p + "self_attn.v_proj.bias"] = Stored(normal((nkv * hd,), 0.2), dt)
        # Drawn only for models that have them, so the other fixtures' random streams are unchanged.
        if spec.get("qk_norm"):
            w[p + "self_attn.q_norm.weight"] = Stored(norm_w(hd), dt)
            w[p + "self_attn.k_norm.weight"] = Stored(norm_w(hd), dt)
        w[p + "post_attention_layernorm.weight"] = Stored(norm_w(H), dt)
        w[p + "mlp.gate_proj.weight"] = Stored(normal((I, H), 0.15), dt)
        w[p + "mlp.up_proj.weight"] = Stored(normal((I, H), 0.15), dt)
        w[p + "mlp.down_proj.weight"] = Stored(normal((H, I), 0.25), dt)
    w["model.norm.weight"] = Stored(norm_w(H), dt)
    if not spec["tied"]:
        w["lm_head.weight"] = Stored(normal((V, H), 0.3), dt)
    prompt = [BOS] + [int(x) for x in rng.integers(3, V, size=spec["prompt_len"] - 1)]
    return w, prompt


# ---------------------------------------------------------------------------
# Reference math (float64)
# ---------------------------------------------------------------------------

def rope_inv_freq(spec):
    hd = head_dim_of(spec)
    j = np.arange(0, hd, 2, dtype=np.float64)
    inv_freq = 1.0 / (spec["theta"] ** (j / hd))
    rs = spec["rope_scaling"]
    if rs is None:
        return inv_freq
    assert rs["rope_type"] == "llama3"
    # transformers.modeling_rope_utils._compute_llama3_parameters
    factor = rs["factor"]
    low_ff = rs["low_freq_factor"]
    high_ff = rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / low_ff
    high_freq_wavelen = old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


def rope(x, positions, inv_freq):
    """x: [T, n_heads, head_dim]; HF rotate_half layout."""
    ang = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)  # [T, hd/2]
    emb = np.concatenate([ang, ang], axis=-1)                          # [T, hd]
    cos = np.cos(emb)[:, None, :]
    sin = np.sin(emb)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


class Model:
    def __init__(self, spec, w):
        self.s = spec
        self.w = {k: v.value if isinstance(v, Stored) else v for k, v in w.items()}
        self.hd = head_dim_of(spec)
        self.inv_freq = rope_inv_freq(spec)

    def _qkv(self, i, h, positions):
        s, w, hd = self.s, self.w, self.hd
        p = f"model.layers.{i}.self_attn."
        q = h @ w[p + "q_proj.weight"].T
        k = h @ w[p + "k_proj.weight"].T
        v = h @ w[p + "v_proj.weight"].T
        if s["bias"]:
            q = q + w[p + "q_proj.bias"]
            k = k + w[p + "k_proj.bias"]
            v = v + w[p + "v_proj.bias"]
        T = h.shape[0]
        q = q.reshape(T, s["heads"], hd)
        k = k.reshape(T, s["kv_heads"], hd)
        if s.get("qk_norm"):
            # Qwen3Attention: RMSNorm over each head's head_dim values, before RoPE.
            q = rmsnorm(q, w[p + "q_norm.weight"], s["eps"])
            k = rmsnorm(k, w[p + "k_norm.weight"], s["eps"])
        q = rope(q, positions, self.inv_freq)
        k = rope(k, positions, self.inv_freq)
        v = v.reshape(T, s["kv_heads"], hd)
        return q, k, v

    def _attend(self, q, k, v, q_positions, k_positions):
        """q: [Tq, nh, hd]; k, v: [Tk, nkv, hd]; causal by absolute position."""
        s, hd = self.s, self.hd
        group = s["heads"] // s["kv_heads"]
        out = np.zeros((q.shape[0], s["heads"], hd))
        mask = np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]
        for hh in range(s["heads"]):
            kvh = hh // group
            sc = q[:, hh, :] @ k[:, kvh, :].T / math.sqrt(hd)
            sc = np.where(mask, sc, -np.inf)
            sc = sc - sc.max(axis=-1, keepdims=True)
            p = np.exp(sc)
            p = p / p.sum(axis=-1, keepdims=True)
            out[:, hh, :] = p @ v[:, kvh, :]
        return out.reshape(q.shape[0], s["heads"] * hd)

    def _mlp_and_head(self, i, x):
        w, eps = self.w, self.s["eps"]
        p = f"model.layers.{i}."
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        return x + (silu(g) * u) @ w[p + "mlp.down_proj.weight"].T

    def _logits(self, x):
        w = self.w
        x = rmsnorm(x, w["model.norm.weight"], self.s["eps"])
        head = w["model.embed_tokens.weight"] if self.s["tied"] else w["lm_head.weight"]
        return x @ head.T

    def forward(self, ids, start_pos=0, cache=None):
        """Forward `ids` at positions start_pos.. .  With cache=None this is a
        full recompute (no cache).  With a cache (list of per-layer [k, v]
        lists) new K/V are appended and attention covers cache + new tokens."""
        w, eps = self.w, self.s["eps"]
        ids = list(ids)
        positions = list(range(start_pos, start_pos + len(ids)))
        x = w["model.embed_tokens.weight"][ids]
        for i in range(self.s["layers"]):
            h = rmsnorm(x, w[f"model.layers.{i}.input_layernorm.weight"], eps)
            q, k, v = self._qkv(i, h, positions)
            if cache is not None:
                ck, cv = cache[i]
                k = np.concatenate([ck, k], axis=0) if ck is not None else k
                v = np.concatenate([cv, v], axis=0) if cv is not None else v
                cache[i] = [k, v]
            k_positions = list(range(positions[-1] + 1 - k.shape[0], positions[-1] + 1))
            a = self._attend(q, k, v, positions, k_positions)
            x = x + a @ w[f"model.layers.{i}.self_attn.o_proj.weight"].T
            x = self._mlp_and_head(i, x)
        return self._logits(x)

    def new_cache(self):
        return [[None, None] for _ in range(self.s["layers"])]


# ---------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------

def f32_repr(x):
    # Round to float32, then print the exact f64 value of that f32 with
    # Python's shortest round-trip repr: parsing as f64 and casting to f32 is
    # then exact (no double-rounding hazard).
    return repr(float(np.float32(x)))


def rows_json(rows):
    return "[\n" + ",\n".join("    [" + ", ".join(f32_repr(v) for v in r) + "]" for r in rows) + "\n  ]"


def config_for(spec):
    hd = head_dim_of(spec)
    c = {
        "architectures": [spec["arch"]],
        "model_type": spec["model_type"],
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["inter"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
    }
    if spec["head_dim"] is not None:
        c["head_dim"] = hd
    c.update({
        "vocab_size": spec["vocab"],
        "rms_norm_eps": spec["eps"],
        "rope_theta": spec["theta"],
        "rope_scaling": spec["rope_scaling"],
        "tie_word_embeddings": spec["tied"],
        "max_position_embeddings": 128,
        "torch_dtype": TORCH_DTYPE[spec["dtype"]],
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
    })
    if spec["model_type"] == "llama":
        c["attention_bias"] = spec["bias"]
        c["mlp_bias"] = False
        c["pretraining_tp"] = 1
    elif spec["model_type"] == "qwen2":
        c["attention_bias"] = True  # informational; Qwen2 always has q/k/v bias
        c["use_sliding_window"] = False
        c["sliding_window"] = None
        c["max_window_layers"] = spec["layers"]
    elif spec["model_type"] == "qwen3":
        c["attention_bias"] = spec["bias"]
        c["use_sliding_window"] = False
        c["sliding_window"] = None
        c["max_window_layers"] = spec["layers"]
    elif spec["model_type"] == "mistral":
        c["sliding_window"] = None
    c["attention_dropout"] = 0.0
    return c


def write_model(spec, outdir):
    d = os.path.join(outdir, spec["name"])
    os.makedirs(d, exist_ok=True)
    for stale in os.listdir(d):  # idempotence: drop files from earlier layouts
        os.remove(os.path.join(d, stale))
    w, prompt = make_weights(spec)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(json.dumps(config_for(spec), indent=2) + "\n")

    # --- weights
    if spec["sharded"]:
        names = sorted(w)
        first = {n for n in names if n.startswith("model.embed_tokens") or n.startswith("model.layers.0.")}
        shards = [("model-00001-of-00002.safetensors", {n: w[n] for n in names if n in first}),
                  ("model-00002-of-00002.safetensors", {n: w[n] for n in names if n not in first})]
        total = 0
        weight_map = {}
        for fname, part in shards:
            assert part
            total += write_safetensors(os.path.join(d, fname), part)
            for n in part:
                weight_map[n] = fname
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: weight_map[n] for n in sorted(weight_map)}}
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps(index, indent=2) + "\n")
        reread = {}
        for fname, _ in shards:
            reread.update(read_safetensors(os.path.join(d, fname)))
    else:
        write_safetensors(os.path.join(d, "model.safetensors"), w)
        reread = read_safetensors(os.path.join(d, "model.safetensors"))

    # self-check: writer round-trips, and the reference uses the file contents
    assert sorted(reread) == sorted(w)
    for n in w:
        assert reread[n].shape == w[n].value.shape and np.array_equal(reread[n], w[n].value), n
    model = Model(spec, reread)

    # --- prefill (one full pass, every position)
    logits = model.forward(prompt)
    assert logits.shape == (len(prompt), spec["vocab"])

    # --- decode: greedy, each decode id = argmax of the previous logits row;
    # logits computed by FULL RECOMPUTE of prompt + decode ids so far.
    seq = list(prompt)
    decode_ids, decode_logits = [], []
    last = logits[-1]
    margins = []
    for _ in range(N_DECODE):
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        nxt = int(np.argmax(last))
        decode_ids.append(nxt)
        seq.append(nxt)
        last = model.forward(seq)[-1]
        decode_logits.append(last)
    # greedy choice must be robust to f32 noise
    assert min(margins) > 1e-3, (spec["name"], margins)

    # --- self-check: incremental KV-cache path == recompute
    cache = model.new_cache()
    inc_prefill = model.forward(prompt, 0, cache)
    assert np.max(np.abs(inc_prefill - logits)) < 1e-9
    # also token-by-token prefill through a fresh cache
    cache2 = model.new_cache()
    tok_rows = [model.forward([t], p, cache2)[0] for p, t in enumerate(prompt)]
    assert np.max(np.abs(np.array(tok_rows) - logits)) < 1e-9
    for step, t in enumerate(decode_ids):
        pos = len(prompt) + step
        inc = model.forward([t], pos, cache)[0]
        inc2 = model.forward([t], pos, cache2)[0]
        assert np.max(np.abs(inc - decode_logits[step])) < 1e-9, (spec["name"], step)
        assert np.max(np.abs(inc2 - decode_logits[step])) < 1e-9, (spec["name"], step)

    with open(os.path.join(d, "expected.json"), "w") as f:
        f.write("{\n")
        f.write('  "prompt_ids": ' + json.dumps(prompt) + ",\n")
        f.write('  "logits": ' + rows_json(logits) + ",\n")
        f.write('  "decode_ids": ' + json.dumps(decode_ids) + ",\n")
        f.write('  "decode_logits": ' + rows_json(decode_logits) + "\n")
        f.write("}\n")
    # sanity: the JSON parses and round-trips to the f32-rounded values
    with open(os.path.join(d, "expected.json")) as f:
        e = json.load(f)
    assert np.array_equal(np.array(e["logits"], dtype=np.float32), logits.astype(np.float32))
    return dict(name=spec["name"], std=float(logits.std()),
                rng=(float(logits.min()), float(logits.max())), margins=margins,
                prompt=prompt, decode=decode_ids)


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "fixtures")))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for spec in MODELS:
        r = write_model(spec, args.out)
        print(f"{r['name']:28s} logits std={r['std']:.3f} range=[{r['rng'][0]:.2f},{r['rng'][1]:.2f}] "
              f"min top1-top2 margin={min(r['margins']):.4f} prompt={r['prompt']} decode={r['decode']}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
