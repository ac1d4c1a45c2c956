#!/usr/bin/env python3
"""Regenerate HF transformers fp32 expectations for a GGUF model: top-50 log-probabilities per position.

HF loads the GGUF itself (dequantizing to fp32), so both sides compute with the same weights.
Usage: hf_logits.py MODEL.gguf OUT.json [--prompts FILE] [--tokens-from-hf | --token-cases JSON]
Not run by CI; its output is committed in golden/.
"""
import argparse, json, os, sys, time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    "Photosynthesis converts light energy into",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Les étudiants ont écrit leurs examens et ensuite",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--top", type=int, default=50)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    d, f = os.path.split(os.path.abspath(args.model))
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=dtype)
    model.eval()
    cases = []
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        positions = []
        for row in lp:
            v, i = torch.topk(row, args.top)
            positions.append({"top": [[int(a), float(b)] for a, b in zip(i, v)]})
        cases.append({"prompt": p, "tokens": ids, "positions": positions})
    doc = {
        "format": 1,
        "model": f,
        "peer": f"transformers {transformers.__version__}, torch {torch.__version__}, {args.dtype}",
        "generated_by": "tests/peers/hf_logits.py",
        "cases": cases,
    }
    with open(args.out, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    print(f"wrote {args.out}: {len(cases)} prompts, {sum(len(c['tokens']) for c in cases)} positions")


if __name__ == "__main__":
    main()
