#!/usr/bin/env python3
"""llama.cpp's CPU logprobs against exact f32 math (HF fp32, committed in golden/hf-smollm2.json),
on the same token ids: the "llama.cpp vs exact" figure. llama.cpp quantizes activations to Q8 in
its CPU dot products, so it is not the conformance bar for the reference. Not run by CI.

Usage: llamacpp_vs_exact.py MODEL.gguf golden/hf-smollm2.json [--f32-kv]
"""
import argparse, json, math

import llama_cpp
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("golden")
    ap.add_argument("--f32-kv", action="store_true", help="f32 KV cache (type_k=type_v=0) instead of f16")
    a = ap.parse_args()
    kw = dict(type_k=0, type_v=0) if a.f32_kv else {}
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=512, n_threads=2, logits_all=True, verbose=False, **kw)
    doc = json.load(open(a.golden))
    worst, same, n = 0.0, 0, 0
    for case in doc["cases"]:
        llm.reset()
        llm.eval(case["tokens"])
        logits = np.array(llm.scores[: len(case["tokens"])], dtype=np.float64)
        for row, pos in zip(logits, case["positions"]):
            m = row.max()
            lp = row - (m + math.log(np.exp(row - m).sum()))
            top = pos["top"]
            same += int(np.argmax(lp) == top[0][0])
            worst = max(worst, max(abs(lp[i] - v) for i, v in top))
            n += 1
    kv = "f32" if a.f32_kv else "f16 (default)"
    print(f"llama.cpp {llama_cpp.__version__} (KV cache {kv}) vs HF fp32: worst |dlogprob| over top-50 {worst:.3f}, top-1 {same}/{n}")


if __name__ == "__main__":
    main()
