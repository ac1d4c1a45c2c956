#!/bin/bash
# One device call for the one-token GEMV work splits (issue #8): the kernel checks (every GEMV
# variant, x-stationary gemv_*, warp-rows gemvw_* (and, in round 6, warp-rows with x in shared
# memory, gemvs_*, since removed: it never won),
# against the CPU engine on odd shapes), then `kernels --bench`, which times every compiled
# variant on the 8B shapes (Q4_K, Q8_0, Q4_1, F16) and smollm2's Q4_1 shapes in one process, the
# default marked `*`. Usage (on the GPU machine, with a llmdiff built --features cuda carried):
#   LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_gemv_sweep.sh
# Files in $OUT: log.txt, kernels_check.txt, kernels_check.json, gemv_bench.txt, gemv_bench.json.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/target/release/llmdiff}
LOG=$OUT/log.txt
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader >>$LOG 2>&1
echo "== kernels --check" | tee -a $LOG
timeout 150 $B kernels --check >$OUT/kernels_check.txt 2>&1; echo "rc=$?" >>$LOG
grep -E "FAIL|kernel checks pass|error|panic" $OUT/kernels_check.txt | tee -a $LOG
echo "== kernels --check --json (t=$(( $(date +%s)-T0 ))s)" | tee -a $LOG
timeout 150 $B kernels --check --json >$OUT/kernels_check.json 2>>$LOG
echo "== kernels --bench (t=$(( $(date +%s)-T0 ))s)" | tee -a $LOG
timeout 120 $B kernels --bench >$OUT/gemv_bench.txt 2>&1; echo "rc=$?" >>$LOG
echo "== kernels --bench --json (t=$(( $(date +%s)-T0 ))s)" | tee -a $LOG
timeout 120 $B kernels --bench --json >$OUT/gemv_bench.json 2>>$LOG; echo "rc=$?" >>$LOG
# Per case: the default, then the three best variants.
python3 $(dirname $0)/bench_summary.py "$OUT/gemv_bench.json" | tee -a $LOG
echo "== done (t=$(( $(date +%s)-T0 ))s)" | tee -a $LOG
