#!/bin/bash
# An A/B of builds in one device call (issue #8, round 12): the 8B (and, with SMOL=1, smollm2)
# decode/prefill bench of every binary in BINS (space-separated label=path), interleaved over
# ROUNDS rounds (default 2), every other round in reverse order (A B, B A: the first run of a
# round read ~1 % faster in round 18), so that drift cancels, at each prompt length in PROMPTS
# (default 512; the decode steps then run at that depth), then `kernels --bench` (summary) of the
# binaries labelled in KBENCH_BINS. An entry may add settings after its path, comma-separated
# (label=path,VAR=value,VAR=value), so one binary can be A/B'd against itself under other settings.
# Usage (GPU machine): BINS="a=.wtcuda/llmdiff_a b=.wtcuda/llmdiff_b" [PROMPTS="512 4000"] [ROUNDS=4] \
#   OUT=/some/dir bash tests/gpu/h200_ab_binaries.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
D=$(cd $(dirname $0) && pwd)
W=/tmp/gpu; M=$W/models; mkdir -p $M
T0=$(date +%s)
LOG=$OUT/log.txt
say() { echo "== $* (t=$(( $(date +%s)-T0 ))s)" | tee -a $LOG; }
# label=path[,VAR=value...] → label, path, settings (X=1 when none).
parse() { label=${1%%=*}; local rest=${1#*=}; B=${rest%%,*}; envs=X=1; [ "$B" != "$rest" ] && envs=$(echo ${rest#*,} | tr ',' ' '); }
parse ${BINS%%[[:space:]]*}; B0=$B
say "synth"
[ -f $M/smollm2-135m.gguf ] || $B0 synth --preset smollm2-135m --seed 1 -o $M/smollm2-135m.gguf >/dev/null 2>>$LOG
[ -f $M/llama8b.gguf ] || timeout 100 $B0 synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
# MODELS (default: llama8b, and smollm2-135m with SMOL=1) may name 8B-shaped models of another
# weight type and depth, llama8b_<QUANT>_<N>L (e.g. llama8b_F16_8L), synthesized here.
MODELS=${MODELS:-llama8b ${SMOL:+smollm2-135m}}
for m in $MODELS; do
  case $m in llama8b_*_*L) q=${m#llama8b_}; nl=${q##*_}; nl=${nl%L}; q=${q%_*}
    [ -f $M/$m.gguf ] || timeout 200 $B0 synth --arch llama --n-layers $nl --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant $q --seed 3 -o $M/$m.gguf >/dev/null 2>>$LOG ;;
  esac
done
say "model bench"
REV=$(for cfg in $BINS; do echo $cfg; done | tac | tr '\n' ' ')
for np in ${PROMPTS:-512}; do
  for round in $(seq ${ROUNDS:-2}); do
    order=$BINS; [ $((round % 2)) = 0 ] && order=$REV
    for cfg in $order; do
      parse $cfg
      for m in $MODELS; do
        env $envs timeout 120 $B bench $M/$m.gguf --backend cuda --n-prompt $np --n-decode 48 --reps 2 --json 2>>$LOG >$W/b.json
        python3 -c "
import json; d=json.load(open('$W/b.json')); g=d.get('decode_graphs') or {}
print('$m n_prompt $np $label', 'decode %.3f ms (plain %.3f)' % (d['decode_s_per_token']*1e3, g.get('decode_plain_s_per_token',0)*1e3),
      'prefill_last %.0f tok/s' % d['prefill_last_tok_s'], 'bitwise', g.get('logits_bitwise_equal'),
      'decode check rel_l2', (d.get('decode_check') or {}).get('rel_l2'))" 2>&1 | tee -a $LOG
      done
    done
  done
done
for cfg in $BINS; do
  parse $cfg
  case " $KBENCH_BINS " in *" $label "*) ;; *) continue ;; esac
  say "kernels --bench $label"
  env $envs timeout 200 $B kernels --bench --json >$W/kernels_bench.json 2>>$LOG
  cp $W/kernels_bench.json $OUT/kernels_bench_$label.json
  python3 $D/bench_summary.py $W/kernels_bench.json 2>&1 | head -${KBENCH_LINES:-6} | tee -a $LOG
done
say "done"
