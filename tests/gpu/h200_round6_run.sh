#!/bin/bash
# Round 6 of issue #8 (one device call): the standard evidence (h200_run.sh with SKIP_SLOW: kernel
# checks, kernels --bench with every GEMV variant and the prefill GEMM, healthy and fault matrices,
# model benches), then the 8B prefill with the SIMT matmul (LLMDIFF_GEMM=0) and with 32-token
# GEMM tiles for comparison, diff-layers timed on the 8B shape, and, while time is left (elapsed
# < NCU_BEFORE_S), Nsight Compute per-kernel times of 8B decode steps and of one 512-token prefill.
# Usage (GPU machine, llmdiff built --features cuda next to this script):
#   LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_round6_run.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
D=$(dirname $0)
T0=$(date +%s)
LOG=$OUT/log.txt
say() { echo "== $* (t=$(( $(date +%s)-T0 ))s)" | tee -a $LOG; }
SKIP_SLOW=1 LLMDIFF=$B OUT=$OUT bash $D/h200_run.sh
M=/tmp/gpu/models
say "8B prefill: SIMT matmul (LLMDIFF_GEMM=0), 32-token GEMM tiles (LLMDIFF_GEMM_BN=32)"
LLMDIFF_GEMM=0 timeout 100 $B bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 0 --reps 2 --json >$OUT/bench_8b_simt.json 2>>$LOG
LLMDIFF_GEMM_BN=32 timeout 100 $B bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 0 --reps 2 --json >$OUT/bench_8b_gemm32.json 2>>$LOG
cat $OUT/bench_8b_simt.json $OUT/bench_8b_gemm32.json >>$LOG
say "8B decode with the tensor-core GEMV (LLMDIFF_GEMV_KIND=tc, =tcp)"
for k in tc tcp; do
  LLMDIFF_GEMV_KIND=$k timeout 100 $B bench $M/llama8b.gguf --backend cuda --n-prompt 64 --n-decode 32 --reps 2 --json >$OUT/bench_8b_gemv_$k.json 2>>$LOG
  echo "rc=$?" >>$LOG; cat $OUT/bench_8b_gemv_$k.json >>$LOG
done
say "entropy, gate, generate and logits on cuda (against cpu)"
R=$(cd $D/.. && pwd)
printf '{"tokens":[1,5,9,13,17,21]}\n{"tokens":[2,4,6,8]}\n' >/tmp/gpu/prompts.jsonl
for be in cuda cpu; do
  timeout 60 $B entropy $M/deepseek-v3-mini.gguf --prompts /tmp/gpu/prompts.jsonl --backend $be --tp 2 --against-reference --json >/tmp/gpu/entropy_$be.json 2>>$LOG
  echo "entropy $be rc=$?" | tee -a $LOG
  timeout 60 $B generate $M/smollm2-135m.gguf --tokens 1,2,3,4 --max-new-tokens 24 --backend $be --json >$OUT/generate_$be.json 2>>$LOG
  echo "generate $be rc=$?" | tee -a $LOG
done
python3 - /tmp/gpu/entropy_cuda.json /tmp/gpu/entropy_cpu.json $OUT/generate_cuda.json $OUT/generate_cpu.json <<'PY' | tee $OUT/commands_cuda.txt | tee -a $LOG
import json, sys
e = [json.load(open(p)) for p in sys.argv[1:3]]
g = [json.load(open(p)) for p in sys.argv[3:5]]
for side, d in zip(("cuda", "cpu"), e):
    print("entropy deepseek-v3-mini TP 2", side, d["backend"], d["verdict"], d.get("agreement"), "kld mean", (d.get("kld") or {}).get("mean"))
print("generate smollm2-135m synth: cuda", g[0]["backend"], g[0]["tokens"][:12], "| cpu", g[1]["tokens"][:12], "| same tokens:", g[0]["tokens"] == g[1]["tokens"])
PY
timeout 120 $B gate --golden $R/golden/gate-deepseek-v3-mini-cpu-tp2.json --backend cuda --json >$OUT/gate_cuda.json 2>>$LOG
echo "gate --backend cuda (golden blessed on the cpu engine, TP 2) rc=$?" | tee -a $LOG
say "diff-layers on the 8B shape"
T1=$(date +%s.%N)
timeout 200 $B diff-layers $M/llama8b.gguf --tokens 1,5,9,13,17,21,25,29 --backend cuda --json >/tmp/gpu/diff8b.json 2>/tmp/gpu/diff8b.err
echo "rc=$? wall $(python3 -c "print(round($(date +%s.%N)-$T1,2))") s" | tee -a $LOG
python3 -c "
import json;d=json.load(open('/tmp/gpu/diff8b.json'))
print(json.dumps({k:d.get(k) for k in ('verdict','backend','first_divergence','timings_s')}))" | tee $OUT/diff8b.json | tee -a $LOG
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# Decode: bench --n-prompt 1 --n-decode 4 --reps 1 with graphs off runs a one-token prefill
# (the decode kernels), then a one-token prefill and 4 steps, ...: every pass is the same D
# kernels (NCU_DECODE_K: 32 layers x 9 + embedding gather, layer 0's norm, the RoPE table and
# lm_head; the KV writes are copies, not kernels), so any window of 3D kernels after the first
# two passes covers exactly three steps (at a short context). Prefill: every kernel of one
# 512-token prefill (--n-decode 0: nothing after it).
ncu_case() { # name skip count passes args...
  local name=$1 skip=$2 cnt=$3 steps=$4; shift 4
  el=$(( $(date +%s)-T0 ))
  if [ $el -ge ${NCU_BEFORE_S:-400} ] || [ -z "$NCU" ]; then say "ncu $name skipped"; return; fi
  say "ncu $name"
  LLMDIFF_CUDA_GRAPH=0 timeout 150 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip $skip --launch-count $cnt $B "$@" >/tmp/ncu_$name.csv 2>/tmp/ncu_$name.err
  echo "rc=$?" | tee -a $LOG; tail -2 /tmp/ncu_$name.err | tee -a $LOG
  python3 $D/ncu_summary.py /tmp/ncu_$name.csv $steps >$OUT/ncu_$name.txt 2>&1
  cat $OUT/ncu_$name.txt | tee -a $LOG
}
K=${NCU_DECODE_K:-292}
ncu_case llama8b_decode $((2 * K)) $((3 * K)) 3 bench $M/llama8b.gguf --backend cuda --n-prompt 1 --n-decode 4 --reps 1
ncu_case llama8b_prefill 0 3000 1 bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 0 --reps 1
say "all done"
