#!/bin/bash
# Round 7 of issue #8, first device call: the integer GEMV form (warp-rows mode 2: dp4a on x in
# int8 limbs). Kernel checks (every variant, mode 2 on x of mixed magnitudes and non-finite x),
# `kernels --bench` (every compiled variant timed against the copy bandwidth), then the model
# benches with the new default (mode 2 for Q4_K and Q4_1) beside mode 0 (LLMDIFF_GEMV_MODE=0),
# and a healthy diff-layers on the smollm2 and llama-tiny shapes.
# Usage (GPU machine): LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_round7_gemv.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
W=/tmp/gpu; M=$W/models; mkdir -p $M
T0=$(date +%s)
LOG=$OUT/log.txt
say() { echo "== $* (t=$(( $(date +%s)-T0 ))s)" | tee -a $LOG; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader >>$LOG 2>&1
say "kernels --check"
timeout 200 $B kernels --check >$OUT/kernels_check.txt 2>&1; echo "rc=$?" >>$LOG
grep -E "FAIL|kernel checks pass|error|panic" $OUT/kernels_check.txt | head -40 | tee -a $LOG
say "kernels --bench"
timeout 150 $B kernels --bench --json >$OUT/kernels_bench.json 2>>$LOG; echo "rc=$?" >>$LOG
python3 - "$OUT/kernels_bench.json" <<'PY' | tee $OUT/kernels_bench.txt | tee -a $LOG
import json, sys
d = json.load(open(sys.argv[1]))
print("copy GB/s", round(d["copy_gb_per_s"]))
cases = {}
for r in d["bench"]:
    cases.setdefault(r["case"], []).append(r)
for c, rs in cases.items():
    dflt = [r for r in rs if r["variant"] is None]
    best = sorted((r for r in rs if r["variant"]), key=lambda r: r["seconds"])[:4]
    m0 = sorted((r for r in rs if r["variant"] and not r["variant"].endswith("_m2")), key=lambda r: r["seconds"])[:1]
    line = f"{c}: default {dflt[0]['seconds']*1e6:.2f} us {100*dflt[0]['fraction_of_copy']:.1f} %" if dflt else c
    print(line + "; best " + ", ".join(f"{r['variant']} {r['seconds']*1e6:.2f} us {100*r['fraction_of_copy']:.1f} %" for r in best)
          + "; best float form " + ", ".join(f"{r['variant']} {100*r['fraction_of_copy']:.1f} %" for r in m0))
for g in d.get("gemm_bench", []):
    print(g["case"], " ".join(f"{p['path']} {p['seconds']*1e6:.1f} us {p['tflops']:.1f} TF" for p in g["paths"]))
PY
say "synth"
for p in smollm2-135m; do $B synth --preset $p --seed 1 -o $M/$p.gguf >/dev/null 2>>$LOG; done
$B synth --preset llama-tiny --quant Q4_K --seed 2 -o $M/llama-tiny-q4k.gguf >/dev/null 2>>$LOG
timeout 150 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
say "healthy diff-layers, default GEMV"
TOK=1,5,9,13,17,21,25,29
for m in smollm2-135m:1 smollm2-135m:3 llama-tiny-q4k:1 llama-tiny-q4k:2; do
  p=${m%%:*}; tp=${m##*:}
  timeout 90 $B diff-layers $M/$p.gguf --tokens $TOK --backend cuda --tp $tp --decode-steps 2 --json >$W/h.json 2>$W/h.err
  echo "$p tp$tp rc=$? $(python3 -c "import json;d=json.load(open('$W/h.json'));print(d['verdict'],d.get('first_divergence'))" 2>&1 | head -c 300)" | tee -a $LOG
done
say "model bench: default (mode 2), then LLMDIFF_GEMV_MODE=0"
for mode in "" 0; do
  for m in smollm2-135m llama8b; do
    LLMDIFF_GEMV_MODE=$mode timeout 120 $B bench $M/$m.gguf --backend cuda --n-prompt 512 --n-decode 32 --reps 2 --json >$W/b.json 2>>$LOG
    python3 -c "
import json;d=json.load(open('$W/b.json'));d['gemv_mode_env']='$mode';print(json.dumps(d))" >>$OUT/bench.jsonl 2>>$LOG
  done
done
python3 - $OUT/bench.jsonl <<'PY' | tee -a $LOG
import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l); print(d.get('gemv_mode_env'), {k:v for k,v in d.items() if not isinstance(v,(list,dict))})
PY
say "done"
