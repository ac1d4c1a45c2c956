export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=$PWD/.wtcuda/llmdiff
L=$OUT/log.txt
$B kernels --check > /tmp/kc.txt 2>&1; echo rc=$? >> $L
grep -E "FAIL|kernel checks pass|panic" /tmp/kc.txt | head -30 >> $L
$B kernels --bench --json > $OUT/kernels_bench.json 2>>$L
python3 - "$OUT/kernels_bench.json" <<'PY' >> $L
import json, sys
d = json.load(open(sys.argv[1]))
print("copy GB/s", round(d["copy_gb_per_s"]))
cases = {}
for r in d["bench"]:
    cases.setdefault(r["case"], []).append(r)
for c, rs in cases.items():
    dflt = [r for r in rs if r["variant"] is None]
    best = sorted((r for r in rs if r["variant"]), key=lambda r: r["seconds"])[:6]
    print(c, f"default {dflt[0]['seconds']*1e6:.2f} us {100*dflt[0]['fraction_of_copy']:.1f} %" if dflt else "", "; best " + ", ".join(f"{r['variant']} {r['seconds']*1e6:.2f} us {100*r['fraction_of_copy']:.1f} %" for r in best))
PY
M=/tmp/m; mkdir -p $M
$B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$L
for v in "" gemvw_q4_k_r2_w4_u1_m2d gemvw_q4_k_r4_w4_u1_m2d gemvw_q4_k_r8_w4_u1_m2d gemvw_q4_k_r4_w2_u1_m2d; do
  LLMDIFF_GEMV_VARIANT=$v timeout 60 $B bench $M/llama8b.gguf --backend cuda --n-prompt 64 --n-decode 32 --reps 2 --json 2>/dev/null | python3 -c "
import json,sys; d=json.load(sys.stdin); print('8B decode', '$v' or 'default', round(d['decode_s_per_token']*1e3,3), 'ms')" >> $L
done
NCU=/usr/local/cuda/bin/ncu
LLMDIFF_CUDA_GRAPH=0 timeout 200 $NCU --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats -k regex:"gemvw_q4_k|gemv_x_limbs" --launch-skip 300 --launch-count 12 --csv --page details $B bench $M/llama8b.gguf --backend cuda --n-prompt 1 --n-decode 3 --reps 1 > /tmp/ncu.csv 2>>$L
grep '^"' /tmp/ncu.csv | gzip > $OUT/ncu.csv.gz
