#!/bin/bash
# Round 10 (issue #8): Nsight Compute sections (speed of light, warp states, memory, occupancy) of
# one 8B decode layer's GEMV launches (q/k/v, o, gate/up, down), under each configuration of
# NCU_ENVS (space-separated label=VAR=value[,VAR=value]; "default" as is), graphs off.
# Usage (GPU machine, after h200_round8_dev.sh made the models): LLMDIFF=... OUT=... bash this.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
M=/tmp/gpu/models
NCUB=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -f $M/llama8b.gguf ] || timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null
for cfg in ${NCU_ENVS:-default}; do
  label=${cfg%%=*}; envs=X=1; [ "$label" != "$cfg" ] && envs=$(echo ${cfg#*=} | tr ',' ' ')
  echo "== ncu sections $label"
  # Per step 129 GEMV launches (4 a layer, then lm_head); skip the prompt step and one decode step.
  env $envs LLMDIFF_CUDA_GRAPH=0 timeout 200 $NCUB --clock-control none --kernel-name regex:gemv \
    --launch-skip 262 --launch-count 4 --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio \
    --csv --page details $B bench $M/llama8b.gguf --backend cuda --n-prompt 1 --n-decode 4 --reps 1 \
    >$OUT/ncu_$label.csv 2>$OUT/ncu_$label.err
  python3 - $OUT/ncu_$label.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print("no rows"); sys.exit()
h = rows[0]; k = h.index("Kernel Name"); n = h.index("Metric Name"); v = h.index("Metric Value"); i = h.index("ID")
keep = ("Duration", "DRAM Throughput", "Memory Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
        "Compute (SM) Throughput", "Issue Slots Busy", "No Eligible", "Active Warps Per Scheduler",
        "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction", "Registers Per Thread",
        "Achieved Occupancy", "Waves Per SM", "Grid Size", "Block Size", "Mem Busy", "Max Bandwidth",
        "L1/TEX Hit Rate", "L2 Hit Rate", "Executed Ipc Active")
cur = None
for r in rows[1:]:
    if r[i] != cur:
        cur = r[i]; print("--", r[i], r[k].split("(")[0])
    if r[n] in keep or "stalled" in r[n]:
        print("  ", r[n], r[v])
PY
done
