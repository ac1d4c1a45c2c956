#!/bin/bash
# Round 30 (issue #8), one device call: the one-row norm split over blocks and x_limbs4's
# exponent/rounding arithmetic. `kernels --check` (summary, the new _SPLIT cases), the 8B shape's
# logits for one token (a decode-shaped row: one-row norms, limbs, GEMVs) under the old limbs,
# the new ones and each split, compared bit for bit (cmp), then the A/B bench of those settings
# (tests/gpu/h200_ab_binaries.sh, 8B and smollm2), then kernel traces (old, and SPLITS' last).
# Usage (GPU machine): LLMDIFF=target/new/llmdiff OUT=dir [SPLITS="2 4 8"] bash tests/gpu/h200_round30_run.sh
# It ran a build of commit 8bd5939: the old limbs (LLMDIFF_LIMBS_OLD) exist only there; at later
# commits that setting changes nothing, so "old" is the new arithmetic too.
source $(dirname $0)/preamble.sh
OLD=LLMDIFF_NVRTC_DEFINES=LLMDIFF_LIMBS_OLD
SPLITS=${SPLITS:-2 4 8}
if [ -z "${SKIP_CHECK:-}" ]; then
  say "kernels --check"
  B=$B W=$W OUT=$OUT LOG=$LOG bash $D/kernel_check.sh "split:_SPLIT("
fi
say "synth"
[ -f $M/smollm2-135m.gguf ] || $B synth --preset smollm2-135m --seed 1 -o $M/smollm2-135m.gguf >/dev/null 2>>$LOG
[ -f $M/llama8b.gguf ] || timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
say "one-token logits, bit for bit"
for cfg in old:$OLD old2:$OLD new:X=1 $(for s in $SPLITS; do echo s$s:LLMDIFF_NORM_SPLIT=$s; done) olds8:$OLD,LLMDIFF_NORM_SPLIT=8; do
  l=${cfg%%:*}; envs=$(echo ${cfg#*:} | tr ',' ' ')
  env $envs timeout 150 $B logits $M/llama8b.gguf --tokens 7 --backend cuda --dump-f32 $W/l_$l.f32 >/dev/null 2>>$LOG
  cp $W/l_$l.f32 $OUT/
  [ $l = old ] && continue
  cmp -s $W/l_old.f32 $W/l_$l.f32 && echo "logits $l: bitwise equal to old" | tee -a $LOG || echo "logits $l: DIFFER from old" | tee -a $LOG
done
say "A/B"
BINS="old=$B,$OLD new=$B $(for s in $SPLITS; do echo s$s=$B,LLMDIFF_NORM_SPLIT=$s; done)" SMOL=${SMOL:-} ROUNDS=${ROUNDS:-2} OUT=$OUT \
  bash $D/h200_ab_binaries.sh >/dev/null 2>&1
LAST=$(echo $SPLITS | awk '{print $NF}')
if [ -z "${SKIP_TRACE:-}" ]; then
  say "traces"
  LLMDIFF=$B MODELS=llama8b PLAIN=0 TRACE_SETTINGS=${TRACE_FIRST:-$OLD} LABEL=_first OUT=$OUT bash $D/h200_trace_run.sh
  LLMDIFF=$B MODELS=llama8b PLAIN=0 TRACE_SETTINGS=LLMDIFF_NORM_SPLIT=$LAST LABEL=_s$LAST OUT=$OUT bash $D/h200_trace_run.sh
fi
say "done"
