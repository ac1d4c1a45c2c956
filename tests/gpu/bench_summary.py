"""Summarizes `llmdiff kernels --bench --json` (tests/gpu/h200_*.sh): the copy bandwidth, then per
GEMV case the default variant and the three fastest, the read probe, then the prefill GEMM paths
and the attention benches when present."""
import json
import sys

d = json.load(open(sys.argv[1]))
print("copy GB/s", round(d["copy_gb_per_s"]))
cases = {}
for r in d["bench"]:
    cases.setdefault(r["case"], []).append(r)


def fmt(r):
    pre = r.get("fraction_of_copy_with_prepass")
    pre = f" (pre-pass each launch {100 * pre:.1f} %)" if pre else ""
    return f"{r['variant']} {r['seconds'] * 1e6:.2f} us {100 * r['fraction_of_copy']:.1f} %{pre}"


for c, rs in cases.items():
    dflt = [r for r in rs if r.get("default")] or [r for r in rs if r["variant"] is None]
    best = sorted((r for r in rs if r["variant"]), key=lambda r: r["seconds"])[:3]
    head = f"{c}: default {fmt(dflt[0])}" if dflt else c
    print(head + "; best " + ", ".join(fmt(r) for r in best))
for r in d.get("read_probe", []):
    print(r["case"], r["pattern"], f"{r['seconds'] * 1e6:.2f} us {100 * r['fraction_of_copy']:.1f} %")
for g in d.get("gemm_bench", []):
    print(g["case"], " | ".join(f"{p['path']} {p['seconds'] * 1e6:.1f} us {p['tflops']:.1f} TF" for p in g["paths"]))
if "attention_bench" in d:
    print("attention", d["attention_bench"])
for a in d.get("attention_decode_bench", []):
    parts = " | ".join(f"L={s['chunk']} {s['seconds'] * 1e6:.1f} us" for s in a["split"])
    print(a["case"], f"per-head {a['old_seconds'] * 1e6:.1f} us | split {parts}")
