#!/usr/bin/env python3
"""Write a smaller GGUF made of a real model's own weights: the first layers, and optionally the first rows of
the vocabulary. The GPU bundle (scripts/gpu-bundle.sh) uses it to carry real weights in a few MiB.

    scripts/gguf-slice.py IN.gguf OUT.gguf --layers 4 [--vocab 8192]
    scripts/gguf-slice.py IN.gguf --list            # metadata and tensor directory

--layers N keeps blocks 0..N-1 (`blk.<i>.*`) and rewrites `<arch>.block_count`. --vocab N keeps the first N rows
of `token_embd.weight` (and `output.weight` when the head is not tied), sets `<arch>.vocab_size`, and drops the
tokenizer metadata (`tokenizer.*`: merges would name tokens that no longer exist) but the special token ids, so
the result takes prompts as token ids only. Tensor bytes are copied unchanged (quantized tensors stay quantized; a row of a quantized matrix
is a whole number of blocks, so rows can be cut). Only the Python standard library is used.
"""

import argparse
import struct
import sys

MAGIC = b"GGUF"
# Metadata value types (GGUF spec).
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
          I64: "<q", F64: "<d"}
# ggml tensor types: (block elements, block bytes), for the ones strata reads and a few common others.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
              30: ("BF16", 1, 2), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}


class Reader:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n):
        if self.pos + n > len(self.buf):
            raise ValueError(f"truncated GGUF: {n} bytes needed at offset {self.pos}")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def fmt(self, f):
        return struct.unpack(f, self.take(struct.calcsize(f)))[0]

    def string(self):
        return self.take(self.fmt("<Q")).decode("utf-8")

    def value(self, vtype):
        if vtype in SCALAR:
            return self.fmt(SCALAR[vtype])
        if vtype == STR:
            return self.string()
        if vtype == ARR:
            etype, n = self.fmt("<I"), self.fmt("<Q")
            return (etype, [self.value(etype) for _ in range(n)])
        raise ValueError(f"unknown GGUF value type {vtype}")


def read(path):
    """(version, [(key, type, value)], [dict(name, dims, type, offset)], alignment, data bytes)"""
    with open(path, "rb") as f:
        buf = f.read()
    r = Reader(buf)
    if r.take(4) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version = r.fmt("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (2 or 3 supported)")
    n_tensors, n_kv = r.fmt("<Q"), r.fmt("<Q")
    kvs = []
    for _ in range(n_kv):
        key = r.string()
        vtype = r.fmt("<I")
        kvs.append((key, vtype, r.value(vtype)))
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.fmt("<Q") for _ in range(r.fmt("<I"))]
        tensors.append({"name": name, "dims": dims, "type": r.fmt("<I"), "offset": r.fmt("<Q")})
    alignment = next((v for k, t, v in kvs if k == "general.alignment"), 32)
    start = (r.pos + alignment - 1) // alignment * alignment
    return version, kvs, tensors, alignment, buf[start:]


def nbytes(t):
    """Bytes of a tensor: dims[0] is the innermost (row) dimension."""
    if t["type"] not in GGML_TYPES:
        raise ValueError(f"tensor {t['name']}: ggml type {t['type']} is not known to this script")
    _, block, size = GGML_TYPES[t["type"]]
    if t["dims"][0] % block:
        raise ValueError(f"tensor {t['name']}: row of {t['dims'][0]} is not whole blocks of {block}")
    rows = 1
    for d in t["dims"][1:]:
        rows *= d
    return rows * t["dims"][0] // block * size


def pack_value(vtype, v):
    if vtype in SCALAR:
        return struct.pack(SCALAR[vtype], v)
    if vtype == STR:
        b = v.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    etype, items = v
    return struct.pack("<IQ", etype, len(items)) + b"".join(pack_value(etype, x) for x in items)


def write(path, version, kvs, tensors, alignment):
    """tensors: [(name, dims, type, bytes)]."""
    out = bytearray(MAGIC + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for key, vtype, v in kvs:
        out += pack_value(STR, key) + struct.pack("<I", vtype) + pack_value(vtype, v)
    offset, layout = 0, []
    for name, dims, ttype, data in tensors:
        layout.append(offset)
        out += pack_value(STR, name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ttype, offset)
        offset = (offset + len(data) + alignment - 1) // alignment * alignment
    out += b"\0" * (-len(out) % alignment)
    base = len(out)
    for (_, _, _, data), off in zip(tensors, layout):
        assert len(out) - base == off
        out += data
        out += b"\0" * (-len(data) % alignment)
    with open(path, "wb") as f:
        f.write(out)
    return len(out)


def block_index(name):
    """i for `blk.<i>.*`, else None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None


def slice_model(kvs, tensors, data, layers, vocab):
    arch = next((v for k, t, v in kvs if k == "general.architecture"), None)
    if arch is None:
        raise ValueError("no general.architecture in the metadata")
    keys = {k for k, _, _ in kvs}
    if f"{arch}.block_count" not in keys:
        raise ValueError(f"no {arch}.block_count in the metadata")
    total = next(v for k, t, v in kvs if k == f"{arch}.block_count")
    if layers is not None and not 0 < layers <= total:
        raise ValueError(f"--layers {layers}: the model has {total}")
    new_kvs = []
    for key, vtype, v in kvs:
        if key == f"{arch}.block_count" and layers is not None:
            v = layers
        if vocab is not None and key == f"{arch}.vocab_size":
            continue
        # Special token ids stay (end-of-sequence still stops generation) when they are inside the vocabulary.
        special = key.startswith("tokenizer.ggml.") and key.endswith("_token_id")
        if vocab is not None and key.startswith("tokenizer.") and not (special and v < vocab):
            continue
        new_kvs.append((key, vtype, v))
    out = []
    for t in tensors:
        i = block_index(t["name"])
        if i is not None and layers is not None and i >= layers:
            continue
        raw = data[t["offset"]:t["offset"] + nbytes(t)]
        dims = list(t["dims"])
        if vocab is not None and t["name"] in ("token_embd.weight", "output.weight"):
            if len(dims) != 2 or dims[1] < vocab:
                raise ValueError(f"--vocab {vocab}: {t['name']} has shape {dims}")
            row = nbytes(t) // dims[1]
            raw, dims[1] = raw[:row * vocab], vocab
        out.append((t["name"], dims, t["type"], bytes(raw)))
    if vocab is not None:
        new_kvs.append((f"{arch}.vocab_size", U32, vocab))
    return new_kvs, out


def describe(kvs, tensors):
    for key, vtype, v in kvs:
        shown = f"[{len(v[1])} items]" if vtype == ARR else repr(v)
        print(f"{key} = {shown[:100]}")
    for t in tensors:
        kind = GGML_TYPES.get(t["type"], (f"type {t['type']}",))[0]
        print(f"{t['name']:32} {kind:5} {t['dims']} {nbytes(t) if t['type'] in GGML_TYPES else '?'} B")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input")
    p.add_argument("output", nargs="?")
    p.add_argument("--layers", type=int, help="keep blocks 0..N-1")
    p.add_argument("--vocab", type=int, help="keep the first N vocabulary rows (drops the tokenizer)")
    p.add_argument("--list", action="store_true", help="print the metadata and tensors and exit")
    a = p.parse_args(argv)
    version, kvs, tensors, alignment, data = read(a.input)
    if a.list:
        describe(kvs, tensors)
        return 0
    if not a.output:
        p.error("OUT.gguf is required (or --list)")
    new_kvs, out = slice_model(kvs, tensors, data, a.layers, a.vocab)
    size = write(a.output, version, new_kvs, out, alignment)
    print(f"wrote {a.output}: {len(out)} tensors, {size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
