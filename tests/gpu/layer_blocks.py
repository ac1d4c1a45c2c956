#!/usr/bin/env python3
"""One fused layer's records for a few blocks (round 24): every `layer*` record of layer L
(default 10) of blocks B (default 5 77), µs from that layer's launch record's start.
Usage: layer_blocks.py TRACE.json[.gz] [L] [B ...]"""
import json, gzip, sys
from collections import defaultdict

f = sys.argv[1]
d = json.load(gzip.open(f) if f.endswith(".gz") else open(f))
ev = [e for e in d["traceEvents"] if e.get("pid") == 1 and e.get("ph") == "X" and e["name"].startswith("layer")]
li = int(sys.argv[2]) if len(sys.argv) > 2 else 10
blocks = [int(b) for b in sys.argv[3:]] or [5, 77]
by = defaultdict(list)
for e in ev:
    by[e["args"]["block"]].append(e)
for blk in blocks:
    es = sorted(by[blk], key=lambda e: (e["ts"], e["name"]))
    lay = sorted((e for e in es if e["name"] == "layer"), key=lambda e: e["ts"])[li]
    t0, t1 = lay["ts"], lay["ts"] + lay["dur"]
    print(f"block {blk}, layer {li}")
    for e in es:
        if t0 - 30 <= e["ts"] <= t1 and (e["ts"] + e["dur"] >= t0):
            if e["name"] != "layer" and e["ts"] + e["dur"] > t1 + 0.01:
                continue
            w = e["args"]["wait_us"]
            mid = e["ts"] - t0 + w if w else float("nan")
            print(f"  {e['name']:20s} start {e['ts'] - t0:7.2f} mid {mid:7.2f} end {e['ts'] + e['dur'] - t0:7.2f}")
