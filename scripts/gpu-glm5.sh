#!/usr/bin/env bash
# The GLM-5 (glm-dsa) figures of docs/perf.md, in one call on a GPU machine, written under $OUT:
#
#   LLMDIFF=/path/llmdiff OUT=/tmp/out bash scripts/gpu-glm5.sh
#
# The binary is a `cargo build --release --features cuda` made anywhere; the models are
# synthesized here (`llmdiff synth --preset glm5-mini` / `glm5-1layer`). Steps (STEPS, default all):
#   check    `kernels --check`: every kernel, the DSA ones among them, against the CPU engine
#   healthy  glm5-mini on cuda (simulated ranks) at TP 1, 2, 4, 8, f32 and bf16, prefill and 2
#            decode steps, 24 tokens (the indexer's top_k is 16, so selection matters); an fp8
#            indexer at TP 8; the tiny glm-dsa / deepseek32 fixtures at TP 1, 2, 4
#   faults   the fault catalog on glm5-mini at TP 8, cuda against cpu: the same verdict, tap, class
#   bench    `bench` on glm5-mini at TP 1 and 8: decode and prefill-512
#   diff     `diff-layers --tp 8` on glm5-mini, timed, at 24 and 256 tokens
#   one      glm5-1layer (GLM-5's full width, one MoE layer): the reference and the engine alone
#            (time, peak RSS) and diff-layers, at 16 and 256 tokens
# $OUT/summary.txt is the summary (scripts/gpu_summary.py); $OUT/runs.tsv one line per timed run.
set -u
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=${LLMDIFF:-$PWD/target/release/llmdiff}
OUT=${OUT:?OUT=the folder to write to}
STEPS=" ${STEPS:-check healthy faults bench diff one} "
S="python3 scripts/gpu_summary.py"
W=/tmp/gpu-glm5; M=$W/models; mkdir -p $M $W/f "$OUT"
LOG=$OUT/summary.txt; RUNS=$OUT/runs.tsv; T0=$(date +%s)
say() { echo "== $* (t=$(($(date +%s) - T0)) s)" | tee -a $LOG; }
on() { case $STEPS in *" $1 "*) return 0 ;; esac; return 1; }
toks() { python3 -c "print(','.join(str(3 + (i * 97 + i * i * 31) % ($2 - 3)) for i in range($1)))"; }
timed() { # label, then the command
  local label=$1; shift
  /usr/bin/time -f "%e %P %M" -o $W/time.txt timeout 300 "$@" >$W/$label.out 2>>$OUT/stderr.txt
  local rc=$?
  read -r wall cpu rss <$W/time.txt 2>/dev/null || { wall=-; cpu=-; rss=-; }
  printf '%s\t%s\t%s\t%s\t%s\n' $label $wall $cpu $rss $rc | tee -a $RUNS >>$LOG
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $LOG
echo "cpus: $(nproc)" | tee -a $LOG
$B --version | tee -a $LOG
printf 'label\twall_s\tcpu_pct\tmax_rss_kb\trc\n' >$RUNS
$B synth --preset glm5-mini --seed 1 -o $M/glm5-mini.gguf >/dev/null
T24=$(toks 24 512)

if on check; then
  say "kernels --check"
  timeout 240 $B kernels --check --json >$W/check.json 2>>$OUT/stderr.txt; echo "rc=$?" >>$LOG
  $S check $W/check.json | tee -a $LOG
fi

if on healthy; then
  say "healthy glm5-mini on cuda"
  for tp in 1 2 4 8; do for dt in f32 bf16; do for d in 0 2; do
    timeout 90 $B diff-layers $M/glm5-mini.gguf --tokens $T24 --backend cuda --tp $tp --compute-dtype $dt \
      --decode-steps $d --json >$W/h.json 2>>$OUT/stderr.txt
    echo "glm5-mini tp$tp $dt decode$d rc=$? $($S verdict $W/h.json)" >>$OUT/healthy.txt
  done; done; done
  timeout 90 $B diff-layers $M/glm5-mini.gguf --tokens $T24 --backend cuda --tp 8 --indexer-fp8 --decode-steps 2 \
    --json >$W/h.json 2>>$OUT/stderr.txt
  echo "glm5-mini tp8 fp8-indexer decode2 rc=$? $($S verdict $W/h.json)" >>$OUT/healthy.txt
  for f in glm-dsa deepseek32; do for tp in 1 2 4; do
    timeout 60 $B diff-layers golden/$f-tiny.f32.gguf --tokens $(seq -s, 1 20) --backend cuda --tp $tp --decode-steps 2 \
      --json >$W/h.json 2>>$OUT/stderr.txt
    echo "$f-tiny tp$tp decode2 rc=$? $($S verdict $W/h.json)" >>$OUT/healthy.txt
  done; done
  $S healthy $OUT/healthy.txt | tee -a $LOG
fi

if on faults; then
  say "fault matrix on glm5-mini TP 8, cuda against cpu"
  FAULTS=${FAULTS:-$($B diff-layers --help | sed -n 's/^ *\([a-z0-9-]*\)  .*/\1/p' | grep -E '^[a-z0-9]+(-[a-z0-9]+)+$' | sort -u)}
  for f in $FAULTS; do
    for spec in "$f@1" "$f@1:3"; do
      x=""; case $f in kv-slot-off-by-one | indexer-stale-cache) x="--decode-steps 2" ;; esac
      for be in cuda cpu; do
        timeout 90 $B diff-layers $M/glm5-mini.gguf --tokens $T24 --backend $be --tp 8 --inject $spec $x --json \
          >$W/f/$be.json 2>$W/f/$be.err
      done
      echo "glm5-mini tp8 $spec $($S same $W/f)" >>$OUT/faults.txt
    done
  done
  $S faults $OUT/faults.txt | tee -a $LOG
fi

if on bench; then
  say "bench glm5-mini"
  for tp in 1 8; do
    timeout 200 $B bench $M/glm5-mini.gguf --backend cuda --tp $tp --n-prompt 512 --n-decode 48 --reps 2 --json \
      2>>$OUT/stderr.txt | $S tag tp$tp glm5-mini >>$OUT/bench.jsonl
  done
  $S bench $OUT/bench.jsonl | tee -a $LOG
fi

if on diff; then
  say "diff-layers --tp 8 on glm5-mini, timed"
  for n in 24 256; do
    timed diff-tp8-$n $B diff-layers $M/glm5-mini.gguf --tokens $(toks $n 512) --backend cuda --tp 8 --json-out $W/d$n.json
    echo "  $n tokens: $($S verdict $W/d$n.json)" | tee -a $LOG
  done
fi

if on one; then
  say "glm5-1layer"
  timed synth-1layer $B synth --preset glm5-1layer --seed 5 -o $M/glm5-1layer.gguf
  ls -la $M/glm5-1layer.gguf | awk '{print "  bytes " $5}' | tee -a $LOG
  for n in 16 256; do
    t=$(toks $n 32000)
    timed ref-1layer-$n $B logits $M/glm5-1layer.gguf --tokens $t --backend reference
    timed eng-1layer-$n $B logits $M/glm5-1layer.gguf --tokens $t --backend cuda
    timed diff-1layer-$n $B diff-layers $M/glm5-1layer.gguf --tokens $t --backend cuda --json-out $W/one$n.json
    echo "  $n tokens: $($S verdict $W/one$n.json)" | tee -a $LOG
  done
fi
column -t $RUNS 2>/dev/null | tee -a $LOG
say "done"
