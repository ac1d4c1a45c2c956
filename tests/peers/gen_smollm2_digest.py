#!/usr/bin/env python3
"""Write golden/smollm2-dequant-sha256.json: for every tensor of SmolLM2-135M-Instruct.Q4_1.gguf,
the sha256 of gguf-py's dequantized float32 values as little-endian bytes (the oracle digest that
tests/tests/dequant_smollm2.rs checks the reference dequantizer against).

Usage: python3 tests/peers/gen_smollm2_digest.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
(default: $LLMDIFF_SMOLLM2, else <repo>/.cache/SmolLM2-135M-Instruct.Q4_1.gguf). Needs gguf, numpy.
"""

import hashlib
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    path = (sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LLMDIFF_SMOLLM2")
            or os.path.join(ROOT, ".cache", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    reader = GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        raw = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
        values = np.ascontiguousarray(dequantize(raw, t.tensor_type), dtype="<f4").reshape(-1)
        assert values.size == int(np.prod(t.shape)), t.name
        assert not np.isnan(values).any(), f"{t.name} has NaNs"
        tensors[t.name] = {
            "type": t.tensor_type.name,
            "n_elems": int(values.size),
            "sha256": hashlib.sha256(values.tobytes()).hexdigest(),
        }
    out = {"model": os.path.basename(path), "oracle": "gguf-py quants.dequantize, float32 LE",
           "tensors": tensors}
    dest = os.path.join(ROOT, "golden", "smollm2-dequant-sha256.json")
    with open(dest, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(tensors)} tensors -> {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
