export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=$PWD/.wtcuda/llmdiff
$B kernels --check > $OUT/kernels_check.txt 2>&1; echo rc=$? >> $OUT/log.txt
grep -E "FAIL|kernel checks pass|panic" $OUT/kernels_check.txt | head -30 >> $OUT/log.txt
$B kernels --bench --json > $OUT/kernels_bench.json 2>>$OUT/log.txt
python3 - "$OUT/kernels_bench.json" <<'PY' >> $OUT/log.txt
import json, sys
d = json.load(open(sys.argv[1]))
print("copy GB/s", round(d["copy_gb_per_s"]))
cases = {}
for r in d["bench"]:
    cases.setdefault(r["case"], []).append(r)
for c, rs in cases.items():
    dflt = [r for r in rs if r["variant"] is None]
    best = sorted((r for r in rs if r["variant"]), key=lambda r: r["seconds"])[:5]
    print(c, f"default {dflt[0]['seconds']*1e6:.2f} us {100*dflt[0]['fraction_of_copy']:.1f} %" if dflt else "", "; best " + ", ".join(f"{r['variant']} {r['seconds']*1e6:.2f} us {100*r['fraction_of_copy']:.1f} %" for r in best))
PY
