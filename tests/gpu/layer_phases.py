#!/usr/bin/env python3
"""Where the fused decode layer's time goes (issue #8, round 24): reads a `bench --trace` Chrome
trace of a step run with LLMDIFF_LAYER=1 and prints, per phase of `layer_q4k` (kernels/quant.cu),
over every block of every layer: the work (from the last grid barrier's exit to the block's
arrival at the next) and the wait at the barrier, in µs (median, 90th percentile, max), and the
phase's span (the last block's exit less the previous phase's last exit), summed over the layers.
For the launch record (`layer`): start → wait return, wait return → end. For each product's
`_pass` record: the copy warp's issue of its first stage → the block's x limbs made (work), → that
stage ready for thread 0's team (after).
Usage: layer_phases.py TRACE.json"""
import json, sys, statistics as st
from collections import defaultdict

ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("pid") == 1 and e.get("ph") == "X"]
ly = [e for e in ev if e["name"].startswith(("layer", "limbs"))]
phases = ["layer_qkv", "layer_attn", "layer_combine", "layer_o", "layer_gate_up", "layer_down"]


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


by = defaultdict(list)
for e in ly:
    by[e["name"]].append(e)
n_layers = max(1, len(by["layer"]) // max(1, len({e["args"]["block"] for e in by["layer"]})))
print(f"layers traced: {n_layers}, blocks a launch: {len({e['args']['block'] for e in by['layer']})}")
extra = [f"limbs_{p}_{x}" for p in ("qkv", "o", "gate_up", "down") for x in ("a", "b", "clk")]
for name in ["layer"] + phases + [p + "_pass" for p in ("layer_qkv", "layer_o", "layer_gate_up", "layer_down")] + extra:
    es = by[name]
    if not es:
        continue
    work = [e["args"]["wait_us"] or 0 for e in es]
    wait = [e["dur"] - (e["args"]["wait_us"] or 0) for e in es]
    print(f"{name:14s} work med {st.median(work):6.2f} p90 {q(work, .9):6.2f} max {max(work):6.2f} | "
          f"after med {st.median(wait):6.2f} p90 {q(wait, .9):6.2f} max {max(wait):6.2f} µs")
# Spans: per layer launch, the phases' last exits, in order.
starts = sorted({round(e["ts"], 1) for e in by["layer"]})
launch = sorted(by["layer"], key=lambda e: e["ts"])
ends = defaultdict(list)
for name in phases:
    for e in by[name]:
        ends[name].append(e["ts"] + e["dur"])
tot = defaultdict(float)
layer_ends = sorted(e["ts"] + e["dur"] for e in by["layer"])
# Group each phase's exits into layers by order (blocks of one layer exit together).
G = len({e["args"]["block"] for e in by["layer"]})
grp = {name: [sorted(ends[name])[i * G:(i + 1) * G] for i in range(len(ends[name]) // G)] for name in phases}
for i in range(min(len(v) for v in grp.values())):
    prev = min(e["ts"] for e in sorted(by["layer"], key=lambda e: e["ts"])[i * G:(i + 1) * G])
    for name in phases:
        last = max(grp[name][i])
        tot[name] += last - prev
        prev = last
k = min(len(v) for v in grp.values())
print(f"span a layer (first block start → phase's last exit, mean over {k} layers):",
      " ".join(f"{n[6:]} {tot[n] / max(1, k):.2f}" for n in phases), f"total {sum(tot.values()) / max(1, k):.2f} µs")
