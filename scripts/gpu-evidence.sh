#!/usr/bin/env bash
# Every figure docs/perf.md quotes, in one call on a GPU machine, written under $OUT:
#
#   bash scripts/gpu-evidence.sh                          # the binary at target/release/llmdiff
#   OLD=old/llmdiff bash scripts/gpu-evidence.sh          # + an interleaved A/B of the model benches
#   LCPP_TAR=llama.cpp.tar.xz STEPS=peers bash scripts/gpu-evidence.sh   # the peer tables
#
# The binary is a `cargo build --release --features cuda` made anywhere (cudarc loads CUDA at run
# time), carried to the machine at target/release/llmdiff (`strip` it first if the carry has a
# size limit: ~69 MB with line tables, far less stripped); the models are synthesized here with
# `llmdiff synth`, so nothing else is needed. LLMDIFF=path overrides the binary. Steps (STEPS, space-separated; default all but peers):
#   check    `kernels --check`: every kernel against the CPU engine
#   healthy  diff-layers on CUDA, 3 presets x TP x prefill/decode: every case must agree
#   bench    `bench` on smollm2-135m, the 8B llama shape in Q4_K and Q4_K_M (BENCH_MODELS picks); with OLD, both
#            binaries interleaved over ROUNDS (default 2; A B, then B A) so drift cancels
#   families the GQA/MoE families on CUDA: the committed tiny fixtures (golden/*-tiny.f32.gguf) at TP 1/2
#            with decode, the qwen3 presets in Q4_K at TP 1/2/4, and faults cuda against cpu on them
#   faults   the fault catalog on CUDA and on the CPU engine: the same verdict, tap and class
#            (FAULT_MODELS picks the model:TP pairs)
#   diff8b   diff-layers on the 8B shape, timed
#   kbench   `kernels --bench`: GEMVs against the copy bandwidth, prefill GEMM, attention
#   nccl     (2+ GPUs) TP 2 on real ranks (--ranks nccl) against simulated ranks
#   peers    llama.cpp's CUDA backend built from LCPP_TAR (tests/peers/llamacpp_src_tarball.sh
#            makes it), llama-bench on the same files; HF transformers eager bf16 if torch is there
# Each step has its own timeout and the most wanted come first: a call that ends early still
# returns what it wrote. $OUT/summary.txt is the summary (scripts/gpu_summary.py).
set -u
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
B=${LLMDIFF:-$PWD/target/release/llmdiff}
OUT=${OUT:?OUT=the folder to write to}
STEPS=" ${STEPS:-check healthy families faults bench diff8b kbench nccl} "
S="python3 scripts/gpu_summary.py"
W=/tmp/gpu-evidence; M=$W/models; mkdir -p $M $W/f "$OUT"
LOG=$OUT/summary.txt; T0=$(date +%s)
say() { echo "== $* (t=$(($(date +%s) - T0)) s)" | tee -a $LOG; }
on() { case $STEPS in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $LOG
$B --version | tee -a $LOG
TOK=1,5,9,13,17,21,25,29
SHAPE8B="--arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000"

if on check; then
  say "kernels --check"
  timeout 200 $B kernels --check --json >$W/check.json 2>>$OUT/stderr.txt; echo "rc=$?" >>$LOG
  gzip -c $W/check.json >$OUT/check.json.gz
  $S check $W/check.json | tee -a $LOG
fi

say "synth"
for p in deepseek-v3-mini glm5-mini smollm2-135m; do $B synth --preset $p --seed 1 -o $M/$p.gguf >/dev/null; done
for p in deepseek-v3-mini llama-tiny; do $B synth --preset $p --quant Q4_K --seed 2 -o $M/$p-q4k.gguf >/dev/null; done
if on bench || on diff8b || on peers; then
  timeout 150 $B synth $SHAPE8B --quant Q4_K --seed 3 -o $M/8b.gguf >/dev/null
  $B inspect $M/8b.gguf --json >$W/8b_inspect.json
fi

if on healthy; then
  say "healthy diff-layers on cuda"
  for p in deepseek-v3-mini glm5-mini smollm2-135m; do
    tps="1 2 8"; [ $p = smollm2-135m ] && tps="1 3"
    for tp in $tps; do for d in 0 2; do
      timeout 60 $B diff-layers $M/$p.gguf --tokens $TOK --backend cuda --tp $tp --decode-steps $d --json >$W/h.json 2>>$OUT/stderr.txt
      echo "$p tp$tp decode$d rc=$? $($S verdict $W/h.json)" >>$OUT/healthy.txt
    done; done
  done
  $S healthy $OUT/healthy.txt | tee -a $LOG
fi

if on families; then
  say "GQA/MoE families on cuda"
  for f in qwen2 qwen3 qwen3moe glm4moe gemma2 gemma3; do for tp in 1 2; do for d in 0 2; do
    timeout 60 $B diff-layers golden/$f-tiny.f32.gguf --tokens $(seq -s, 1 20) --backend cuda --tp $tp --decode-steps $d --json \
      >$W/h.json 2>>$OUT/stderr.txt
    echo "$f tp$tp decode$d rc=$? $($S verdict $W/h.json)" >>$OUT/families.txt
  done; done; done
  for p in qwen3-mini qwen3moe-mini; do
    $B synth --preset $p --quant Q4_K --seed 2 -o $M/$p-q4k.gguf >/dev/null
    for tp in 1 2 4; do
      timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend cuda --tp $tp --decode-steps 2 --json >$W/h.json 2>>$OUT/stderr.txt
      echo "$p tp$tp decode2 rc=$? $($S verdict $W/h.json)" >>$OUT/families.txt
    done
  done
  $S healthy $OUT/families.txt | tee -a $LOG
  for m in qwen3-mini:2 qwen3moe-mini:2; do
    p=${m%%:*}; tp=${m##*:}
    for f in phantom-attn-out dequant-q4k-scale-min allreduce-skip rope-neox stale-attn-out config-drift kv-slot-off-by-one; do
      x=""; [ $f = kv-slot-off-by-one ] && x="--decode-steps 2"
      for be in cuda cpu; do
        timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend $be --tp $tp --inject $f $x --json >$W/f/$be.json 2>$W/f/$be.err
      done
      echo "$p tp$tp $f $($S same $W/f)" >>$OUT/families_faults.txt
    done
  done
  $S faults $OUT/families_faults.txt | tee -a $LOG
fi

bench() { # label binary model
  timeout 150 $2 bench $M/$3.gguf --backend cuda --n-prompt 512 --n-decode 48 --reps 2 --json 2>>$OUT/stderr.txt \
    | $S tag $1 $3 >>$OUT/bench.jsonl
}
if on bench; then
  BENCH_MODELS=${BENCH_MODELS:-8b 8b-q4km smollm2-135m}
  case " $BENCH_MODELS " in *" 8b-q4km "*)
    say "synth 8B Q4_K_M"
    timeout 150 $B synth $SHAPE8B --quant Q4_K_M --seed 3 -o $M/8b-q4km.gguf >/dev/null ;;
  esac
  say "model bench${OLD:+, new and old interleaved}"
  for r in $(seq ${ROUNDS:-$([ -n "${OLD:-}" ] && echo 2 || echo 1)}); do
    order="new"; [ -n "${OLD:-}" ] && { order="new old"; [ $((r % 2)) = 0 ] && order="old new"; }
    for who in $order; do
      bin=$B; [ $who = old ] && bin=$OLD
      for m in $BENCH_MODELS; do bench $who $bin $m; done
    done
  done
  $S bench $OUT/bench.jsonl | tee -a $LOG
fi

if on faults; then
  say "fault matrix, cuda against cpu"
  FAULTS=${FAULTS:-phantom-attn-out kv-b-unsharded kv-b-shard-swap k-b-untransposed dequant-q4k-scale-min f16-residual
    allreduce-skip rope-neox moe-gate-rounded stale-attn-out config-drift kv-slot-off-by-one}
  for m in ${FAULT_MODELS:-deepseek-v3-mini:2 llama-tiny:2 llama-tiny:1}; do
    p=${m%%:*}; tp=${m##*:}
    for f in $FAULTS; do
      x=""; [ $f = kv-slot-off-by-one ] && x="--decode-steps 2"
      for be in cuda cpu; do
        timeout 60 $B diff-layers $M/$p-q4k.gguf --tokens $TOK --backend $be --tp $tp --inject $f $x --json >$W/f/$be.json 2>$W/f/$be.err
      done
      echo "$p tp$tp $f $($S same $W/f)" >>$OUT/faults.txt
    done
  done
  $S faults $OUT/faults.txt | tee -a $LOG
fi

if on diff8b; then
  say "diff-layers on the 8B shape"
  t=$(date +%s%N)
  timeout 150 $B diff-layers $M/8b.gguf --tokens $TOK --backend cuda --decode-steps 2 --json >$W/d8.json 2>>$OUT/stderr.txt
  echo "rc=$? wall $((($(date +%s%N) - t) / 1000000)) ms $($S verdict $W/d8.json)" | tee -a $LOG
fi

if on kbench; then
  say "kernels --bench"
  timeout 200 $B kernels --bench --json >$OUT/kernels_bench.json 2>>$OUT/stderr.txt; echo "rc=$?" >>$LOG
  $S kbench $OUT/kernels_bench.json $W/8b_inspect.json | tee -a $LOG
fi

if on nccl && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  say "TP 2: real ranks (nccl) against simulated"
  for p in deepseek-v3-mini glm5-mini; do for r in nccl simulated; do
    timeout 60 $B diff-layers $M/$p.gguf --tokens $TOK --backend cuda --tp 2 --ranks $r --json >$W/h.json 2>>$OUT/stderr.txt
    echo "$p tp2 $r rc=$? $($S verdict $W/h.json)" | tee -a $LOG
  done; done
  for r in nccl simulated; do
    timeout 150 $B bench $M/8b.gguf --backend cuda --tp 2 --ranks $r --n-prompt 512 --n-decode 32 --reps 2 --json \
      2>>$OUT/stderr.txt | $S tag tp2-$r 8b >>$OUT/bench_tp2.jsonl
  done
  $S bench $OUT/bench_tp2.jsonl | tee -a $LOG
fi

if on peers; then
  if python3 -c "import torch, transformers" 2>/dev/null; then
    say "HF transformers eager bf16"
    timeout 240 python3 tests/peers/hf_gpu_bench.py --shape smollm2 --shape 8b --n-prompt 512 --n-decode 32 --reps 3 \
      >$OUT/hf.jsonl 2>>$OUT/stderr.txt
    $S hf $OUT/hf.jsonl | tee -a $LOG
  fi
  if [ -n "${LCPP_TAR:-}" ]; then
    say "llama.cpp: build (CUDA, sm_90)"
    L=$W/lcpp/llama.cpp; rm -rf $W/lcpp; mkdir -p $W/lcpp; tar xJf "$LCPP_TAR" -C $W/lcpp
    cmake -S $L -B $L/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_NATIVE=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >$W/cmake.txt 2>&1
    timeout $((540 - ($(date +%s) - T0) - 60)) cmake --build $L/build --target llama-bench -j"$(nproc)" >$W/build.txt 2>&1
    echo "build rc=$?" | tee -a $LOG
    [ -f $M/8b-q4km.gguf ] || timeout 150 $B synth $SHAPE8B --quant Q4_K_M --seed 3 -o $M/8b-q4km.gguf >/dev/null
    for m in 8b 8b-q4km smollm2-135m; do
      timeout 90 $L/build/bin/llama-bench -m $M/$m.gguf -ngl 99 -p 512 -n 32 -d 0,512 -fa 1 -r 3 -o json \
        >$OUT/lcpp_$m.json 2>>$OUT/stderr.txt
      $S lcpp $m $OUT/lcpp_$m.json | tee -a $LOG
    done
  fi
fi
say "done"
