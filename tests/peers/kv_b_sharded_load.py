#!/usr/bin/env python3
"""A kv_b loaded whole where each rank expected its slice (the seed story's vLLM fault), planted
in a small PyTorch re-implementation of an MLA engine's sharded load, and fingerprinted with the
adapter (harness/adapters/llmdiff_dump.py `fingerprint`).

HF transformers' TP plan for DeepSeek-V3 does not shard MLA's kv_b the way vLLM does, so the load
is re-implemented here: the GGUF's split attn_k_b / attn_v_b are reassembled into kv_b
`[H·(nope+v), kv_lora]` (cat([k_bᵀ, v_b], dim=1), as vLLM's checkpoint holds it), and TP 2 gives
rank r the rows of heads r·H/2 .. (r+1)·H/2. Rank 0 loads its shard; rank 1 keeps the whole
tensor, while both declare their shard's rows. Writes OUT.json:
{"model": ..., "tp": 2, "weights": {"blk.L.w.kv_b@rN": fingerprint}}.

Usage: kv_b_sharded_load.py golden/deepseek-v3-tiny.f32.gguf golden/kv-b-fingerprints-tp2.json
Not run by CI (needs torch + gguf); its output is committed and checked by tests/tests/candidate_tp.rs.
"""
import json
import os
import sys

import numpy as np
import torch
from gguf import GGUFReader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "harness", "adapters"))
import llmdiff_dump  # noqa: E402


def field(r, name):
    f = r.fields[name]
    return f.parts[f.data[0]].tolist()[0]


def main():
    path, out = sys.argv[1], sys.argv[2]
    r = GGUFReader(path)
    H = field(r, "deepseek2.attention.head_count")
    kv_lora = field(r, "deepseek2.attention.kv_lora_rank")
    nope = field(r, "deepseek2.attention.key_length_mla") - field(r, "deepseek2.rope.dimension_count")
    v = field(r, "deepseek2.attention.value_length_mla")
    tensors = {t.name: t for t in r.tensors}
    tp, layer = 2, 0
    k_b = torch.from_numpy(np.array(tensors[f"blk.{layer}.attn_k_b.weight"].data, dtype=np.float32))
    v_b = torch.from_numpy(np.array(tensors[f"blk.{layer}.attn_v_b.weight"].data, dtype=np.float32))
    k_b = k_b.reshape(H, kv_lora, nope)  # ne {nope, kv_lora, H}
    v_b = v_b.reshape(H, v, kv_lora)  # ne {kv_lora, v, H}
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(H * (nope + v), kv_lora)
    rows = kv_b.shape[0] // tp
    weights = {}
    for rank in range(tp):
        a, b = rank * rows, (rank + 1) * rows
        loaded = kv_b[a:b] if rank == 0 else kv_b  # rank 1: the unsharded load
        fp = llmdiff_dump.fingerprint(loaded, layout=f"sharded(0,{a}:{b})")
        fp["module"] = f"model.layers.{layer}.self_attn.kv_b_proj"
        weights[f"blk.{layer}.w.kv_b@r{rank}"] = fp
    with open(out, "w") as f:
        json.dump({"model": os.path.basename(path), "tp": tp, "weights": weights}, f)
    print(out, {k: w["shape"] for k, w in weights.items()})


if __name__ == "__main__":
    main()
