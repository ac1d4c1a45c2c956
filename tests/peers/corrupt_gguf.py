#!/usr/bin/env python3
"""Write a deliberately corrupted copy of a GGUF model, for checking that `llmdiff entropy --server`
flags a broken deployment. The copy is byte-identical except for one tensor's data, located with
gguf-py's reader (header, metadata and alignment untouched, so any GGUF loader still accepts it).

  --zero-attn-v L     zero blk.L.attn_v.weight (zero bytes are zero weights in F32/F16/Q4_0/Q4_1/Q8_0/K-quants)
  --permute-embd SEED permute token_embd.weight rows (quantized rows are self-contained blocks)
  --zero NAME         zero any tensor by name

Usage: corrupt_gguf.py IN.gguf OUT.gguf (--zero-attn-v L | --permute-embd SEED | --zero NAME)...
"""
import argparse, shutil

import numpy as np
from gguf import GGUFReader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--zero-attn-v", type=int, action="append", default=[])
    ap.add_argument("--zero", action="append", default=[])
    ap.add_argument("--permute-embd", type=int)
    a = ap.parse_args()
    r = GGUFReader(a.src)
    tensors = {t.name: t for t in r.tensors}
    shutil.copyfile(a.src, a.dst)
    zero = list(a.zero) + [f"blk.{l}.attn_v.weight" for l in a.zero_attn_v]
    with open(a.dst, "r+b") as f:
        for name in zero:
            t = tensors[name]
            f.seek(t.data_offset)
            f.write(b"\0" * int(t.n_bytes))
            print(f"zeroed {name} ({t.n_bytes} bytes)")
        if a.permute_embd is not None:
            t = tensors["token_embd.weight"]
            rows = np.array(t.data).reshape(t.data.shape[0], -1).view(np.uint8)
            perm = np.random.default_rng(a.permute_embd).permutation(rows.shape[0])
            f.seek(t.data_offset)
            f.write(rows[perm].tobytes())
            print(f"permuted {rows.shape[0]} rows of token_embd.weight (seed {a.permute_embd})")


if __name__ == "__main__":
    main()
