"""Sums Nsight Compute's gpu__time_duration CSV per kernel name (tests/gpu/h200_*_run.sh); an
optional second argument divides the totals by that many passes (per decode step), or, as
`per:NAME`, by the number of launches of kernel NAME (one a pass). Further arguments
`grid:NAME[:N]` print NAME's mean time per grid size (one shape of launch), by launch index mod N
within it (e.g. N = 2 parts two shapes of one grid size that alternate)."""
import collections
import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("no ncu rows")
    sys.exit()
h = rows[0]
ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
gi = h.index("Grid Size") if "Grid Size" in h else None
tot, cnt = collections.defaultdict(float), collections.Counter()
seq = collections.defaultdict(list)
for r in rows[1:]:
    u, v = r[ui], float(r[vi].replace(",", ""))
    v = v / 1e3 if u in ("ns", "nsecond") else (v * 1e3 if u in ("ms", "msecond") else v)
    name = r[ki].split("(")[0]
    tot[name] += v
    cnt[name] += 1
    seq[name].append((r[gi] if gi is not None else "?", v))
arg = sys.argv[2] if len(sys.argv) > 2 else "1"
steps = float(cnt[arg[4:]] or 1) if arg.startswith("per:") else float(arg)
print(f"{sum(cnt.values())} kernels over {steps:g} pass(es): {sum(tot.values()) / steps:.1f} us a pass (gpu__time_duration)")
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{k:40s} n/pass={cnt[k] / steps:6.1f} us/pass {v / steps:9.1f}  mean {v / cnt[k]:7.2f} us")
for a in sys.argv[3:]:
    f = a.split(":")
    name, n = f[1], int(f[2]) if len(f) > 2 else 1
    groups = collections.defaultdict(list)
    for g, t in seq.get(name, []):
        groups[g].append(t)
    for g, ts in sorted(groups.items(), key=lambda x: x[0]):
        for i in range(n):
            part = ts[i::n]
            print(f"{name} grid {g} launch {i} mod {n}: mean {sum(part) / len(part):7.2f} us over {len(part)}")
