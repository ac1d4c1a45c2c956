#!/usr/bin/env python3
"""Single-thread gguf-py (numpy) dequantization throughput per type, on the same sizes as the Rust
bench (engine/benches/dequant.rs): 4 Mi elements of random blocks with sane f16 scales.

Run single-threaded, without the OPENBLAS tuning variables:
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MKL_NUM_THREADS=1 NUMEXPR_NUM_THREADS=1 python3 tests/peers/bench_gguf_py.py
Arguments: [reps (5)] [TYPE ...] (only those types). Prints one line per type: name, best-of-N
seconds, Gelem/s.
"""

import os
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

N_ELEMS = 1 << 22
HALVES = {T.Q4_0: [0], T.Q5_0: [0], T.Q8_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2],
          T.Q5_K: [0, 2], T.Q2_K: [80, 82], T.Q3_K: [108], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0],
          T.IQ1_S: [0], T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0],
          T.TQ1_0: [52], T.TQ2_0: [64]}
TYPES = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.BF16,
         T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
         T.TQ1_0, T.TQ2_0]


def make_src(qtype, rng):
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = N_ELEMS // block_elems
    src = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    if qtype == T.MXFP4:
        src[:, 0] = 120 + src[:, 0] % 8  # e8m0 scales near 1
    elif qtype == T.IQ1_M:
        # d is the top nibbles of the four u16 scale words (bytes 48..56): a small finite one.
        d = (0.01 + (src[:, 0] % 16) * 1e-3).astype(np.float16).view(np.uint16).astype(np.int64)
        for i in range(4):
            src[:, 49 + 2 * i] = (src[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    if qtype in (T.F16, T.BF16):
        src[:, 1] &= 0x3F
    elif qtype == T.F32:
        src[:, 3] &= 0x3F
    for off in HALVES.get(qtype, []):
        d = (rng.integers(0, 1000, size=n_blocks) * 1e-4 - 0.05).astype(np.float16)
        src[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return src.reshape(-1)


def main():
    rng = np.random.default_rng(5)
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    only = set(sys.argv[2:])  # type names to run (all when none)
    for qtype in TYPES:
        if only and qtype.name not in only:
            continue
        src = make_src(qtype, rng)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            out = dequantize(src, qtype)
            # F32 is a zero-copy view in gguf-py; force the values to be materialized like the others.
            if qtype == T.F32:
                out = np.array(out, dtype=np.float32, copy=True)
            best = min(best, time.perf_counter() - t0)
        assert out.size == N_ELEMS
        print(f"{qtype.name:7} {best:.4f} s {N_ELEMS / best / 1e9:.4f} Gelem/s", flush=True)


if __name__ == "__main__":
    main()
