#!/bin/bash
# The cuda4 round's single device call (issue #8: faster RMSNorm, Q4_1 GEMV): the standard
# evidence script (h200_run.sh, SKIP_SLOW: kernel checks, GEMV and launch-cost bench, healthy
# and fault matrices, model benches with and without decode graphs), then, only while time is
# left (elapsed < NCU_BEFORE_S, default 200 s), a short Nsight Compute look at the rms_norm and
# Q4_1 kernels of one decode step (graphs off). Usage (GPU machine, llmdiff built --features
# cuda next to this script):
#   LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_cuda4_run.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
T0=$(date +%s)
SKIP_SLOW=1 LLMDIFF=$B OUT=$OUT bash $(dirname $0)/h200_run.sh
M=/tmp/gpu/models
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# bench --reps 1 runs a 16-token prefill twice before the first decode step (2 norms a layer
# plus the final one: 65 on 8B, 61 on smollm2; no GEMV, prefill is the matmul), then decode
# steps of as many norms (+ 210 Q4_1 GEMVs on smollm2). Skip those and the first decode step,
# profile the next step's matching kernels.
for spec in "llama8b:rms_norm:195:65" "smollm2-135m:regex:rms_norm|gemv_q4_1|matvec_q4_1:393:271"; do
  m=${spec%%:*}; rest=${spec#*:}; cnt=${rest##*:}; rest=${rest%:*}; skip=${rest##*:}; k=${rest%:*}
  el=$(( $(date +%s)-T0 ))
  if [ $el -ge ${NCU_BEFORE_S:-200} ] || [ -z "$NCU" ]; then echo "== ncu $m skipped (t=${el}s)" | tee -a $OUT/log.txt; continue; fi
  echo "== ncu: $k of one decode step of $m (graphs off, t=${el}s)" | tee -a $OUT/log.txt
  LLMDIFF_CUDA_GRAPH=0 timeout 60 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    -k "$k" --launch-skip $skip --launch-count $cnt \
    $B bench $M/$m.gguf --backend cuda --n-prompt 16 --n-decode 4 --reps 1 >/tmp/ncu_$m.csv 2>/tmp/ncu_$m.err
  echo "rc=$?" | tee -a $OUT/log.txt; tail -2 /tmp/ncu_$m.err | tee -a $OUT/log.txt
  python3 - /tmp/ncu_$m.csv <<'PY' >$OUT/ncu_$m.txt 2>&1
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("no ncu rows"); sys.exit()
h = rows[0]; ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in rows[1:]:
    u = r[ui]; v = float(r[vi].replace(",", ""))
    v = v / 1e3 if u in ("ns", "nsecond") else (v * 1e3 if u in ("ms", "msecond") else v)
    name = r[ki].split("(")[0]; tot[name] += v; cnt[name] += 1
print(f"{sum(cnt.values())} kernels, {sum(tot.values()):.1f} us (gpu__time_duration; CSV unit {rows[1][ui]}, shown in us)")
for k, v in sorted(tot.items(), key=lambda x: -x[1]): print(f"{k:40s} n={cnt[k]:4d} total {v:9.1f} us  mean {v/cnt[k]:7.2f} us")
PY
  cat $OUT/ncu_$m.txt | tee -a $OUT/log.txt
done
echo "== all done (t=$(( $(date +%s)-T0 ))s)" | tee -a $OUT/log.txt
