export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=$PWD/.wtcuda/llmdiff
L=$OUT/log.txt
T0=$(date +%s)
LLMDIFF_PDL=1 timeout 150 $B kernels --check > /tmp/kc.txt 2>&1; echo rc=$? >> $L
grep -E "FAIL|kernel checks pass|panic|error|compiled gemm" /tmp/kc.txt | head -30 >> $L
grep -E "gemm2_wg" /tmp/kc.txt | head -6 >> $L
echo "t=$(( $(date +%s)-T0 ))" >> $L
M=/tmp/m; mkdir -p $M
$B synth --arch llama --n-layers 4 --d-model 2048 --n-heads 16 --n-kv-heads 4 --ffn-dim 5632 --vocab 2000 --quant Q4_K --seed 5 -o $M/l2k.gguf >/dev/null 2>>$L
for e in LLMDIFF_PDL=1 LLMDIFF_GEMM_KIND=wg; do for tp in 1 2; do
env $e timeout 30 $B diff-layers $M/l2k.gguf --tokens 1,5,9,13,17,21,25,29 --backend cuda --tp $tp --decode-steps 3 --json 2>/dev/null | python3 -c "import json,sys;d=json.load(sys.stdin);print('l2k $e tp$tp steps3', d['verdict'], d.get('first_divergence'))" >> $L
done; done
timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$L
echo "t=$(( $(date +%s)-T0 ))" >> $L
for e in X=1 LLMDIFF_PDL=1 LLMDIFF_GEMM_KIND=wg; do
env $e timeout 60 $B bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 32 --reps 2 --json 2>/dev/null | python3 -c "
import json,sys; d=json.load(sys.stdin); g=d.get('decode_graphs') or {}; print('8B $e decode %.3f ms plain %.3f ms bitwise %s prefill_last %.4f s (%.0f tok/s)' % (d['decode_s_per_token']*1e3, g.get('decode_plain_s_per_token',0)*1e3, g.get('logits_bitwise_equal'), d['prefill_last_s'], d['prefill_last_tok_s']))" >> $L
done
echo "t=$(( $(date +%s)-T0 ))" >> $L
