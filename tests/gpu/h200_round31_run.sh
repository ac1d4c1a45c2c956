#!/bin/bash
# Round 31 (issue #8), one device call: the split decode attention's L2 prefetch of the o and
# gate weights (LLMDIFF_PREFETCH_MB) and the q/k/v launch's variant (LLMDIFF_GEMV_VARIANT with a
# shape). `kernels --check` (summary, the split attention's cases, whose `_dpos` runs prefetch),
# then the A/B bench of SETTINGS (label=VAR=value[,VAR=value]; tests/gpu/h200_ab_binaries.sh,
# 8B only), then kernel traces of TRACES (labels of SETTINGS), then `diff-layers --decode-steps 2`
# on the 8B shape under each of DIFFS (labels of SETTINGS): verdict, first divergence, the worst
# tap against its threshold and the logits' rel_l2.
# Usage (GPU machine): LLMDIFF=target/new/llmdiff OUT=dir [SETTINGS="..."] [TRACES="pf0 pf24"]
#   [DIFFS="..."] [ROUNDS=3] bash tests/gpu/h200_round31_run.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
D=$(cd $(dirname $0) && pwd)
B=${LLMDIFF:?}
W=/tmp/gpu; M=$W/models; mkdir -p $M
T0=$(date +%s); LOG=$OUT/log.txt
say() { echo "== $* (t=$(( $(date +%s) - T0 ))s)" | tee -a $LOG; }
QKV=6144x4096
SETTINGS=${SETTINGS:-pf0=LLMDIFF_PREFETCH_MB=0 pf12=LLMDIFF_PREFETCH_MB=12 pf24=LLMDIFF_PREFETCH_MB=24 pf40=LLMDIFF_PREFETCH_MB=40 \
qkv_bulk=LLMDIFF_GEMV_VARIANT=$QKV=gemvb_q4_k_r8_w2_m3_s2 qkv_r2=LLMDIFF_GEMV_VARIANT=$QKV=gemvw_q4_k_r2_w2_u1_m3 \
qkv_m2=LLMDIFF_GEMV_VARIANT=$QKV=gemvw_q4_k_r8_w4_u1_m2}
if [ -z "${SKIP_CHECK:-}" ]; then
  say "kernels --check"
  B=$B W=$W OUT=$OUT LOG=$LOG bash $D/kernel_check.sh "split:ATTN_GQA_SPLIT("
fi
say "A/B"
BINS=$(for s in $SETTINGS; do echo "${s%%=*}=$B,${s#*=}"; done | tr '\n' ' ')
BINS="$BINS" MODELS=llama8b ROUNDS=${ROUNDS:-3} OUT=$OUT bash $D/h200_ab_binaries.sh >/dev/null 2>&1
for t in ${TRACES:-pf0 pf24}; do
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
