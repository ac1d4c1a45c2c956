#!/bin/bash
# Issue #8's evidence call (one device call, under 10 minutes; rounds 7 and 8): kernel checks and
# kernels --bench (GEMV variants against the copy bandwidth, prefill GEMM paths, decode
# attention), the healthy and fault matrices on CUDA (faults also on the CPU engine, to compare),
# model benches (smollm2 and the 8B shape, the 8B one also under each BENCH_AB configuration:
# label=VAR=value[,VAR=value], one fused path or kernel choice turned back), entropy/gate/generate
# on CUDA against the CPU engine, diff-layers timed on the 8B shape, and Nsight Compute per-kernel
# times of 8B decode steps (the GEMV per launch shape too) and of a 512-token prefill while time
# is left. Every step has its own timeout; the most wanted figures come first, since the device
# call may end before the script does. $OUT gets at most 8 files (a device call returns no more):
# log.txt (every summary), kernels_check.json, kernels_bench.json, bench.jsonl, healthy.txt,
# faults.txt, gate_cuda.json.
# Usage (GPU machine): LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_evidence_run.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
D=$(cd $(dirname $0) && pwd); R=$(cd $D/../.. && pwd)
W=/tmp/gpu; M=$W/models; mkdir -p $M $W/faults
T0=$(date +%s)
LOG=$OUT/log.txt
el() { echo $(( $(date +%s)-T0 )); }
say() { echo "== $* (t=$(el)s)" | tee -a $LOG; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader >>$LOG 2>&1
say "kernels --check"
timeout 150 $B kernels --check --json >$OUT/kernels_check.json 2>>$LOG; echo "rc=$?" >>$LOG
python3 - $OUT/kernels_check.json <<'PY' | tee -a $LOG
import json, sys
d = json.load(open(sys.argv[1])); c = d["checks"]
print(sum(x["pass"] for x in c), "of", len(c), "kernel checks pass; failing:", [x["case"] for x in c if not x["pass"]][:20])
PY
say "synth"
for p in deepseek-v3-mini glm5-mini smollm2-135m; do $B synth --preset $p --seed 1 -o $M/$p.gguf >/dev/null 2>>$LOG; done
for p in deepseek-v3-mini llama-tiny; do $B synth --preset $p --quant Q4_K --seed 2 -o $M/$p-q4k.gguf >/dev/null 2>>$LOG; done
timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
TOK=1,5,9,13,17,21,25,29
say "model bench"
bench() { # label VAR=value model args...
  local label=$1 envs=$2; shift 2
  env $envs timeout 90 $B bench "$@" --backend cuda --json 2>/dev/null >$W/b.json
  python3 -c "
import json; d=json.load(open('$W/b.json')); d['label']='$label'; print(json.dumps(d))" >>$OUT/bench.jsonl 2>>$LOG
}
bench smollm2 X=1 $M/smollm2-135m.gguf --n-prompt 512 --n-decode 64 --reps 3
bench 8b X=1 $M/llama8b.gguf --n-prompt 512 --n-decode 32 --reps 2
for cfg in $BENCH_AB; do
  bench 8b-${cfg%%=*} "$(echo ${cfg#*=} | tr ',' ' ')" $M/llama8b.gguf --n-prompt 512 --n-decode 32 --reps 2
done
python3 - $OUT/bench.jsonl <<'PY' | tee -a $LOG
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    g = d.get("decode_graphs") or {}
    print(d["label"], "decode %.3f ms (with warm-up %.3f, graphs off %.3f)" % (d["decode_s_per_token"] * 1e3, d["decode_s_per_token_with_warmup"] * 1e3, g.get("decode_plain_s_per_token", 0) * 1e3),
          "prefill_last %.4f s (%.0f tok/s)" % (d["prefill_last_s"], d["prefill_last_tok_s"]), "prefill_all %.4f s" % d["prefill_s"], "graphs bitwise:", g.get("logits_bitwise_equal"),
          "decode check rel_l2:", (d.get("decode_check") or {}).get("rel_l2"))
PY
say "healthy diff-layers"
for p in deepseek-v3-mini glm5-mini smollm2-135m; do
  tps="1 2 8"; [ $p = smollm2-135m ] && tps="1 3"
  for tp in $tps; do for steps in 0 2; do
    timeout 60 $B diff-layers $M/$p.gguf --tokens $TOK --backend cuda --tp $tp --decode-steps $steps --json >$W/h.json 2>$W/h.err
    echo "$p-tp$tp-d$steps rc=$? $(python3 -c "import json;d=json.load(open('$W/h.json'));print(d['verdict'],d.get('backend',''),d.get('first_divergence'))" 2>&1 | head -c 200)" | tee -a $OUT/healthy.txt >>$LOG
  done; done
done
grep -c " agree " $OUT/healthy.txt | sed 's/^/healthy agree: /' | tee -a $LOG
say "fault matrix"
FAULTS="phantom-attn-out kv-b-unsharded kv-b-shard-swap k-b-untransposed dequant-q4k-scale-min f16-residual allreduce-skip rope-neox moe-gate-rounded stale-attn-out config-drift kv-slot-off-by-one"
for m in deepseek-v3-mini:2 llama-tiny:2 llama-tiny:1; do
  p=${m%%:*}; tp=${m##*:}
  for f in $FAULTS; do
    extra=""; [ $f = kv-slot-off-by-one ] && extra="--decode-steps 2"
    for dev in cuda cpu; do
      timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend $dev --tp $tp --inject $f $extra --json >$W/faults/$dev.json 2>$W/faults/$dev.err
    done
    python3 - $W/faults "$p-tp$tp-$f" <<'PY' | tee -a $OUT/faults.txt >>$LOG
import json, sys
r = []
for dev in ("cuda", "cpu"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{dev}.json")); fd = d.get("first_divergence") or {}
        r.append((d["verdict"], fd.get("tap"), (d.get("diagnosis") or {}).get("class")))
    except Exception:
        r.append(("n/a", open(f"{sys.argv[1]}/{dev}.err").read().strip()[:80], None))
print(sys.argv[2], "cuda:", r[0], "cpu:", r[1], "SAME" if r[0] == r[1] else "DIFF")
PY
  done
done
grep -c SAME $OUT/faults.txt | sed 's/^/fault cases SAME: /' | tee -a $LOG
say "kernels --bench"
timeout 200 $B kernels --bench --json >$OUT/kernels_bench.json 2>>$LOG; echo "rc=$?" >>$LOG
python3 $D/bench_summary.py $OUT/kernels_bench.json | tee $W/kernels_bench.txt | tee -a $LOG
say "entropy, gate, generate on cuda against cpu"
printf '{"tokens":[1,5,9,13,17,21]}\n{"tokens":[2,4,6,8]}\n' >$W/prompts.jsonl
for be in cuda cpu; do
  timeout 60 $B entropy $M/deepseek-v3-mini.gguf --prompts $W/prompts.jsonl --backend $be --tp 2 --against-reference --json >$W/entropy_$be.json 2>>$LOG
  timeout 60 $B generate $M/smollm2-135m.gguf --tokens 1,2,3,4 --max-new-tokens 24 --backend $be --json >$W/generate_$be.json 2>>$LOG
done
python3 - $W <<'PY' | tee -a $LOG
import json, sys
w = sys.argv[1]
for be in ("cuda", "cpu"):
    d = json.load(open(f"{w}/entropy_{be}.json"))
    print("entropy deepseek-v3-mini TP 2", be, d["backend"], d["verdict"], d.get("agreement"), "kld mean", (d.get("kld") or {}).get("mean"))
g = [json.load(open(f"{w}/generate_{be}.json")) for be in ("cuda", "cpu")]
print("generate smollm2 synth: cuda", g[0]["tokens"][:12], "| cpu", g[1]["tokens"][:12], "| same:", g[0]["tokens"] == g[1]["tokens"])
PY
timeout 90 $B gate --golden $R/golden/gate-deepseek-v3-mini-cpu-tp2.json --backend cuda --json >$OUT/gate_cuda.json 2>>$LOG
echo "gate --backend cuda rc=$?" | tee -a $LOG
say "diff-layers on the 8B shape"
T1=$(date +%s.%N)
timeout 120 $B diff-layers $M/llama8b.gguf --tokens $TOK --backend cuda --json >$W/diff8b.json 2>$W/diff8b.err
echo "rc=$? wall $(python3 -c "print(round($(date +%s.%N)-$T1,2))") s" | tee -a $LOG
python3 -c "
import json;d=json.load(open('$W/diff8b.json'))
print(json.dumps({k:d.get(k) for k in ('verdict','backend','first_divergence','timings_s')}))" | tee -a $LOG
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
ncu_case() { # name skip count passes args...
  local name=$1 skip=$2 cnt=$3 steps=$4; shift 4
  if [ $(el) -ge ${NCU_BEFORE_S:-470} ] || [ -z "$NCU" ]; then say "ncu $name skipped"; return; fi
  say "ncu $name"
  LLMDIFF_CUDA_GRAPH=0 timeout 60 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip $skip --launch-count $cnt $B "$@" >$W/ncu_$name.csv 2>$W/ncu_$name.err
  python3 $D/ncu_summary.py $W/ncu_$name.csv $steps $NCU_EXTRA 2>&1 | head -24 | tee -a $LOG
}
# Decode: windows of 3 passes after 2 (NCU_DECODE_K kernels a pass; the totals are divided by the
# launches of rope_table, one a pass, so a wrong K shows as a count other than 3).
K=${NCU_DECODE_K:-260}
NCU_EXTRA="grid:${NCU_GEMV:-gemvw_q4_k_r8_w4_u1_m2}:2" ncu_case llama8b_decode $((2 * K)) $((3 * K)) per:rope_table bench $M/llama8b.gguf --backend cuda --n-prompt 1 --n-decode 4 --reps 1
ncu_case llama8b_prefill 0 3000 2 bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 0 --reps 1
say "all done"
