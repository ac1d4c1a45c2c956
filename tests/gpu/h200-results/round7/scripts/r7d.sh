export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=$PWD/.wtcuda/llmdiff
L=$OUT/log.txt
T0=$(date +%s)
timeout 200 $B kernels --check > $OUT/kernels_check.txt 2>&1; echo rc=$? >> $L
grep -E "FAIL|kernel checks pass|panic|error" $OUT/kernels_check.txt | head -40 >> $L
grep -E "MUL_MAT.*gemm" $OUT/kernels_check.txt | head -5 >> $L
echo "t=$(( $(date +%s)-T0 ))" >> $L
timeout 200 $B kernels --bench --json > $OUT/kernels_bench.json 2>>$L; echo rc=$? >> $L
python3 - "$OUT/kernels_bench.json" <<'PY' >> $L
import json, sys
d = json.load(open(sys.argv[1]))
for g in d.get("gemm_bench", []):
    print(g["case"], " | ".join(f"{p['path']} {p['seconds']*1e6:.1f} us {p['tflops']:.1f} TF" for p in g["paths"]))
PY
echo "t=$(( $(date +%s)-T0 ))" >> $L
M=/tmp/m; mkdir -p $M
$B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$L
$B synth --preset smollm2-135m --seed 1 -o $M/smollm2.gguf >/dev/null 2>>$L
for k in "" v1; do for m in llama8b smollm2; do
  LLMDIFF_GEMM_KIND=$k timeout 100 $B bench $M/$m.gguf --backend cuda --n-prompt 512 --n-decode 32 --reps 2 --json 2>>$L | python3 -c "
import json,sys; d=json.load(sys.stdin); print('$m', 'gemm=${k:-default}', {k:v for k,v in d.items() if k.startswith(('prefill','decode'))})" >> $L
done; done
$B diff-layers $M/smollm2.gguf --tokens 1,5,9,13,17,21,25,29 --backend cuda --json 2>/dev/null | python3 -c "import json,sys;d=json.load(sys.stdin);print('smollm2 diff', d['verdict'], d.get('first_divergence'))" >> $L
echo "t=$(( $(date +%s)-T0 ))" >> $L
$B synth --preset llama-tiny --quant Q4_K --seed 2 -o $M/lt.gguf >/dev/null 2>>$L
for tp in 1 2; do $B diff-layers $M/lt.gguf --tokens 1,5,9,13,17,21,25,29,3,7,11,2,4,6,8,10,12,14 --backend cuda --tp $tp --json 2>/dev/null | python3 -c "import json,sys;d=json.load(sys.stdin);print('llama-tiny q4k tp$tp diff', d['verdict'], d.get('first_divergence'))" >> $L; done
