#!/usr/bin/env python3
"""Writes engine/tests/data/tokenizer_reference.json: the ids and decodings reference tokenizers give for a corpus,
on the real vocabularies scripts/fetch-tokenizers.sh caches. engine/tests/tokenizer_reference.rs rebuilds each
vocabulary from GGUF metadata and must match.

mistral, llama3, qwen3: Hugging Face's own `tokenizers` (pinned below) on the original tokenizer.json files. For
the byte-level ones (a pre-tokenizer), also the pieces that pre-tokenizer alone splits each text into: Qwen3's
vocabulary has no token of two digits, so its ids cannot show whether digits were split one by one; the pieces do.
llama2: Google's `sentencepiece` (pinned below) on Llama 2's tokenizer.model as llama.cpp's GGUF carries it (pieces,
scores, token types; rebuilt here as the model file, with Llama's normalizer settings). Before it is used, the
rebuilt model must give, for every text of llama.cpp's .inp file, the ids Hugging Face's tokenizer for
meta-llama/Llama-2-7b-hf gave (the .out file).

    py=$(scripts/python-env.sh --bare); "$py" -m pip install tokenizers==0.23.3 sentencepiece==0.2.3
    "$py" scripts/tokenizer-reference.py "$(scripts/fetch-tokenizers.sh)"
"""
import json
import pathlib
import re
import struct
import sys

import sentencepiece
import tokenizers

PINNED = "0.23.3"
PINNED_SENTENCEPIECE = "0.2.3"
SHARED = [
    "Hello, world!",
    "  two leading spaces, three trailing   ",
    "naïve café résumé — Ünïcödé ñ",
    "日本語のテキストと中文字符，还有한국어",
    "emoji 🦀🚀👍🏽 and a ZWJ family 👨‍👩‍👧",
    "1234567890 3.14159 -42 1e10 2026-12-01 ١٢٣",
    "line one\nline two\n\n\ttabbed\r\nwindows\r\n",
    'fn main() {\n    println!("{}", x + 1);\n}\n',
    "def f(x):\n\treturn x**2  # square\n",
    "I'm sure they'll say it's fine, WE'VE DONE IT",
    "     \n\n   \t  ",
    "Ελληνικά, русский, العربية, עברית",
    "decomposed e\u0301 and composed \u00e9",
    # Numbers: Qwen2/Qwen3 split every digit alone (\p{N}), Llama 3 into runs of at most three; both must match
    # Hugging Face on long runs, runs of every length mod 3, digits against letters, punctuation and spaces, other
    # scripts' digits, fractions and numbers in code.
    "3141592653589793238462643383279502884197 and 1 12 123 1234 12345 123456 1234567",
    "abc123def 4x4 x86_64 v2.0.1 A1B2C3 1st 2nd 3rd 42nd 100km 3.5GHz",
    "$1,234,567.89 (+44) 20-7946-0958 #1234! 12:30:45 1/2 3/4 50% 1e-9 0xFF 0b1010 007",
    " 1  22   333    4444 \t55555\n666666\r\n7777777",
    "٠١٢٣٤٥٦٧٨٩ ۱۲۳۴ ०१२३४५ ０１２３４５６７８９ １２３ａｂｃ ২০২৬ ๑๒๓",
    "½ ¾ ⅓ ⅞ ² ³ ¹⁰ ₁₂ Ⅻ ⅻ ① ⑳ 𝟏𝟐𝟑 ၁၂၃",
    "for (int i = 0; i < 1000000; i += 256) { a[i] = 0x7fffffff & (i * 31); }\nx = [1, 22, 333, 4444]\n",
]
SPECIAL = {
    "mistral": ["<s>[INST] Hi! [/INST] Hello</s>"],
    "llama2": ["<s>[INST] Hi! [/INST] Hello</s>"],
    "llama3": ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"],
    "qwen3": ["<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>"],
}
LLAMA2_GGUF = "ggml-vocab-llama-spm.gguf"


def gguf_metadata(path):
    """The key/values of a GGUF file (version 2 or 3, little-endian)."""
    buf = path.read_bytes()
    pos = 0

    def take(fmt):
        nonlocal pos
        vals = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return vals[0]

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return buf[pos - n : pos].decode("utf-8")

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(ty):
        if ty == 8:
            return string()
        if ty == 9:
            inner, n = take("I"), take("Q")
            return [value(inner) for _ in range(n)]
        return take(scalars[ty])

    assert buf[:4] == b"GGUF", f"{path} is not a GGUF file"
    pos = 4
    version, _tensors, kvs = take("I"), take("Q"), take("Q")
    assert version in (2, 3), version
    md = {}
    for _ in range(kvs):
        key = string()
        md[key] = value(take("I"))
    return md


def proto_varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def proto_field(number, wire, payload):
    key = proto_varint(number << 3 | wire)
    if wire == 0:
        return key + proto_varint(payload)
    if wire == 5:
        return key + struct.pack("<f", payload)
    return key + proto_varint(len(payload)) + payload


def sentencepiece_model(md):
    """sentencepiece's ModelProto (sentencepiece_model.proto) for a `tokenizer.ggml.model` = llama GGUF: its pieces,
    scores and types (the GGUF's token types are sentencepiece's), a BPE trainer spec with byte fallback and
    Llama's normalizer (no normalization, a dummy `▁` prefix, whitespace kept as it is)."""
    assert md["tokenizer.ggml.model"] == "llama"
    pieces = b"".join(
        proto_field(1, 2, proto_field(1, 2, t.encode()) + proto_field(2, 5, s) + proto_field(3, 0, ty))
        for t, s, ty in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"])
    )
    ids = [md[f"tokenizer.ggml.{k}_token_id"] for k in ("unknown", "bos", "eos")]
    trainer = (
        proto_field(3, 0, 2)  # model_type: BPE
        + proto_field(4, 0, len(md["tokenizer.ggml.tokens"]))
        + proto_field(35, 0, 1)  # byte_fallback
        + b"".join(proto_field(40 + i, 0, id) for i, id in enumerate(ids))  # unk_id, bos_id, eos_id
        + proto_field(43, 0, (1 << 64) - 1)  # pad_id: -1
    )
    normalizer = (
        proto_field(1, 2, b"identity")
        + proto_field(3, 0, 1)  # add_dummy_prefix
        + proto_field(4, 0, 0)  # remove_extra_whitespaces: off
        + proto_field(5, 0, 1)  # escape_whitespaces
    )
    return pieces + proto_field(2, 2, trainer) + proto_field(3, 2, normalizer)


class SentencePieceReference:
    """Encodes as Hugging Face's LlamaTokenizerFast does with sentencepiece: special tokens in the text are whole
    ids, and each stretch of text between them is encoded alone (so each gets the dummy prefix)."""

    def __init__(self, md):
        self.sp = sentencepiece.SentencePieceProcessor(model_proto=sentencepiece_model(md))
        specials = [t for t, ty in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]) if ty == 3]
        self.special = re.compile("(" + "|".join(map(re.escape, specials)) + ")")

    def encode(self, text):
        ids = []
        for i, part in enumerate(self.special.split(text)):
            if i % 2:
                ids.append(self.sp.piece_to_id(part))
            elif part:
                ids += self.sp.encode(part)
        return ids

    def decode(self, ids):
        return self.sp.decode(ids)


def llama2_reference(root):
    """sentencepiece on the rebuilt Llama 2 model, checked first against llama.cpp's Hugging Face ids."""
    gguf = root / "llama2" / LLAMA2_GGUF
    md = gguf_metadata(gguf)
    ref = SentencePieceReference(md)
    texts = gguf.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outs = gguf.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    for text, out in zip(texts, outs, strict=False):
        want = [int(i) for i in out.split()]
        if ref.encode(text) != want:
            sys.exit(f"sentencepiece on {gguf} gives {ref.encode(text)} for {text!r}, Hugging Face gave {want}")
    return ref


def main():
    if tokenizers.__version__ != PINNED:
        sys.exit(f"tokenizers {tokenizers.__version__} installed, the reference is made with {PINNED}")
    if sentencepiece.__version__ != PINNED_SENTENCEPIECE:
        sys.exit(
            f"sentencepiece {sentencepiece.__version__} installed, the reference is made with {PINNED_SENTENCEPIECE}"
        )
    root = pathlib.Path(sys.argv[1])
    out = {"tokenizers": PINNED, "sentencepiece": PINNED_SENTENCEPIECE, "vocabularies": {}}
    for name, special in SPECIAL.items():
        pieces = None
        if name == "llama2":
            tok = llama2_reference(root)
            encode, decode = tok.encode, tok.decode
        else:
            tok = tokenizers.Tokenizer.from_file(str(root / name / "tokenizer.json"))
            encode = lambda text, tok=tok: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
            decode = lambda ids, tok=tok: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
            if tok.pre_tokenizer is not None:
                pieces = lambda text, tok=tok: [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]  # noqa: E731
        cases = []
        for text in SHARED + special:
            ids = encode(text)
            case = {"text": text, "ids": ids, "decoded": decode(ids)}
            if pieces:
                case["pieces"] = pieces(text)
            cases.append(case)
        out["vocabularies"][name] = cases
    dest = pathlib.Path(__file__).resolve().parent.parent / "engine/tests/data/tokenizer_reference.json"
    dest.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
