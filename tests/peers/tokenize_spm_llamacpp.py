#!/usr/bin/env python3
"""Synthetic SentencePiece ("llama" tokenizer model) conformance case against llama.cpp.

Writes golden/tokenizer-spm-synth.gguf, a vocab-only GGUF (no tensors) whose vocabulary is
<unk>/<s>/</s>, the 256 <0xNN> byte tokens, single characters and substrings of a small word list
with deterministic scores, then tokenizes the prompts below with llama-cpp-python
(`tokenize(text.encode(), add_bos=False, special=True)`) and writes golden/tokenizer-spm-synth.json.

    python3 tests/peers/tokenize_spm_llamacpp.py
"""
import json
import os
import random
import struct

import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGUF = os.path.join(ROOT, "golden", "tokenizer-spm-synth.gguf")
JSON = os.path.join(ROOT, "golden", "tokenizer-spm-synth.json")

WORDS = "the quick brown fox jumps over lazy dog hello world token model llama piece score merge byte space".split()

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "Hello World",
    "  two leading spaces",
    "trailing  ",
    "tokenizer models merge pieces by score",
    "unknown: xyzzy qwv",
    "digits 12345 and 3.14",
    "café ü 日本語 🙂",
    "line\nbreak\ttab",
    "<s>hello</s>world",
    "<s> the model</s>",
    "llamallama spacespace",
    "a",
    " ",
]

U32, I32, F32, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9


def s(x):
    b = x.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv(key, ty, val):
    out = s(key) + struct.pack("<I", ty)
    if ty == U32:
        return out + struct.pack("<I", val)
    if ty == F32:
        return out + struct.pack("<f", val)
    if ty == BOOL:
        return out + struct.pack("<B", val)
    if ty == STR:
        return out + s(val)
    elem, items = val
    out += struct.pack("<IQ", elem, len(items))
    for it in items:
        out += s(it) if elem == STR else struct.pack({I32: "<i", F32: "<f"}[elem], it)
    return out


def vocab():
    rng = random.Random(1234)
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(6)
    pieces = set("\u2581abcdefghijklmnopqrstuvwxyzHW")
    for w in WORDS:
        w = "\u2581" + w
        for i in range(len(w)):
            for j in range(i + 2, min(len(w), i + 6) + 1):
                pieces.add(w[i:j])
    for p in sorted(pieces):
        tokens.append(p)
        scores.append(-float(len(p)) * 0.5 + rng.uniform(-2.0, 2.0) if len(p) > 1 else -10.0)
        types.append(1)
    return tokens, scores, types


def write_gguf():
    tokens, scores, types = vocab()
    kvs = [
        kv("general.architecture", STR, "llama"),
        kv("general.name", STR, "spm-synth"),
        kv("llama.context_length", U32, 64),
        kv("llama.embedding_length", U32, 8),
        kv("llama.block_count", U32, 1),
        kv("llama.feed_forward_length", U32, 16),
        kv("llama.attention.head_count", U32, 2),
        kv("llama.attention.head_count_kv", U32, 2),
        kv("llama.rope.dimension_count", U32, 4),
        kv("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        kv("tokenizer.ggml.model", STR, "llama"),
        kv("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        kv("tokenizer.ggml.scores", ARR, (F32, scores)),
        kv("tokenizer.ggml.token_type", ARR, (I32, types)),
        kv("tokenizer.ggml.unknown_token_id", U32, 0),
        kv("tokenizer.ggml.bos_token_id", U32, 1),
        kv("tokenizer.ggml.eos_token_id", U32, 2),
        kv("tokenizer.ggml.add_bos_token", BOOL, 1),
    ]
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    with open(GGUF, "wb") as f:
        f.write(data)


def main():
    write_gguf()
    llm = llama_cpp.Llama(model_path=GGUF, vocab_only=True, verbose=False)
    cases = []
    for p in PROMPTS:
        ids = llm.tokenize(p.encode("utf-8"), add_bos=False, special=True)
        plain = llm.tokenize(p.encode("utf-8"), add_bos=False, special=False)
        cases.append({"prompt": p, "tokens": [int(t) for t in ids], "tokens_nospecial": [int(t) for t in plain]})
    head = {
        "model": os.path.basename(GGUF),
        "peer": f"llama-cpp-python {llama_cpp.__version__}",
        "call": "tokenize(text.encode(), add_bos=False, special=True); tokens_nospecial: special=False",
    }
    lines = [json.dumps(c, ensure_ascii=False) for c in cases]
    with open(JSON, "w", encoding="utf-8") as f:
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n ' + ",\n ".join(lines) + "\n]}\n")
    print(f"wrote {GGUF} and {len(cases)} cases to {JSON}")


if __name__ == "__main__":
    main()
