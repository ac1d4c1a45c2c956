export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=$PWD/.wtcuda/llmdiff
L=$OUT/log.txt
timeout 200 $B kernels --check > /tmp/kc.txt 2>&1; echo rc=$? >> $L
grep -E "FAIL|kernel checks pass|panic|error" /tmp/kc.txt | head -30 >> $L
grep -E "GEMV_LIMBS" /tmp/kc.txt >> $L
M=/tmp/m; mkdir -p $M
$B synth --arch llama --n-layers 4 --d-model 2048 --n-heads 16 --n-kv-heads 4 --ffn-dim 5632 --vocab 2000 --quant Q4_K --seed 5 -o $M/l2k.gguf >/dev/null 2>>$L
for tp in 1 2; do for st in 0 3; do
$B diff-layers $M/l2k.gguf --tokens 1,5,9,13,17,21,25,29 --backend cuda --tp $tp --decode-steps $st --json 2>/dev/null | python3 -c "import json,sys;d=json.load(sys.stdin);print('l2k tp$tp steps$st', d['verdict'], d.get('first_divergence'))" >> $L
done; done
$B bench $M/l2k.gguf --backend cuda --n-prompt 64 --n-decode 32 --reps 2 --json 2>/dev/null | python3 -c "
import json,sys; d=json.load(sys.stdin); print('l2k bench', d['decode_s_per_token']*1e3, 'ms', d.get('decode_graphs'))" >> $L
$B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$L
for p in 64 512; do
$B bench $M/llama8b.gguf --backend cuda --n-prompt $p --n-decode 32 --reps 2 --json 2>/dev/null | python3 -c "
import json,sys; d=json.load(sys.stdin); print('8B bench n_prompt $p', {k:v for k,v in d.items() if k.startswith(('prefill','decode'))})" >> $L
done
