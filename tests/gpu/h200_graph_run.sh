#!/bin/bash
# The decode-graph round's device call (issue #8 item 6): the standard evidence script
# (h200_run.sh, SKIP_SLOW), a TP 3 simulated-ranks bench, then one decode step's kernels timed by
# Nsight Compute (ncu, gpu__time_duration only, clocks left alone) on the smollm2 and 8B shapes
# with decode graphs off. Usage (GPU machine, llmdiff built --features cuda next to this script):
#   LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_graph_run.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
SKIP_SLOW=1 LLMDIFF=$B OUT=$OUT bash $(dirname $0)/h200_run.sh
M=/tmp/gpu/models
echo "== extra: smollm2 TP 3 bench (simulated ranks, graphs vs plain)" | tee -a $OUT/log.txt
timeout 90 $B bench $M/smollm2-135m.gguf --backend cuda --tp 3 --n-prompt 512 --n-decode 64 --reps 3 --json >>$OUT/bench.jsonl 2>>$OUT/log.txt
tail -1 $OUT/bench.jsonl >>$OUT/log.txt
# ncu: bench runs prefill (16 tokens) 3 times before the first timed decode rep; skip those and
# the first decode step (a step of either shape launches under 600 kernels), profile the next.
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in smollm2-135m llama8b; do
  echo "== ncu: one decode step of $m (graphs off)" | tee -a $OUT/log.txt
  LLMDIFF_CUDA_GRAPH=0 timeout 90 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip 1800 --launch-count 480 \
    $B bench $M/$m.gguf --backend cuda --n-prompt 16 --n-decode 4 --reps 1 >/tmp/ncu_$m.csv 2>/tmp/ncu_$m.err
  echo "rc=$?" | tee -a $OUT/log.txt; tail -3 /tmp/ncu_$m.err | tee -a $OUT/log.txt
  python3 - /tmp/ncu_$m.csv <<'PY' >$OUT/ncu_$m.txt 2>&1
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("no ncu rows"); sys.exit()
h = rows[0]; ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
tot = collections.defaultdict(float); cnt = collections.Counter(); seq = []
for r in rows[1:]:
    # ncu reports gpu__time_duration in ns ("ns" or "nsecond"); converted to us here.
    u = r[ui]; v = float(r[vi].replace(",", ""))
    v = v / 1e3 if u in ("ns", "nsecond") else (v * 1e3 if u in ("ms", "msecond") else v)
    name = r[ki].split("(")[0]; tot[name] += v; cnt[name] += 1; seq.append((name, v))
print(f"{len(seq)} kernels, {sum(tot.values()):.1f} us of kernel time (gpu__time_duration; unit in the CSV: {rows[1][ui]})")
for k, v in sorted(tot.items(), key=lambda x: -x[1]): print(f"{k:40s} n={cnt[k]:4d} total {v:9.1f} us  mean {v/cnt[k]:7.2f} us")
print("sequence:"); [print(f"{n} {v:.2f}") for n, v in seq]
PY
  head -25 $OUT/ncu_$m.txt | tee -a $OUT/log.txt
done
