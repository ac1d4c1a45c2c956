"""Where a kernel's time goes, from `bench --trace` runs with LLMDIFF_TRACE_MARK (round 20).

Each run moved the wait's slot of every block's record to one numbered point inside the
kernels (kernels/ops.cu: 11 after the residual add, 12 after the sum of squares, 13 after the
normed row's store; kernels/attention.cu, split kernel: 21 q staged, 22 scores, 23 softmax,
24 partial rows, 25 after the arrival, 26 and 27 in the combine; kernels/quant.cu, fused FFN: 31
gate/up done, 32 past the grid barrier, 33 SwiGLU's limbs made). For each run and kernel this
prints, averaged over the step's launches, the median and the latest mark and end over the
blocks that waited, in µs after the launch before it ended.

Usage: python3 tests/gpu/trace_marks.py mark_0.json.gz mark_11.json.gz ...
"""
import bisect
import gzip
import json
import re
import statistics
import sys

KERNELS = ("attention", "add_rms_norm", "ffn")


def launch_stats(path):
    ev = json.load(gzip.open(path))["traceEvents"]
    launches = [e for e in ev if e.get("pid") == 0 and e.get("ph") == "X"]
    blocks = sorted((e for e in ev if e.get("pid") == 1 and e.get("ph") == "X"), key=lambda e: e["ts"])
    starts = [b["ts"] for b in blocks]
    out = {k: [] for k in KERNELS}
    for i, l in enumerate(launches[1:], 1):
        kernel = l["name"].split("[")[0]
        if kernel not in out:
            continue
        prev_end = launches[i - 1]["ts"] + launches[i - 1]["dur"]
        j, mine = bisect.bisect_left(starts, l["ts"] - 1e-6), []
        while j < len(blocks) and len(mine) < l["args"]["blocks"]:
            if blocks[j]["name"] == kernel:
                mine.append(blocks[j])
            j += 1
        waited = [b for b in mine if b["args"]["wait_us"] is not None] or mine
        marks = [b["ts"] + (b["args"]["wait_us"] or 0) - prev_end for b in waited]
        ends = [b["ts"] + b["dur"] - prev_end for b in waited]
        out[kernel].append((statistics.median(marks), max(marks), statistics.median(ends), max(ends)))
    return out


for path in sys.argv[1:]:
    mark = re.search(r"mark_(\d+)", path)
    for kernel, rows in launch_stats(path).items():
        if not rows:
            continue
        mean = [statistics.mean(r[i] for r in rows) for i in range(4)]
        print(f"mark {mark.group(1) if mark else '?':>2} {kernel:13s} mark median {mean[0]:5.2f} latest {mean[1]:5.2f}"
              f" | end median {mean[2]:5.2f} latest {mean[3]:5.2f} µs ({len(rows)} launches)")
