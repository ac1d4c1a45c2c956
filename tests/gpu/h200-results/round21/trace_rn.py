"""The `_rn` GEMVs' grid barrier in a `bench --trace` Chrome trace (round 21).

The `_rn` GEMVs were tried and dropped in round 21; their code is `resid_norm.patch` here (on
fd9639f). An `_rn` GEMV (the o and down projections with the residual add and the next RMSNorm
fused in, kernels/quant.cu `resid_norm_end`) has two kinds of block: the first block of every 32 rows (a
leader) waits at the barrier for every block's sum of squares, then normalizes its rows; the
others arrive and end. For each such launch shape (grid 1024: R 4; grid 512: R 8) this prints,
averaged over the step's launches, in µs after the launch's first block started: the waits'
return, the other blocks' ends (median, 90th percentile, last) and the leaders' ends (first,
last), and the next GEMV's first wait return: the barrier's cost is the gap from the last
other block to the last leader. On a trace without them (the add + norm its own launch, as
round 20's), the leaders are the same blocks and the next GEMV is the launch after the norm, so
"wait returns" to "next GEMV's wait returns" compares the two forms.

Usage: python3 tests/gpu/trace_rn.py trace_llama8b.json.gz [grid:R ...]   (default 1024:4 512:8)
"""
import gzip
import json
import statistics
import sys


def main():
    path = sys.argv[1]
    shapes = [tuple(int(v) for v in a.split(":")) for a in sys.argv[2:]] or [(1024, 4), (512, 8)]
    ev = json.load(gzip.open(path))["traceEvents"]
    launches = [e for e in ev if e.get("pid") == 0 and e.get("ph") == "X"]
    blocks = [e for e in ev if e.get("pid") == 1 and e.get("ph") == "X"]
    end = lambda e: e["ts"] + e["dur"]
    by_grid = {}
    for b in blocks:
        by_grid.setdefault(b["args"]["grid"], []).append(b)
    for grid, r in shapes:
        rows = []
        for i, l in enumerate(launches[:-1]):
            if l["args"]["blocks"] != grid:
                continue
            t0, t1 = l["ts"], l["ts"] + l["dur"]
            bs = [b for b in by_grid.get(grid, []) if b["ts"] >= t0 - 0.01 and end(b) <= t1 + 0.01]
            waits = [b["ts"] + b["args"]["wait_us"] for b in bs if b["args"]["wait_us"]]
            lead = sorted(end(b) for b in bs if b["args"]["block"] * r % 32 == 0)
            other = sorted(end(b) for b in bs if b["args"]["block"] * r % 32 != 0)
            nxt = launches[i + 1]
            if nxt["name"].startswith("add_rms_norm") and i + 2 < len(launches):
                nxt = launches[i + 2]
            nb = [b for b in by_grid.get(nxt["args"]["blocks"], []) if b["ts"] >= nxt["ts"] - 0.01]
            nb = [b["ts"] + b["args"]["wait_us"] for b in nb if b["args"]["wait_us"] and end(b) <= nxt["ts"] + nxt["dur"] + 0.01]
            if not (waits and lead and other and nb):
                continue
            rows.append([
                min(waits) - t0,
                other[len(other) // 2] - t0,
                other[int(len(other) * 0.9)] - t0,
                other[-1] - t0,
                lead[0] - t0,
                lead[-1] - t0,
                min(nb) - t0,
            ])
        if not rows:
            print(f"grid {grid}: no launches")
            continue
        m = [statistics.mean(c) for c in zip(*rows)]
        print(
            f"grid {grid} (R {r}, {len(rows)} launches): wait returns {m[0]:.2f}; other blocks end p50 {m[1]:.2f} "
            f"p90 {m[2]:.2f} last {m[3]:.2f}; leaders end {m[4]:.2f}..{m[5]:.2f} (barrier {m[5] - m[3]:.2f}); "
            f"next GEMV's wait returns {m[6]:.2f} µs ({m[6] - m[0]:.2f} after this one's)"
        )


if __name__ == "__main__":
    main()
