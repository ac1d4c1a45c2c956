#!/bin/bash
# Kernel traces of one decode step (issue #8, round 20): `bench --trace` on the 8B shape and on
# smollm2 at depth 512, each after a plain bench of the same binary (its figures untraced).
# Writes $OUT/trace_<model>.json.gz (Chrome trace: ui.perfetto.dev) and the summaries to
# $OUT/trace_log.txt. TRACE_SETTINGS (VAR=value ...) applies to the traced runs only; LABEL is
# appended to the trace files' names; PLAIN=0 skips the plain benches.
# Usage (GPU machine): LLMDIFF=.wtcuda/llmdiff OUT=/some/dir bash tests/gpu/h200_trace_run.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:?set LLMDIFF to the binary}
W=/tmp/gpu; M=$W/models; mkdir -p $M
LOG=$OUT/trace_log.txt
[ -f $M/smollm2-135m.gguf ] || $B synth --preset smollm2-135m --seed 1 -o $M/smollm2-135m.gguf >/dev/null 2>>$LOG
[ -f $M/llama8b.gguf ] || timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
for m in ${MODELS:-llama8b smollm2-135m}; do
  if [ "${PLAIN:-1}" != 0 ]; then
    echo "== $m: plain" | tee -a $LOG
    timeout 120 $B bench $M/$m.gguf --backend cuda --n-prompt 512 --n-decode 48 --reps 2 2>>$LOG | tee -a $LOG
  fi
  echo "== $m: traced ${TRACE_SETTINGS}" | tee -a $LOG
  env X=1 $TRACE_SETTINGS timeout 120 $B bench $M/$m.gguf --backend cuda --n-prompt 512 --n-decode 48 --reps 2 \
    --trace $W/trace_$m.json 2>>$LOG | grep -v "^prefill\|^peak\|all-reduce" | tee -a $LOG
  gzip -c $W/trace_$m.json >$OUT/trace_$m$LABEL.json.gz
done
