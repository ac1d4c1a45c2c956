#!/bin/bash
# One device call's worth of evidence for real TP ranks over NCCL (issue #11), on a 2-GPU machine:
# the healthy diff-layers matrix and the fault matrix of h200_run.sh at TP 2, real ranks
# (cuda-nccl) against simulated ranks (LLMDIFF_CUDA_RANKS=simulated) on the same inputs, the max
# rel_l2 between the two modes' logits, and 8B-shaped benches at TP 1 and 2 with the all-reduce
# share of decode. Usage (repo root, binary built --features cuda):
#   OUT=/some/dir LLMDIFF=path/to/llmdiff bash tests/gpu/h200_nccl_run.sh
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/target/release/llmdiff}
W=/tmp/gpu; mkdir -p $W/healthy $W/faults $W/models $W/logits
LOG=$OUT/log.txt
say() { echo "== $*" | tee -a $LOG; }
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader >>$LOG 2>&1
nvidia-smi topo -m >>$LOG 2>&1
M=$W/models
for p in deepseek-v3-mini glm5-mini; do $B synth --preset $p --seed 1 -o $M/$p.gguf >/dev/null 2>>$LOG; done
for p in deepseek-v3-mini llama-tiny; do $B synth --preset $p --quant Q4_K --seed 2 -o $M/$p-q4k.gguf >/dev/null 2>>$LOG; done
TOK=1,5,9,13,17,21,25,29
summ() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));fd=d.get('first_divergence') or {};print(d['verdict'],d.get('backend'),fd.get('tap'),(d.get('diagnosis') or {}).get('class'),len(d.get('taps',[])))" $1 2>/dev/null || echo "n/a $(head -c 150 ${1%.json}.err)"; }
say "healthy diff-layers TP 2, nccl vs simulated (t=$(( $(date +%s)-T0 ))s)"
for p in deepseek-v3-mini glm5-mini deepseek-v3-mini-q4k llama-tiny-q4k; do
  for mode in nccl simulated; do
    o=$W/healthy/$p-$mode
    LLMDIFF_CUDA_RANKS=$mode timeout 90 $B diff-layers $M/$p.gguf --tokens $TOK --backend cuda --tp 2 --json >$o.json 2>$o.err
    echo "$p $mode rc=$? $(summ $o.json) | $(grep backend: $o.err | head -1)" | tee -a $LOG
  done
  for mode in nccl simulated; do
    LLMDIFF_CUDA_RANKS=$mode timeout 60 $B logits $M/$p.gguf --tokens $TOK --backend cuda --tp 2 --dump-f32 $W/logits/$p-$mode.f32 --json >/dev/null 2>>$LOG
  done
  python3 - $W/logits/$p <<'PY' | tee -a $LOG
import numpy as np,sys
b=sys.argv[1]; a=np.fromfile(b+"-nccl.f32",dtype=np.float32); s=np.fromfile(b+"-simulated.f32",dtype=np.float32)
n=8; a=a.reshape(n,-1).astype(np.float64); s=s.reshape(n,-1).astype(np.float64)
r=np.linalg.norm(a-s,axis=1)/np.maximum(np.linalg.norm(s,axis=1),1e-30)
print(b.split("/")[-1], "logits nccl vs simulated: max rel_l2 %.3e, max abs %.3e, bitwise equal %s" % (r.max(), np.abs(a-s).max(), bool((a==s).all())))
PY
done
say "fault matrix TP 2, nccl vs simulated (t=$(( $(date +%s)-T0 ))s)"
FAULTS="phantom-attn-out kv-b-unsharded kv-b-shard-swap k-b-untransposed dequant-q4k-scale-min f16-residual allreduce-skip rope-neox moe-gate-rounded stale-attn-out config-drift kv-slot-off-by-one"
for p in deepseek-v3-mini llama-tiny; do
  for f in $FAULTS; do
    extra=""; [ $f = kv-slot-off-by-one ] && extra="--decode-steps 2"
    r=""
    for mode in nccl simulated; do
      o=$W/faults/$p-$f-$mode
      LLMDIFF_CUDA_RANKS=$mode timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend cuda --tp 2 --inject $f $extra --json >$o.json 2>$o.err
      r="$r | $mode: $(summ $o.json)"
    done
    a=$(summ $W/faults/$p-$f-nccl.json | cut -d' ' -f1,3-); b=$(summ $W/faults/$p-$f-simulated.json | cut -d' ' -f1,3-)
    echo "$p $f $r | $([ "$a" = "$b" ] && echo SAME || echo DIFF)" | tee -a $LOG
  done
done
say "8B-shaped bench (t=$(( $(date +%s)-T0 ))s)"
timeout 150 $B synth --arch llama --n-layers 32 --d-model 4096 --ffn-dim 14336 --n-heads 32 --n-kv-heads 8 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
for run in "1 auto" "2 nccl" "2 simulated"; do
  set -- $run
  LLMDIFF_CUDA_RANKS=$2 timeout 200 $B bench $M/llama8b.gguf --backend cuda --tp $1 --n-prompt 512 --n-decode 16 --reps 2 --json >$OUT/bench_tp$1_$2.json 2>>$LOG
  echo "tp$1 $2 rc=$? $(cat $OUT/bench_tp$1_$2.json)" | tee -a $LOG
done
say "done (t=$(( $(date +%s)-T0 ))s)"
