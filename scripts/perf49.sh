#!/usr/bin/env bash
# Time to verdict (issue 49), in one call on a GPU machine, old and new binaries interleaved on
# the same card, figures written under $OUT:
#
#   LLMDIFF=new/llmdiff OLD=old/llmdiff OUT=/tmp/out bash scripts/perf49.sh
#   BENCH=target/release/deps/matmul-HASH ...     # + the reference matmul against the f64 peak
#
# Both binaries are `cargo build --release --features cuda` builds (see gpu-evidence.sh for
# carrying them). BENCH is the reference matmul bench built with
# `cargo bench -p references --bench matmul --no-run` (the path it prints); it runs with `NONE`
# (tables only) at MATMUL_THREADS (default: 1, 8, 16 and every logical CPU).
# Steps (STEPS, space-separated; default all):
#   ref      `logits --backend reference` on the 8B Q4_K shape, 58 tokens: wall, CPU, peak RSS
#   cold     `logits --backend cuda` on the 8B shape: fresh (empty kernel caches), then cached;
#            the modules each run compiled (its progress line) and the CUBINs cached after it
#   diff8b   `diff-layers --backend cuda` on the 8B shape, 58 tokens, kernels cached; wall, CPU,
#            peak RSS, the run document's stage timings (old, new, new, old)
#   stop     the same with --stop-at-first and --n-layers 4 (new only)
#   layers   --layers A..B on CUDA (new only): the 8B shape at TP 1 and 2 with rope-neox inside the
#            range (same tap and class as the whole run) and before it (agrees from the reference's
#            residual, named at the entry tap from the engine's), healthy deepseek-v3-mini at TP 2
#   matmul   the reference matmul bench (BENCH) against the f64 FMA peak, physical cores vs threads
#   glm5     a synthetic deepseek2 layer at GLM-5's width (hidden 6144, 64 heads, MLA, 256 experts
#            top-8, expert FFN 2048, one shared expert; Q4_K), diff-layers at 16 and 256 tokens:
#            time and bytes the reference read
# $OUT/summary.txt is the summary; $OUT/runs.tsv one line per timed run; the run documents too.
set -u
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
NEW=${LLMDIFF:-$PWD/target/release/llmdiff}
OLD=${OLD:-}
OUT=${OUT:?OUT=the folder to write to}
STEPS=" ${STEPS:-ref cold diff8b stop layers matmul glm5} "
W=/tmp/perf49; M=$W/models; mkdir -p $M "$OUT"
LOG=$OUT/summary.txt; RUNS=$OUT/runs.tsv; T0=$(date +%s)
say() { echo "== $* (t=$(($(date +%s) - T0)) s)" | tee -a $LOG; }
on() { case $STEPS in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $LOG
echo "cpus: $(nproc) logical; $(lscpu | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))' | tr -s ' ' | paste -sd';')" | tee -a $LOG
$NEW --version | tee -a $LOG
[ -n "$OLD" ] && $OLD --version | sed 's/^/old: /' | tee -a $LOG
SHAPE8B="--arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000"
TOK58=$(python3 -c "print(','.join(str(3 + (i * 7919) % 31000) for i in range(58)))")
printf 'label\tbinary\twall_s\tcpu_pct\tmax_rss_kb\trc\n' >$RUNS

# timed LABEL WHO BIN ARGS...: one run under /usr/bin/time, stdout to $W/LABEL-WHO.out.
timed() {
  local label=$1 who=$2 bin=$3; shift 3
  /usr/bin/time -f "%e %P %M" -o $W/time.txt timeout 300 $bin "$@" >$W/$label-$who.out 2>>$OUT/stderr.txt
  local rc=$?
  read -r wall cpu rss <$W/time.txt 2>/dev/null || { wall=-; cpu=-; rss=-; }
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' $label $who $wall $cpu $rss $rc | tee -a $RUNS >>$LOG
}
# stages FILE: the run document's verdict and stage timings, one line.
stages() {
  python3 - "$1" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no run document:", e); sys.exit()
t = d.get("timings_s", {})
keys = ["engine", "engine_load", "engine_capture", "engine_wait", "reference", "reference_capture", "reference_wait",
        "compare", "replay", "compare_wait", "total"]
s = " ".join(f"{k}={t[k]:.2f}" for k in keys if k in t)
gb = t.get("reference_weight_bytes", 0) / 1e9
f = d.get("first_divergence") or {}
cls = (d.get("diagnosis") or {}).get("class", "")
at = f" at {f.get('tap')} {cls}" if f else ""
print(f"{d['verdict']}{at} taps={len(d['taps'])} {s} ref_read={gb:.3f}GB ({gb / max(1, len(d['tokens'])):.4f} GB/token)")
EOF
}
bins() { echo new $NEW; [ -n "$OLD" ] && echo old $OLD; }

say "synth the 8B Q4_K shape"
[ -f $M/8b.gguf ] || timeout 200 $NEW synth $SHAPE8B --quant Q4_K --seed 3 -o $M/8b.gguf >/dev/null

if on ref; then
  say "reference alone, 58 tokens"
  bins | while read -r who bin; do timed ref8b $who $bin logits $M/8b.gguf --tokens $TOK58 --backend reference; done
fi

if on cold; then
  say "cold start: logits --backend cuda, fresh caches, then cached"
  bins | while read -r who bin; do
    rm -rf $W/kc-$who $W/jit-$who; mkdir -p $W/kc-$who $W/jit-$who
    for run in fresh cached; do
      n0=$(grep -c 'CUDA kernel modules' $OUT/stderr.txt 2>/dev/null); n0=${n0:-0}
      LLMDIFF_KERNEL_CACHE=$W/kc-$who CUDA_CACHE_PATH=$W/jit-$who \
        timed cold-$run $who $bin logits $M/8b.gguf --tokens 1,2,3,4,5,6,7,8 --backend cuda
      # The progress line of this run (the modules it compiled, on how many threads) and what the
      # cache holds after it (new: the modules of the model's types only, e.g. 11 for Q4_K + Q6_K).
      line=$(grep 'CUDA kernel modules' $OUT/stderr.txt 2>/dev/null | tail -n +$((n0 + 1)) | tail -1)
      echo "  $who $run: ${line:-nothing compiled}; $(ls $W/kc-$who | grep -c cubin) CUBINs cached" | tee -a $LOG
    done
  done
fi

if on diff8b; then
  say "diff-layers on the 8B shape, 58 tokens, kernels cached (warm-up run first)"
  order="new"; [ -n "$OLD" ] && order="old new new old"
  for who in new ${OLD:+old}; do
    bin=$NEW; [ $who = old ] && bin=$OLD
    timeout 300 $bin logits $M/8b.gguf --tokens 1,2 --backend cuda >/dev/null 2>&1
  done
  i=0
  for who in $order; do
    i=$((i + 1)); bin=$NEW; [ $who = old ] && bin=$OLD
    timed diff8b-$i $who $bin diff-layers $M/8b.gguf --tokens $TOK58 --backend cuda --json-out $W/d8-$who-$i.json
    echo "  diff8b-$i $who: $(stages $W/d8-$who-$i.json)" | tee -a $LOG
    gzip -c $W/d8-$who-$i.json >$OUT/d8-$who-$i.json.gz 2>/dev/null
  done
fi

if on stop; then
  say "a verdict without the whole model (new)"
  timed diff8b-nl4 new $NEW diff-layers $M/8b.gguf --tokens $TOK58 --backend cuda --n-layers 4 --json-out $W/nl4.json
  echo "  --n-layers 4: $(stages $W/nl4.json)" | tee -a $LOG
  timed diff8b-stop new $NEW diff-layers $M/8b.gguf --tokens $TOK58 --backend cuda --inject rope-neox@3 --stop-at-first --json-out $W/stop.json
  echo "  rope-neox@3 --stop-at-first: $(stages $W/stop.json)" | tee -a $LOG
  timed diff8b-nostop new $NEW diff-layers $M/8b.gguf --tokens $TOK58 --backend cuda --inject rope-neox@3 --json-out $W/nostop.json
  echo "  rope-neox@3 whole model: $(stages $W/nostop.json)" | tee -a $LOG
fi

if on layers; then
  say "layer ranges on CUDA (new)"
  [ -f $M/dsv3.gguf ] || $NEW synth --preset deepseek-v3-mini --quant Q4_K -o $M/dsv3.gguf >/dev/null 2>&1
  for tp in 1 2; do
    for c in "8..16 reference rope-neox@10" "8..16 reference rope-neox@4" "8..16 engine rope-neox@4" "24..32 reference -"; do
      set -- $c; inj=""; [ "$3" != - ] && inj="--inject $3"
      timed layers-$1-$2-$3-tp$tp new $NEW diff-layers $M/8b.gguf --tokens $TOK58 --backend cuda --tp $tp \
        --layers $1 --residual-from $2 $inj --json-out $W/lr.json
      echo "  --layers $1 --residual-from $2 $3 tp$tp: $(stages $W/lr.json)" | tee -a $LOG
    done
  done
  timed layers-dsv3 new $NEW diff-layers $M/dsv3.gguf --tokens 1,2,3,4,5,6,7,8,9,10 --backend cuda --tp 2 --layers 1..3 \
    --json-out $W/lr.json
  echo "  deepseek-v3-mini --layers 1..3 tp2: $(stages $W/lr.json)" | tee -a $LOG
fi

if on matmul && [ -n "${BENCH:-}" ]; then
  say "reference matmul against the f64 FMA peak"
  MATMUL_THREADS=${MATMUL_THREADS:-1,8,16,$(nproc)} timeout 300 $BENCH NONE 2>>$OUT/stderr.txt | grep -v '^$' | tee -a $LOG
fi

if on glm5; then
  # The glm5-1layer preset (glm-dsa: q_lora 2048 and the DSA indexer). The round of issue 49
  # measured a deepseek2 layer (glm5-mini widened: q_lora 256, no indexer); the engine side
  # needs glm-dsa support for this step.
  say "glm5-1layer (synthetic glm-dsa layer at GLM-5's width)"
  [ -f $M/glm5-1layer.gguf ] || timeout 400 $NEW synth --preset glm5-1layer \
    --quant Q4_K --seed 5 -o $M/glm5-1layer.gguf >$W/glm5-synth.txt 2>&1
  echo "  synth rc=$? $(ls -la $M/glm5-1layer.gguf 2>/dev/null | awk '{print $5}') bytes" | tee -a $LOG
  for n in 16 256; do
    tok=$(python3 -c "print(','.join(str(3 + (i * 7919) % 31000) for i in range($n)))")
    timed glm5-$n new $NEW diff-layers $M/glm5-1layer.gguf --tokens $tok --backend cuda --json-out $W/glm5-$n.json
    echo "  glm5-1layer $n tokens: $(stages $W/glm5-$n.json)" | tee -a $LOG
    timed glm5-ref-$n new $NEW logits $M/glm5-1layer.gguf --tokens $tok --backend reference
  done
fi
column -t $RUNS >>$LOG 2>/dev/null
say "done"
