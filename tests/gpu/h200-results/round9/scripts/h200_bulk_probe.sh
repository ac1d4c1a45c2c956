#!/bin/bash
# Issue #8, round 9 probe (one device call): Nsight per-kernel times of 8B decode steps under
# LLMDIFF_GEMV_KIND=bulk (graphs off), the sequence of one step's GEMV launches, and the stall
# sections of a few bulk GEMV launches; kernels --bench JSON kept.
# Usage (GPU machine): LLMDIFF=/path/to/llmdiff OUT=/some/dir bash tests/gpu/h200_bulk_probe.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH}
B=${LLMDIFF:-$PWD/llmdiff}
D=$(cd $(dirname $0) && pwd)
W=/tmp/gpu; M=$W/models; mkdir -p $M
LOG=$OUT/log.txt
NCUB=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -f $M/llama8b.gguf ] || timeout 100 $B synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 --ffn-dim 14336 --vocab 32000 --quant Q4_K --seed 3 -o $M/llama8b.gguf >/dev/null 2>>$LOG
K=260
for cfg in ${NCU_ENVS:-bulk=LLMDIFF_GEMV_KIND=bulk}; do
  label=${cfg%%=*}; envs=X=1; [ "$label" != "$cfg" ] && envs=$(echo ${cfg#*=} | tr ',' ' ')
  echo "== ncu decode $label" >>$LOG
  env $envs LLMDIFF_CUDA_GRAPH=0 timeout 90 $NCUB --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip $((2 * K)) --launch-count $((2 * K)) $B bench $M/llama8b.gguf --backend cuda --n-prompt 1 --n-decode 4 --reps 1 >$W/ncu_$label.csv 2>$W/ncu.err
  python3 $D/ncu_summary.py $W/ncu_$label.csv per:rope_table 2>&1 | head -14 >>$LOG
  python3 - $W/ncu_$label.csv <<'PY' >>$LOG
import csv, sys, collections
r=[x for x in csv.reader(open(sys.argv[1])) if len(x)>10]; h=r[0]; k=h.index('Kernel Name'); v=h.index('Metric Value'); g=h.index('Grid Size'); b=h.index('Block Size')
seq=[(x[k].split('(')[0], x[g], x[b], float(x[v].replace(',',''))/1e3) for x in r[1:]]
gem=[s for s in seq if s[0].startswith('gemv')]
by=collections.defaultdict(list)
for i,s in enumerate(gem[:4*32]): by[i%4].append(s[3])
for i in range(4): print('gemv launch %d of a layer (%s grid %s block %s): mean %.2f us' % (i, gem[i][0], gem[i][1], gem[i][2], sum(by[i])/max(1,len(by[i]))))
print('first 12 kernels:', [(s[0], round(s[3],2)) for s in seq[:12]])
PY
done
echo "== ncu sections, bulk" >>$LOG
LLMDIFF_GEMV_KIND=bulk LLMDIFF_CUDA_GRAPH=0 timeout 150 $NCUB --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
  -k regex:"gemvb|gemvw" --launch-skip 400 --launch-count 8 --csv --page details $B bench $M/llama8b.gguf --backend cuda --n-prompt 1 --n-decode 4 --reps 1 >$W/ncu_sec.csv 2>$W/ncu.err
python3 - $W/ncu_sec.csv <<'PY' >>$LOG
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1]))); hdr=None; data=collections.OrderedDict()
for r in rows:
    if r and r[0]=='ID': hdr=r; continue
    if not hdr or len(r)!=len(hdr): continue
    d=dict(zip(hdr,r)); data.setdefault((d['ID'], d['Kernel Name'][:30], d.get('Grid Size','')), []).append((d['Metric Name'], d['Metric Unit'], d['Metric Value']))
want=['Duration','DRAM Throughput','Achieved Occupancy','Theoretical Occupancy','Registers Per Thread','Issue Slots Busy','No Eligible','Active Warps Per Scheduler','Eligible Warps Per Scheduler','Warp Cycles Per Issued Instruction','Block Limit Registers','Block Limit Shared Mem','Dynamic Shared Memory Per Block']
for k, ms in data.items(): print(k, '; '.join(f"{n}={v}{u}" for n,u,v in ms if n in want or 'Stall' in n))
PY
tail -3 $W/ncu.err >>$LOG
echo "== kernels --bench" >>$LOG
timeout 200 $B kernels --bench --json >$OUT/kernels_bench.json 2>>$LOG
python3 - $OUT/kernels_bench.json <<'PY' >>$LOG
import json, sys
d = json.load(open(sys.argv[1]))
def walk(o):
    if isinstance(o, dict):
        if 'variant' in o and o.get('variant') and 'gemvb' in str(o.get('variant')): print(o)
        for v in o.values(): walk(v)
    elif isinstance(o, list):
        for v in o: walk(v)
walk(d)
PY
echo "== done" >>$LOG
