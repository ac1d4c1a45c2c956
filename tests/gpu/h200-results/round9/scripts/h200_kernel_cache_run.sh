#!/bin/bash
# Issue #8, round 9: the kernel cache on the H200 (kernels --check with a cold on-disk cache, the
# start-up of a small run without and with it), then the 8B bench on the final code.
# Usage (GPU machine, repository root): OUT=/some/dir bash tests/gpu/h200_kernel_cache_run.sh
# (SHORT=1: only the start-up of a small run with no cache, filling a cold one, and warm.)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=$PWD/.wtcuda/llmdiff; M=/tmp/gpu/models; mkdir -p $M; KC=/tmp/kc
$B synth --preset smollm2-135m --seed 1 -o $M/smollm2-135m.gguf >/dev/null 2>&1
exec 3>&1  # t's report goes to the script's stdout, past the command's own redirections
t() { local s=$(date +%s%N); "$@"; local e=$(date +%s%N); echo "  wall $(( (e - s) / 1000000 )) ms" >&3; }
[ "$SHORT" = 1 ] || { echo "== kernels --check, cold disk cache"; t env LLMDIFF_KERNEL_CACHE=$KC $B kernels --check --json >$OUT/kc.json 2>$OUT/kc.err; tail -2 $OUT/kc.err; }
[ "$SHORT" = 1 ] || python3 -c "import json; d=json.load(open('$OUT/kc.json')); c=d['checks']; print(sum(x['pass'] for x in c),'of',len(c),'pass; compile_s',d.get('compile_s'),'from_disk',d.get('compile_from_disk'))"
[ "$SHORT" = 1 ] && { echo "== logits smollm2, a cold cache (filled)"; KC=/tmp/kc2; t env LLMDIFF_KERNEL_CACHE=$KC $B logits $M/smollm2-135m.gguf --backend cuda --tokens 1,2,3 --json >/dev/null 2>&1; }
ls $KC | head
echo "== logits smollm2, no disk cache"; t env LLMDIFF_KERNEL_CACHE=off $B logits $M/smollm2-135m.gguf --backend cuda --tokens 1,2,3 --json >/dev/null 2>&1
echo "== logits smollm2, warm disk cache"; t env LLMDIFF_KERNEL_CACHE=$KC $B logits $M/smollm2-135m.gguf --backend cuda --tokens 1,2,3 --json >/dev/null 2>&1
echo "== logits smollm2, reference (same tokens) for comparison"; t $B logits $M/smollm2-135m.gguf --tokens 1,2,3 --json >/dev/null 2>&1
[ "$SHORT" = 1 ] && exit 0
timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>&1
echo "== bench 8B (warm cache)"; LLMDIFF_KERNEL_CACHE=$KC timeout 120 $B bench $M/llama8b.gguf --backend cuda --n-prompt 512 --n-decode 48 --reps 2 --json 2>/dev/null >$OUT/b.json
python3 -c "
import json; d=json.load(open('$OUT/b.json')); g=d.get('decode_graphs') or {}
print('llama8b decode %.3f ms (plain %.3f) prefill_last %.4f s (%.0f tok/s) bitwise %s' % (d['decode_s_per_token']*1e3, g.get('decode_plain_s_per_token',0)*1e3, d['prefill_last_s'], d['prefill_last_tok_s'], g.get('logits_bitwise_equal')))"
