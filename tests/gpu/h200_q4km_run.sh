#!/bin/bash
# Q4_K_M on the GPU (issue #8, round 27), in one device call: the mix llama.cpp users run (Q4_K,
# with the output matrix and attn_v / ffn_down of half the layers in Q6_K). `kernels --check`
# (summary, Q6_K cases counted), the 8B shape synthesized as Q4_K_M here, `bench` of every binary
# in BINS on it (label=path[,VAR=value...], interleaved as h200_ab_binaries.sh does), diff-layers
# of the new binary on it (prefill and two decode steps against the CPU reference; DIFF=0 skips
# it), with LCPP_TAR (tests/peers/llamacpp_src_tarball.sh) llama.cpp's CUDA backend built here
# and `llama-bench` on the same file, then, time allowing, `kernels --bench` (summary).
# Usage (GPU machine): NEW=.wtcuda/llmdiff BINS="old=.wtcuda/llmdiff_old new=.wtcuda/llmdiff" \
#   [LCPP_TAR=.wtcuda/llama.cpp.tar.xz] OUT=dir bash tests/gpu/h200_q4km_run.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
D=$(cd $(dirname $0) && pwd)
B=${NEW:?NEW=path to the binary under test}
W=/tmp/gpu; M=$W/models; mkdir -p $M
T0=$(date +%s); LOG=$OUT/log.txt
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "== $* (t=$(el)s)" | tee -a $LOG; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $LOG
# llama.cpp builds on the CPUs while the kernel checks and the synth run (no timings then).
if [ -n "${LCPP_TAR:-}" ]; then
  say "llama.cpp build (background)"
  rm -rf $W/lcpp && mkdir -p $W/lcpp && tar xJf $LCPP_TAR -C $W/lcpp
  L=$W/lcpp/llama.cpp
  (cmake -S $L -B $L/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_QUANTS=f16-f16 \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    >$W/lcpp_cmake.txt 2>&1 && timeout 330 nice -n 15 cmake --build $L/build --target llama-bench -j"$(nproc)" \
    >$W/lcpp_build.txt 2>&1) &
  LCPP_PID=$!
fi
if [ -z "${SKIP_CHECK:-}" ]; then
  say "kernels --check"
  B=$B W=$W OUT=$OUT LOG=$LOG bash $D/kernel_check.sh "Q6_K:q6_K|q6_k"
fi
say "synth"
Q=${QUANT:-Q4_K_M}; F=$M/llama8b_$Q.gguf
timeout 200 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 \
  --vocab 32000 --quant $Q --seed 3 -o $F 2>>$LOG | tee -a $LOG
ls -la $M | tee -a $LOG
[ -n "${LCPP_PID:-}" ] && { wait $LCPP_PID; say "llama.cpp build rc=$?"; LCPP_PID=; }
say "model bench"
REV=$(for c in $BINS; do echo $c; done | tac | tr '\n' ' ')
for round in $(seq ${ROUNDS:-1}); do
  order=$BINS; [ $((round % 2)) = 0 ] && order=$REV
  for cfg in $order; do
    label=${cfg%%=*}; rest=${cfg#*=}; bin=${rest%%,*}; envs=X=1
    [ "$bin" != "$rest" ] && envs=$(echo ${rest#*,} | tr ',' ' ')
    env $envs timeout 150 $bin bench $F --backend cuda --n-prompt 512 --n-decode 48 --reps 2 --json 2>>$LOG >$W/b.json
    python3 -c "
import json; d=json.load(open('$W/b.json')); g=d.get('decode_graphs') or {}
print('$Q $label', 'decode %.3f ms (plain %.3f)' % (d['decode_s_per_token']*1e3, g.get('decode_plain_s_per_token',0)*1e3),
      'prefill_last %.0f tok/s' % d['prefill_last_tok_s'], 'model_bytes', d.get('model_bytes'), 'bitwise', g.get('logits_bitwise_equal'),
      'decode check rel_l2', (d.get('decode_check') or {}).get('rel_l2'))" 2>&1 | tee -a $LOG
    cp $W/b.json $OUT/bench_$label.json
  done
done
if [ "${DIFF:-1}" != 0 ]; then
say "diff-layers"
timeout 120 $B diff-layers $F --tokens 1,5,9,13,17,21,25,29 --backend cuda --decode-steps 2 --json >$W/diff.json 2>$W/diff.err
echo "rc=$?" | tee -a $LOG
python3 -c "
import json;d=json.load(open('$W/diff.json'))
print(json.dumps({k:d.get(k) for k in ('verdict','backend','first_divergence','timings_s')}))" 2>&1 | tee -a $LOG
tail -3 $W/diff.err >>$LOG
fi
if [ -n "${LCPP_TAR:-}" ]; then
  LB=$L/build/bin/llama-bench
  if [ -x $LB ]; then
    timeout 90 $LB -m $F -ngl 99 -p 512 -n 32 -d 512 -fa 1 -r 3 -o json >$OUT/lcpp_$Q.json 2>>$LOG
    say "llama-bench rc=$?"
    python3 - $OUT/lcpp_$Q.json <<'PY' | tee -a $LOG
import json, sys
for r in json.load(open(sys.argv[1])):
    kind = "pp" if r["n_prompt"] else "tg"
    best = max(r.get("samples_ts") or [r["avg_ts"]])
    print(f"llama.cpp: {kind}{r['n_prompt'] or r['n_gen']} depth {r.get('n_depth', 0)} fa {r.get('flash_attn')}: "
          f"mean {r['avg_ts']:.1f} tok/s ({1e3 / r['avg_ts']:.3f} ms a token), best {best:.1f} ({1e3 / best:.3f} ms)")
PY
  else
    tail -5 $W/lcpp_build.txt | tee -a $LOG
  fi
fi
if [ $(el) -lt ${KBENCH_BEFORE_S:-380} ]; then
  say "kernels --bench"
  timeout $(( 590 - $(el) )) $B kernels --bench --json >$W/kb.json 2>>$LOG
  python3 $D/bench_summary.py $W/kb.json 2>&1 | tee $OUT/kernels_bench_summary.txt | grep -i "copy\|q6_k\|Q6" | tee -a $LOG
  gzip -c $W/kb.json >$OUT/kernels_bench.json.gz
else
  say "kernels --bench skipped"
fi
say "done"
