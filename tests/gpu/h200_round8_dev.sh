#!/bin/bash
# Round 8 of issue #8, an experiment call (one device call): kernel checks (summary; under each
# configuration of CHECK_ENVS, as BENCH_ENVS below), the 8B and
# smollm2 decode/prefill benches under the configurations named in BENCH_ENVS (space-separated
# label=VAR=value[,VAR=value]; "default" runs as is), kernels --bench when KBENCH=1 (under each
# configuration of KBENCH_ENVS, as BENCH_ENVS; kernels_bench_<label>.json), and Nsight
# per-kernel times of 8B decode steps (graphs off; the GEMV by launch shape) when NCU=1, under
# each configuration of NCU_ENVS (as BENCH_ENVS); diff-layers timed on the 8B shape when DIFF8B=1.
# NCU_GEMM=1 (round 17): Nsight of the prefill GEMM: per-kernel times of one 512-token prefill and
# `--set ${NCU_GEMM_SET:-full}` of the first NCU_GEMM_K (4) launches matching NCU_GEMM_KERNEL
# (a regex, default gemm2_q4_k; NCU_GEMM_BASIC=0 skips both), and with NCU_GEMM_SOURCE=<k> the
# stall reasons and per-SASS stall samples of matching launch k (0-based); NCU_GEMM_ENVS (one
# VAR=value) applies to the GEMM runs.
# Usage (GPU machine): LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_round8_dev.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
D=$(cd $(dirname $0) && pwd)
W=/tmp/gpu; M=$W/models; mkdir -p $M
T0=$(date +%s)
LOG=$OUT/log.txt
el() { echo $(( $(date +%s)-T0 )); }
say() { echo "== $* (t=$(el)s)" | tee -a $LOG; }
for cfg in ${CHECK_ENVS:-default}; do
  [ "$cfg" = skip ] && break
  label=${cfg%%=*}; envs=X=1; [ "$label" != "$cfg" ] && envs=$(echo ${cfg#*=} | tr ',' ' ')
  say "kernels --check $label"
  env $envs timeout 150 $B kernels --check --json >$W/kernels_check.json 2>>$LOG; echo "rc=$?" >>$LOG
  python3 - $W/kernels_check.json <<'PY' | tee -a $LOG
import json, sys
d = json.load(open(sys.argv[1])); c = d["checks"]
print(sum(x["pass"] for x in c), "of", len(c), "kernel checks pass; failing:", [(x["case"], x["rel_l2"]) for x in c if not x["pass"]][:20])
PY
done
say "synth"
[ -f $M/smollm2-135m.gguf ] || $B synth --preset smollm2-135m --seed 1 -o $M/smollm2-135m.gguf >/dev/null 2>>$LOG
[ -f $M/llama8b.gguf ] || timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
say "model bench"
for cfg in ${BENCH_ENVS:-default}; do
  label=${cfg%%=*}; envs=X=1; [ "$label" != "$cfg" ] && envs=$(echo ${cfg#*=} | tr ',' ' ')
  for m in llama8b ${SMOL:+smollm2-135m}; do
    env $envs timeout 120 $B bench $M/$m.gguf --backend cuda --n-prompt 512 --n-decode 48 --reps 2 --json 2>>$LOG >$W/b.json
    python3 -c "
import json; d=json.load(open('$W/b.json')); g=d.get('decode_graphs') or {}
print('$m $label', 'decode %.3f ms (with warm-up %.3f; plain %.3f)' % (d['decode_s_per_token']*1e3, d['decode_s_per_token_with_warmup']*1e3, g.get('decode_plain_s_per_token',0)*1e3),
      'prefill_last %.4f s (%.0f tok/s)' % (d['prefill_last_s'], d['prefill_last_tok_s']), 'bitwise', g.get('logits_bitwise_equal'))" 2>&1 | tee -a $LOG
  done
done
if [ "$KBENCH" = 1 ]; then
  for cfg in ${KBENCH_ENVS:-default}; do
    label=${cfg%%=*}; envs=X=1; [ "$label" != "$cfg" ] && envs=$(echo ${cfg#*=} | tr ',' ' ')
    say "kernels --bench $label"
    env $envs timeout 200 $B kernels --bench --json >$W/kernels_bench.json 2>>$LOG
    cp $W/kernels_bench.json $OUT/kernels_bench_$label.json
    python3 $D/bench_summary.py $W/kernels_bench.json 2>&1 | tee -a $LOG
  done
fi
if [ "$DIFF8B" = 1 ]; then
  say "diff-layers on the 8B shape"
  T1=$(date +%s.%N)
  timeout 150 $B diff-layers $M/llama8b.gguf --tokens 1,5,9,13,17,21,25,29 --backend cuda --json >$W/diff8b.json 2>$W/diff8b.err
  echo "rc=$? wall $(python3 -c "print(round($(date +%s.%N)-$T1,2))") s" | tee -a $LOG
  python3 -c "
import json;d=json.load(open('$W/diff8b.json'))
print(json.dumps({k:d.get(k) for k in ('verdict','backend','first_divergence','timings_s')}))" 2>&1 | tee -a $LOG
fi
if [ "$NCU" = 1 ]; then
  NCUB=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  K=${NCU_DECODE_K:-260}
  for cfg in ${NCU_ENVS:-default}; do
    label=${cfg%%=*}; envs=X=1; [ "$label" != "$cfg" ] && envs=$(echo ${cfg#*=} | tr ',' ' ')
    say "ncu decode $label"
    env $envs LLMDIFF_CUDA_GRAPH=0 timeout 90 $NCUB --clock-control none --metrics gpu__time_duration.sum --csv \
      --launch-skip $((2 * K)) --launch-count $((3 * K)) $B bench $M/llama8b.gguf --backend cuda --n-prompt 1 --n-decode 4 --reps 1 >$W/ncu.csv 2>$W/ncu.err
    G=$(python3 -c "
import csv; r=[x for x in csv.reader(open('$W/ncu.csv')) if len(x)>10]; h=r[0]; k=h.index('Kernel Name')
import collections; c=collections.Counter(x[k].split('(')[0] for x in r[1:] if x[k].startswith('gemv')); print(c.most_common(1)[0][0] if c else '')" 2>/dev/null)
    python3 $D/ncu_summary.py $W/ncu.csv per:rope_table ${G:+grid:$G:2} 2>&1 | head -24 | tee -a $LOG
  done
fi
if [ "$NCU_GEMM" = 1 ]; then
  NCUB=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  PREFILL1="--backend cuda --n-prompt 512 --n-decode 1 --reps 1"  # one 512-token prefill
  if [ "${NCU_GEMM_BASIC:-1}" = 1 ]; then
    say "ncu prefill per-kernel times (one 512-token pass, graphs off)"
    LLMDIFF_CUDA_GRAPH=0 timeout 120 $NCUB --clock-control none --metrics gpu__time_duration.sum --csv \
      --launch-count ${NCU_PREFILL_K:-400} $B bench $M/llama8b.gguf $PREFILL1 >$W/ncup.csv 2>$W/ncup.err
    python3 $D/ncu_summary.py $W/ncup.csv per:rope_table 2>&1 | head -24 | tee -a $LOG
    say "ncu gemm2 details (${NCU_GEMM_SET:-full})"
    env ${NCU_GEMM_ENVS:-X=1} LLMDIFF_CUDA_GRAPH=0 timeout 200 $NCUB --clock-control none --set ${NCU_GEMM_SET:-full} \
      --kernel-name regex:${NCU_GEMM_KERNEL:-gemm2_q4_k} --launch-count ${NCU_GEMM_K:-4} \
      $B bench $M/llama8b.gguf $PREFILL1 >$OUT/ncu_gemm.txt 2>$W/ncug.err
    echo "rc=$? $(wc -l <$OUT/ncu_gemm.txt) lines" | tee -a $LOG; tail -3 $W/ncug.err | tee -a $LOG
    grep -E "^  [a-z_0-9]+\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|One or More Eligible|Block Limit" $OUT/ncu_gemm.txt | head -80 | tee -a $LOG
    gzip -f $OUT/ncu_gemm.txt
  fi
  if [ -n "$NCU_GEMM_SOURCE" ]; then
    say "ncu gemm2 SASS stall sampling, launch $NCU_GEMM_SOURCE of the matching kernels"
    env ${NCU_GEMM_ENVS:-X=1} LLMDIFF_CUDA_GRAPH=0 timeout 200 $NCUB --clock-control none --section WarpStateStats --section SourceCounters \
      --section SchedulerStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum \
      --print-details all --kernel-name regex:${NCU_GEMM_KERNEL:-gemm2_q4_k} --launch-skip $NCU_GEMM_SOURCE --launch-count 1 \
      $B bench $M/llama8b.gguf $PREFILL1 >$OUT/ncu_gemm_details.txt 2>$W/ncus.err
    echo "rc=$?" | tee -a $LOG; tail -3 $W/ncus.err | tee -a $LOG
    env ${NCU_GEMM_ENVS:-X=1} LLMDIFF_CUDA_GRAPH=0 timeout 200 $NCUB --clock-control none --section SourceCounters --section WarpStateStats \
      --page source --print-source sass --csv --kernel-name regex:${NCU_GEMM_KERNEL:-gemm2_q4_k} --launch-skip $NCU_GEMM_SOURCE --launch-count 1 \
      $B bench $M/llama8b.gguf $PREFILL1 >$OUT/ncu_gemm_sass.csv 2>>$W/ncus.err
    echo "rc=$? $(wc -l <$OUT/ncu_gemm_sass.csv) lines" | tee -a $LOG
    grep -i -E "stall|Tensor|hmma" $OUT/ncu_gemm_details.txt | head -60 | tee -a $LOG
    gzip -f $OUT/ncu_gemm_details.txt $OUT/ncu_gemm_sass.csv
  fi
fi
say "done"
