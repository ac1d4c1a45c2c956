#!/bin/bash
# One device call's worth of GPU evidence for the cuda backend (issue #8): kernel checks, GEMV
# bench, healthy diff-layers matrix, fault matrix, model benches. Usage (on the GPU machine, from
# the repo root, with target/release/llmdiff built --features cuda and carried):
#   OUT=/some/dir bash tests/gpu/h200_run.sh
# Everything lands in /tmp/gpu (pack it afterwards, models excluded); a log goes to $OUT/log.txt.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/target/release/llmdiff}
W=/tmp/gpu; mkdir -p $W/healthy $W/faults $W/models
LOG=$OUT/log.txt
say() { echo "== $*" | tee -a $LOG; }
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>$LOG 2>&1
say "kernels --check"
timeout 120 $B kernels --check >>$LOG 2>&1; echo "rc=$?" >>$LOG
timeout 60 $B kernels --check --json >$W/kernels_check.json 2>>$LOG
say "kernels --bench"
timeout 120 $B kernels --bench --bench-tokens 8 --json >$W/kernels_bench.json 2>>$LOG; echo "rc=$?" >>$LOG
timeout 120 $B kernels --bench >>$LOG 2>&1
M=$W/models
for p in deepseek-v3-mini glm5-mini smollm2-135m; do $B synth --preset $p --seed 1 -o $M/$p.gguf >/dev/null 2>>$LOG; done
for p in deepseek-v3-mini llama-tiny; do $B synth --preset $p --quant Q4_K --seed 2 -o $M/$p-q4k.gguf >/dev/null 2>>$LOG; done
TOK=1,5,9,13,17,21,25,29
say "healthy diff-layers (t=$(( $(date +%s)-T0 ))s)"
for p in deepseek-v3-mini glm5-mini smollm2-135m; do
  tps="1 2 8"; [ $p = smollm2-135m ] && tps="1 3"
  for tp in $tps; do
    timeout 90 $B diff-layers $M/$p.gguf --tokens $TOK --backend cuda --tp $tp --json >$W/healthy/$p-tp$tp.json 2>$W/healthy/$p-tp$tp.err
    rc=$?; v=$(python3 -c "import json;d=json.load(open('$W/healthy/$p-tp$tp.json'));print(d['verdict'],d.get('backend',''),d.get('first_divergence'))" 2>/dev/null)
    echo "$p tp$tp rc=$rc $v $(head -c 200 $W/healthy/$p-tp$tp.err)" | tee -a $LOG
  done
done
say "fault matrix (t=$(( $(date +%s)-T0 ))s)"
FAULTS="phantom-attn-out kv-b-unsharded kv-b-shard-swap k-b-untransposed dequant-q4k-scale-min f16-residual allreduce-skip rope-neox moe-gate-rounded stale-attn-out config-drift kv-slot-off-by-one"
for m in deepseek-v3-mini:2 llama-tiny:2 llama-tiny:1; do
  p=${m%%:*}; tp=${m##*:}
  for f in $FAULTS; do
    extra=""; [ $f = kv-slot-off-by-one ] && extra="--decode-steps 2"
    for dev in cuda cpu; do
      o=$W/faults/$p-tp$tp-$f-$dev
      timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend $dev --tp $tp --inject $f $extra --json >$o.json 2>$o.err
      echo "rc=$?" >>$o.err
    done
    python3 - "$W/faults/$p-tp$tp-$f" <<'PY' | tee -a $LOG
import json,sys
b=sys.argv[1]; r=[]
for dev in ("cuda","cpu"):
    try:
        d=json.load(open(b+"-"+dev+".json")); fd=d.get("first_divergence") or {}
        r.append((d["verdict"], fd.get("tap"), (d.get("diagnosis") or {}).get("class")))
    except Exception:
        r.append(("n/a", open(b+"-"+dev+".err").read().strip().splitlines()[0][:90], None))
print(b.split("/")[-1], "cuda:", r[0], "cpu:", r[1], "SAME" if r[0]==r[1] else "DIFF")
PY
  done
done
say "model bench (t=$(( $(date +%s)-T0 ))s)"
timeout 90 $B bench $M/smollm2-135m.gguf --backend cuda --n-prompt 512 --n-decode 16 --reps 2 --json >$W/bench_smollm2.json 2>>$LOG; cat $W/bench_smollm2.json >>$LOG
timeout 150 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
ls -la $M >>$LOG
timeout 150 $B bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 8 --reps 1 --json >$W/bench_llama8b.json 2>>$LOG; cat $W/bench_llama8b.json >>$LOG
say "done (t=$(( $(date +%s)-T0 ))s)"
