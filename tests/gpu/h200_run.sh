#!/bin/bash
# One device call's worth of GPU evidence for the cuda backend (issue #8): kernel checks, GEMV
# bench (and the Q4_K GEMV variants), healthy diff-layers matrix, fault matrix, model benches
# (decode timed with and without decode graphs, logits compared),
# and diff-layers timed on the 8B shape. Usage (on the GPU machine, with a llmdiff built
# --features cuda carried there):
#   LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_run.sh
# Work files land in /tmp/gpu; small results are copied to $OUT (log.txt, kernels_check.json,
# kernels_bench.json, gemv_variants.txt, bench.jsonl, diff8b.json, results.tgz).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/target/release/llmdiff}
W=/tmp/gpu; mkdir -p $W/healthy $W/faults $W/models
LOG=$OUT/log.txt
say() { echo "== $*" | tee -a $LOG; }
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader >>$LOG 2>&1
say "kernels --check"
timeout 120 $B kernels --check >$W/kernels_check.txt 2>&1; echo "rc=$?" >>$LOG
grep -E "FAIL|kernel checks pass|error" $W/kernels_check.txt | tee -a $LOG
timeout 60 $B kernels --check --json >$OUT/kernels_check.json 2>>$LOG
say "kernels --bench (t=$(( $(date +%s)-T0 ))s)"
timeout 120 $B kernels --bench --bench-tokens 8 --json >$OUT/kernels_bench.json 2>>$LOG; echo "rc=$?" >>$LOG
timeout 120 $B kernels --bench 2>&1 | tee -a $LOG
# SKIP_SLOW=1 skips this sweep and the 8B diff-layers timing at the end.
[ -n "$SKIP_SLOW" ] || for v in "2 0" "8 0" "4 1"; do
  set -- $v
  echo "# LLMDIFF_GEMV_R=$1 LLMDIFF_GEMV_MODE=$2" >>$OUT/gemv_variants.txt
  LLMDIFF_GEMV_R=$1 LLMDIFF_GEMV_MODE=$2 timeout 60 $B kernels --bench 2>&1 | grep -E "copy|q4_k" >>$OUT/gemv_variants.txt
done
[ -f $OUT/gemv_variants.txt ] && cat $OUT/gemv_variants.txt >>$LOG
M=$W/models
for p in deepseek-v3-mini glm5-mini smollm2-135m; do $B synth --preset $p --seed 1 -o $M/$p.gguf >/dev/null 2>>$LOG; done
for p in deepseek-v3-mini llama-tiny; do $B synth --preset $p --quant Q4_K --seed 2 -o $M/$p-q4k.gguf >/dev/null 2>>$LOG; done
TOK=1,5,9,13,17,21,25,29
say "healthy diff-layers (t=$(( $(date +%s)-T0 ))s)"
for p in deepseek-v3-mini glm5-mini smollm2-135m; do
  # smollm2-135m has 9 heads and 3 KV heads: its valid TP degrees are 1 and 3.
  tps="1 2 8"; [ $p = smollm2-135m ] && tps="1 3"
  for tp in $tps; do
    for steps in 0 2; do
      o=$W/healthy/$p-tp$tp-d$steps
      timeout 90 $B diff-layers $M/$p.gguf --tokens $TOK --backend cuda --tp $tp --decode-steps $steps --json >$o.json 2>$o.err
      rc=$?; v=$(python3 -c "import json;d=json.load(open('$o.json'));print(d['verdict'],d.get('backend',''),d.get('first_divergence'),len(d.get('taps',[])),'taps')" 2>/dev/null)
      echo "$p tp$tp decode-steps=$steps rc=$rc $v $(head -c 200 $o.err | tr '\n' ' ')" | tee -a $LOG
    done
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
grep -c SAME $LOG | sed 's/^/fault cases SAME: /' | tee -a $LOG
say "model bench (t=$(( $(date +%s)-T0 ))s)"
timeout 90 $B bench $M/smollm2-135m.gguf --backend cuda --n-prompt 512 --n-decode 64 --reps 3 --json >>$OUT/bench.jsonl 2>>$LOG
timeout 150 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
ls -la $M >>$LOG
timeout 200 $B bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 32 --reps 2 --json >>$OUT/bench.jsonl 2>>$LOG
cat $OUT/bench.jsonl >>$LOG
if [ -z "$SKIP_SLOW" ]; then
say "diff-layers on the 8B shape (t=$(( $(date +%s)-T0 ))s)"
T1=$(date +%s.%N)
timeout 300 $B diff-layers $M/llama8b.gguf --tokens $TOK --backend cuda --json >$W/diff8b.json 2>$W/diff8b.err
echo "rc=$? wall $(python3 -c "print(round($(date +%s.%N)-$T1,2))") s" | tee -a $LOG
python3 -c "
import json;d=json.load(open('$W/diff8b.json'))
print(json.dumps({k:d.get(k) for k in ('verdict','backend','first_divergence','timings_s')}))" | tee $OUT/diff8b.json | tee -a $LOG
tail -3 $W/diff8b.err | tee -a $LOG
fi
tar czf $OUT/results.tgz -C $W healthy faults kernels_check.txt 2>>$LOG
say "done (t=$(( $(date +%s)-T0 ))s)"
