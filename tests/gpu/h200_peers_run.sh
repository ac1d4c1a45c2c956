#!/usr/bin/env bash
# Peers on the GPU, in one device call: llmdiff's CUDA engine, HF transformers eager (bf16) and
# llama.cpp's CUDA backend (built there from source), on the same two llama shapes and the same
# GPU, so every ratio in the note comes from one run.
#
#   LLMDIFF=path/to/llmdiff LCPP_TAR=path/to/llama.cpp.tar.xz OUT=dir bash tests/gpu/h200_peers_run.sh
#
# - Models: `llmdiff synth` makes the smollm2-135m preset and the 8B shape of the evidence run
#   (tests/gpu/h200_evidence_run.sh, seed 3). llama.cpp reads the same files.
# - llmdiff: `bench --backend cuda`, 512-token prefill then 32 decode steps (the evidence run's).
# - HF: tests/peers/hf_gpu_bench.py, the same two shapes in bf16 with random weights, eager.
# - llama.cpp: the tarball of a llama.cpp tree (llama-cpp-python's vendored one, trimmed of docs,
#   models and other backends: tests/peers/llamacpp_src_tarball.sh), built with CUDA for sm_90 (flash attention kernels for f16 only,
#   the default KV type), then `llama-bench -p 512 -n 32` at KV depth 0 and 512, flash attention
#   off and on, every layer on the GPU.
# The llmdiff and HF benches run before the build, so the compiler does not share their CPU.
set -u
B=${LLMDIFF:?LLMDIFF=path to the llmdiff binary}
OUT=${OUT:?}
LCPP_TAR=${LCPP_TAR:-}
W=/tmp/peers; M=$W/models; mkdir -p $M
LOG=$OUT/log.txt
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a $LOG; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $LOG

say "synth"
$B synth --preset smollm2-135m --seed 1 -o $M/smollm2.gguf >/dev/null 2>>$LOG
timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 \
  --vocab 32000 --quant Q4_K --seed 3 -o $M/8b.gguf >/dev/null 2>>$LOG
ls -la $M | tee -a $LOG

say "llmdiff bench"
for s in smollm2 8b; do
  timeout 120 $B bench $M/$s.gguf --backend cuda --n-prompt 512 --n-decode 32 --reps 3 --json >$W/b.json 2>>$LOG
  say "llmdiff $s rc=$?"
  python3 -c "import json; d = json.load(open('$W/b.json')); d['shape'] = '$s'; print(json.dumps(d))" \
    >>$OUT/llmdiff.jsonl 2>>$LOG
done

say "HF transformers eager bf16"
timeout 200 python3 tests/peers/hf_gpu_bench.py --shape smollm2 --shape 8b --n-prompt 512 --n-decode 32 \
  --reps 3 >$OUT/hf.jsonl 2>$OUT/hf.err
say "hf rc=$?"

if [ -n "$LCPP_TAR" ]; then
  say "llama.cpp build"
  rm -rf $W/lcpp && mkdir -p $W/lcpp && tar xJf $LCPP_TAR -C $W/lcpp
  L=$W/lcpp/llama.cpp
  (cd $L && git log -1 --format=%H 2>/dev/null; grep -m1 -o 'LLAMA_BUILD_NUMBER [0-9]*' CMakeLists.txt) >>$LOG 2>&1
  cmake -S $L -B $L/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_QUANTS=f16-f16 \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    >$W/lcpp_cmake.txt 2>&1
  left=$((560 - ($(date +%s) - T0) - 60))
  say "cmake rc=$?; building with ${left} s left"
  timeout $left cmake --build $L/build --target llama-bench -j"$(nproc)" >$W/lcpp_build.txt 2>&1
  say "build rc=$?"
  grep -i "CUDA compiler identification\|llama.cpp version" $W/lcpp_cmake.txt >>$LOG
  tail -3 $W/lcpp_build.txt >>$LOG
  LB=$L/build/bin/llama-bench
  if [ -x $LB ]; then
    for s in 8b smollm2; do
      timeout 90 $LB -m $M/$s.gguf -ngl 99 -p 512 -n 32 -d 0,512 -fa 0,1 -r 3 -o json >$OUT/lcpp_$s.json \
        2>>$LOG
      say "llama-bench $s rc=$?"
    done
  fi
fi

python3 - $OUT <<'PY' | tee -a $LOG
import json, os, sys
o = sys.argv[1]
def load(p):
    try:
        return [json.loads(l) for l in open(os.path.join(o, p)) if l.strip()]
    except Exception as e:
        return []
for d in load("llmdiff.jsonl"):
    s = d["shape"]
    print(f"llmdiff {s}: decode {d['decode_s_per_token']*1e3:.3f} ms, prefill 512 (last logits) "
          f"{d['prefill_last_tok_s']:.0f} tok/s, (all logits) {d['prefill_s']*1e3:.1f} ms")
for d in load("hf.jsonl"):
    print(f"HF {d['shape']}: decode {d['decode_s_per_token']*1e3:.2f} ms, prefill 512 {d['prefill_s']*1e3:.1f} ms "
          f"({d['attn']}, torch {d['torch']}, transformers {d['transformers']})")
for s in ["8b", "smollm2"]:
    try:
        rows = json.load(open(os.path.join(o, f"lcpp_{s}.json")))
    except Exception:
        continue
    for r in rows:
        kind = "pp" if r["n_prompt"] else "tg"
        best = max(r.get("samples_ts") or [r["avg_ts"]])
        print(f"llama.cpp {s}: {kind}{r['n_prompt'] or r['n_gen']} depth {r.get('n_depth', 0)} fa {r.get('flash_attn')}: "
              f"mean {r['avg_ts']:.1f} tok/s ({1e3 / r['avg_ts']:.3f} ms a token), best {best:.1f} ({1e3 / best:.3f} ms)")
PY
say "done"
