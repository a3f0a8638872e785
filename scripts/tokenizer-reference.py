#!/usr/bin/env python3
"""Writes engine/tests/data/tokenizer_reference.json: the ids and decodings Hugging Face's own `tokenizers`
(pinned below) gives for a corpus, on the real tokenizer.json files scripts/fetch-tokenizers.sh caches.
engine/tests/tokenizer_reference.rs rebuilds each vocabulary from GGUF metadata and must match.

    py=$(scripts/python-env.sh --bare); "$py" -m pip install tokenizers==0.23.3
    "$py" scripts/tokenizer-reference.py "$(scripts/fetch-tokenizers.sh)"
"""
import json
import pathlib
import sys

import tokenizers

PINNED = "0.23.3"
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
]
SPECIAL = {
    "llama2": ["<s>[INST] Hi! [/INST] Hello</s>"],
    "llama3": ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"],
    "qwen3": ["<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>"],
}


def main():
    if tokenizers.__version__ != PINNED:
        sys.exit(f"tokenizers {tokenizers.__version__} installed, the reference is made with {PINNED}")
    root = pathlib.Path(sys.argv[1])
    out = {"tokenizers": PINNED, "vocabularies": {}}
    for name, special in SPECIAL.items():
        tok = tokenizers.Tokenizer.from_file(str(root / name / "tokenizer.json"))
        cases = []
        for text in SHARED + special:
            ids = tok.encode(text, add_special_tokens=False).ids
            cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
        out["vocabularies"][name] = cases
    dest = pathlib.Path(__file__).resolve().parent.parent / "engine/tests/data/tokenizer_reference.json"
    dest.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
