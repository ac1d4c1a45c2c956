#!/bin/bash
# Round 31 (issue #8), one device call: A/B settings of one binary on the 8B decode step, with
# `kernels --check` first (summary; the split attention's cases) unless SKIP_CHECK, then the A/B
# bench of SETTINGS (label=VAR=value[,VAR=value]; tests/gpu/h200_ab_binaries.sh, 8B only), kernel
# traces of TRACES (labels of SETTINGS), and `diff-layers --decode-steps 2` on the 8B shape under
# each of DIFFS (labels of SETTINGS): verdict, first divergence, the worst tap against its
# threshold and the logits' rel_l2.
# Default SETTINGS: the integer GEMVs with 3, 2 and 1 limbs of x (LLMDIFF_NLIMB, an NVRTC define
# of the round's experiment commit) and the q/k/v launch's variants (LLMDIFF_GEMV_VARIANT with a
# shape). Call 1 ran commit aa12444 with the split attention's L2 prefetch settings
# (LLMDIFF_PREFETCH_MB=0, 12, 24, 40; the prefetch was removed after it).
# Usage (GPU machine): LLMDIFF=target/new/llmdiff OUT=dir [SETTINGS="..."] [TRACES="..."]
#   [DIFFS="..."] [ROUNDS=3] [SKIP_CHECK=1] bash tests/gpu/h200_round31_run.sh
source $(dirname $0)/preamble.sh
QKV=6144x4096
N=LLMDIFF_NVRTC_DEFINES=LLMDIFF_NLIMB
SETTINGS=${SETTINGS:-nl3=X=1 nl2=$N=2 nl1=$N=1 qkv_bulk=LLMDIFF_GEMV_VARIANT=$QKV=gemvb_q4_k_r8_w2_m3_s2 \
qkv_r2=LLMDIFF_GEMV_VARIANT=$QKV=gemvw_q4_k_r2_w2_u1_m3 qkv_m2=LLMDIFF_GEMV_VARIANT=$QKV=gemvw_q4_k_r8_w4_u1_m2}
if [ -z "${SKIP_CHECK:-}" ]; then
  say "kernels --check"
  B=$B W=$W OUT=$OUT LOG=$LOG bash $D/kernel_check.sh "split:ATTN_GQA_SPLIT("
fi
say "A/B"
BINS=$(for s in $SETTINGS; do echo "${s%%=*}=$B,${s#*=}"; done | tr '\n' ' ')
BINS="$BINS" MODELS=llama8b ROUNDS=${ROUNDS:-3} OUT=$OUT bash $D/h200_ab_binaries.sh >/dev/null 2>&1
for t in ${TRACES:-}; do
  for s in $SETTINGS; do
    [ "${s%%=*}" = $t ] || continue
    say "trace $t"
    LLMDIFF=$B MODELS=llama8b PLAIN=0 TRACE_SETTINGS="$(echo ${s#*=} | tr ',' ' ')" LABEL=_$t OUT=$OUT bash $D/h200_trace_run.sh
  done
done
for t in ${DIFFS:-}; do
  for s in $SETTINGS; do
    [ "${s%%=*}" = $t ] || continue
    say "diff-layers $t"
    env $(echo ${s#*=} | tr ',' ' ') timeout 150 $B diff-layers $M/llama8b.gguf --tokens 1,5,9,13,17,21,25,29 \
      --backend cuda --decode-steps 2 --json >$W/d_$t.json 2>>$LOG
    echo "rc=$?" >>$LOG
    python3 - $W/d_$t.json $t <<'PY' | tee -a $LOG
import json, sys
d = json.load(open(sys.argv[1]))
taps = [t for t in d["taps"] if t["metrics"]["rel_l2"] is not None]
worst = max(taps, key=lambda t: t["metrics"]["rel_l2"] / t["threshold"])
lg = [t["metrics"]["rel_l2"] for t in taps if t["site"] == "logits"]
print(sys.argv[2], "verdict", d["verdict"], "first", d["first_divergence"], "taps over", sum(t["over"] for t in taps),
      "of", len(taps), "worst", worst["tap"], "%.3g (threshold %.3g)" % (worst["metrics"]["rel_l2"], worst["threshold"]),
      "logits rel_l2", ["%.3g" % x for x in lg])
PY
  done
done
say "done"
