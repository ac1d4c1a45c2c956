#!/usr/bin/env python3
"""Tokenizer expectations from llama.cpp (through llama-cpp-python) for the SmolLM2 GGUF.

Tokenizes every prompt below with `llm.tokenize(text.encode(), add_bos=False, special=True)`
(and again with `special=False`, as `tokens_nospecial`) and writes golden/tokenizer-smollm2.json, which tests/tests/tokenizer_smollm2.rs checks our
tokenizer against id for id.

    pip install llama-cpp-python   # a source build, about 10+ minutes on 2 cores
    python3 tests/peers/tokenize_llamacpp.py [MODEL.gguf]

MODEL defaults to .cache/SmolLM2-135M-Instruct.Q4_1.gguf (fetched by the Rust fixtures).
"""
import json
import os
import sys

import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [
    # plain English, contractions, case
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done what we'd said; it's John's.",
    "DON'T SHOUT. I'M HERE AND YOU'LL HEAR ME, 'S IT?",
    "'s 't 're 've 'm 'll 'd",
    "rock'n'roll isn't o'clock",
    # digits and numbers
    "12345678901234567890",
    "Pi is 3.14159265358979, e is 2.71828.",
    "The year 2024 had 366 days and 8784 hours.",
    "1,000,000 + 2.5e-10 = ?",
    "phone: +1 (555) 010-9999 ext. 42",
    "v1.2.3-rc4",
    "٣٤٥ and ١٢ and Ⅻ and ½ and ²³",
    # code
    "def add(a, b):\n    return a + b\n",
    "fn main() {\n\tprintln!(\"{}\", 1 + 2);\n}\n",
    "for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "<div class=\"box\"><a href='https://example.com/?q=1&r=2'>link</a></div>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "#include <stdio.h>\nint main(void) { return 0; }",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
    "$ ls -la | grep '.rs' && echo \"done\" >> /tmp/log.txt",
    # unicode: accents, CJK, emoji, other scripts
    "café naïve résumé Ångström façade jalapeño",
    "Größe, Straße, Übermaß",
    "日本語のテキストです。東京は大きい。",
    "中文分词测试：你好，世界！",
    "한국어 문장입니다.",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "🙂🚀🔥 emoji test 👍🏽 👨‍👩‍👧‍👦",
    "Flags: 🇫🇷🇯🇵 and keycaps 1️⃣",
    "Mathematical: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ ≈ ∫ f(x) dx",
    "e\u0301 vs \u00e9 (combining acute)",
    "zero\u200bwidth\u200bspace and non\u00a0breaking and ideographic\u3000space",
    # whitespace runs, newlines, tabs
    "a  b   c    d",
    "   leading spaces",
    "trailing spaces   ",
    "line1\nline2\n\nline4\n\n\n",
    "\t\ttabs\tand\t spaces \t mixed",
    "\r\nWindows\r\nline endings\r\n",
    "  \n  \n",
    " ",
    "\n",
    "x",
    "!!!???...",
    "-- -- ---- ==== ____ ~~~~",
    "(parentheses) [brackets] {braces} <angles>",
    "Quotes: “smart” ‘single’ «guillemets» „low“",
    "email@example.com, http://a.b/c?d=e#f",
    # chat template special tokens (parse_special = true)
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before<|endoftext|>text after",
    "<|im_start|><|im_end|><|im_start|>",
    "not special: <|im_start and im_end|> <| |>",
    "<|im_start|> leading space after special",
    # mixed / long
    "Mixed 123abc456DEF and CamelCaseWords with snake_case_names.",
    "The model's answer was: \"42\". Isn't that right?!",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua. " * 3,
]


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".cache", "SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    cases = []
    for p in PROMPTS:
        ids = llm.tokenize(p.encode("utf-8"), add_bos=False, special=True)
        plain = llm.tokenize(p.encode("utf-8"), add_bos=False, special=False)
        cases.append({"prompt": p, "tokens": [int(t) for t in ids], "tokens_nospecial": [int(t) for t in plain]})
    out = {
        "model": os.path.basename(model),
        "peer": f"llama-cpp-python {llama_cpp.__version__}",
        "call": "tokenize(text.encode(), add_bos=False, special=True); tokens_nospecial: special=False",
        "cases": cases,
    }
    path = os.path.join(ROOT, "golden", "tokenizer-smollm2.json")
    # One case a line, so a diff of the golden file shows which prompts changed.
    head = {k: v for k, v in out.items() if k != "cases"}
    lines = [json.dumps(c, ensure_ascii=False) for c in cases]
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n ' + ",\n ".join(lines) + "\n]}\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
