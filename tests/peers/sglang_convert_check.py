#!/usr/bin/env python3
"""Checks harness/adapters/llmdiff_sglang.py on the committed SGLang dumper output
(golden/sglang-smollm2-tp3/raw-healthy/, written by SGLang's own dumper): re-converting it gives
the committed format 2 files' tensors and metadata; SGLang's dims strings parse to the layouts
they mean; bad input is refused in one line (exit 2), never converted.
Needs torch and safetensors. Run: python tests/peers/sglang_convert_check.py (prints
`N passed, M failed`; exit 1 on a failure; output committed as sglang_convert_check.out).
Not run by CI.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "harness", "adapters"))
import llmdiff_sglang as conv  # noqa: E402

G = os.path.join(ROOT, "golden", "sglang-smollm2-tp3")
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
results = []


def check(cond, what):
    results.append(bool(cond))
    print(f"{'PASS' if cond else 'FAIL'} {what}")


def run(args):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "harness", "adapters", "llmdiff_sglang.py")] + args,
                       capture_output=True, text=True)
    return p.returncode, p.stderr.strip()


def main():
    for dims, want in [("t h[tp]", "sharded"), ("t h[tp:partial]", "partial"), ("t h", "replicated"),
                       ("t h # tp:replicated", "replicated"), ("t (num_heads*head_dim)[tp]", "sharded"),
                       ("b s h[attn_tp]", "sharded")]:
        check(conv.parse_dims(dims) == want, f"dims {dims!r} -> {want}")
    for dims in ["t[tp] h", "t h[ep]", "t h[tp:zigzag]"]:
        try:
            conv.parse_dims(dims)
            check(False, f"dims {dims!r} refused")
        except conv.ConvertError as e:
            check(True, f"dims {dims!r} refused: {e}")

    tmp = tempfile.mkdtemp()
    try:
        out = os.path.join(tmp, "healthy")
        rc, err = run([os.path.join(G, "raw-healthy"), out, "--model", MODEL, "--config", os.path.join(G, "config.json")])
        check(rc == 0, f"converts raw-healthy (rc {rc})")
        for r in range(3):
            a = safe_open(f"{out}.rank{r}.safetensors", "pt")
            b = safe_open(os.path.join(G, f"healthy.rank{r}.safetensors"), "pt")
            same = sorted(a.keys()) == sorted(b.keys()) and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
            check(same and a.metadata() == b.metadata(), f"rank {r}: tensors and metadata equal the committed file")
        # A rank's files missing: refused.
        raw = os.path.join(tmp, "raw")
        shutil.copytree(os.path.join(G, "raw-healthy"), raw)
        for f in os.listdir(os.path.join(raw, "dump")):
            if "___rank=2___" in f:
                os.remove(os.path.join(raw, "dump", f))
        rc, err = run([raw, os.path.join(tmp, "x"), "--model", MODEL])
        check(rc == 2 and "ranks [2] of 3" in err and "\n" not in err, f"a rank missing: exit {rc}, {err!r}")
        # --strict: the dumps that map to no tap are refused by name.
        rc, err = run([os.path.join(G, "raw-healthy"), os.path.join(tmp, "y"), "--model", MODEL, "--strict"])
        check(rc == 2 and "map to no tap" in err, f"--strict: exit {rc}, {err!r}")
        rc, err = run([os.path.join(tmp, "nowhere"), os.path.join(tmp, "z"), "--model", MODEL])
        check(rc == 2 and "not a directory" in err, f"no such dir: exit {rc}, {err!r}")
    finally:
        shutil.rmtree(tmp)
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
