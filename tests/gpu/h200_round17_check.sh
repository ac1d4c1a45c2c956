#!/bin/bash
# Round 17 of issue #8, the last call of the session (under 250 s of device time left): the final
# binary's kernel checks, then the prefill GEMM (K split, barrier every second step) end to end
# against the reference: healthy diff-layers on two Q4_K models, three faults on CUDA and CPU,
# and diff-layers on the 8B shape (its 8-token prefill takes 64-token tiles split in two).
# Usage (GPU machine): LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_round17_check.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}; M=/tmp/gpu/models; mkdir -p $M
T0=$(date +%s); say() { echo "== $* (t=$(( $(date +%s)-T0 ))s)" | tee -a $OUT/log.txt; }
say "kernels --check"
timeout 100 $B kernels --check --json >$OUT/kernels_check.json 2>/dev/null
python3 -c "
import json; c=json.load(open('$OUT/kernels_check.json'))['checks']; g=[x for x in c if '_k2' in x['case']]
print(sum(x['pass'] for x in c), 'of', len(c), 'pass; K-split cases', sum(x['pass'] for x in g), 'of', len(g), 'worst rel_l2 %.2e' % max(x['rel_l2'] for x in g), 'failing', [x['case'] for x in c if not x['pass']][:8])" | tee -a $OUT/log.txt
gzip -f $OUT/kernels_check.json
say "synth"
for p in deepseek-v3-mini llama-tiny; do $B synth --preset $p --quant Q4_K --seed 2 -o $M/$p-q4k.gguf >/dev/null; done
[ -f $M/llama8b.gguf ] || timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null
TOK=1,5,9,13,17,21,25,29
v() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); fd=d.get('first_divergence') or {}; print(d['verdict'], fd.get('tap'), (d.get('diagnosis') or {}).get('class'))" $1 2>&1 | head -c 160; }
say "healthy and faults"
for m in deepseek-v3-mini:2 llama-tiny:1; do
  p=${m%%:*}; tp=${m##*:}
  timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend cuda --tp $tp --json >/tmp/h.json 2>/dev/null
  echo "healthy $p-q4k tp$tp: $(v /tmp/h.json)" | tee -a $OUT/log.txt
  for f in kv-b-unsharded dequant-q4k-scale-min phantom-attn-out; do
    for dev in cuda cpu; do timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend $dev --tp $tp --inject $f --json >/tmp/f_$dev.json 2>/dev/null; done
    echo "fault $p-q4k tp$tp $f: cuda $(v /tmp/f_cuda.json) | cpu $(v /tmp/f_cpu.json)" | tee -a $OUT/log.txt
  done
done
say "diff-layers on the 8B shape"
T1=$(date +%s.%N)
timeout 120 $B diff-layers $M/llama8b.gguf --tokens $TOK --backend cuda --json >/tmp/d8.json 2>/dev/null
echo "rc=$? wall $(python3 -c "print(round($(date +%s.%N)-$T1,2))") s: $(v /tmp/d8.json) $(python3 -c "import json; print(json.load(open('/tmp/d8.json')).get('timings_s'))")" | tee -a $OUT/log.txt
say "done"
