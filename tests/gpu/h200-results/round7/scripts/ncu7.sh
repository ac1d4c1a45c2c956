export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=$PWD/.wtcuda/llmdiff
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu=$NCU" > $OUT/log.txt
timeout 420 $NCU --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio -k regex:"gemvw_q4_k_r8_w4_u1_m2|gemv_q8_0_r4_u1_m0|gemv_q4_k_r4_u1_m2|gemv_x_limbs|gemvw_q4_k_r8_w4_u1_m0|gemv_f16_r2_u4_m0" \
  --launch-count 24 --csv --page details $B kernels --bench > /tmp/ncu.csv 2>$OUT/ncu.err
echo "rc=$?" >> $OUT/log.txt
tail -3 $OUT/ncu.err >> $OUT/log.txt
gzip -c /tmp/ncu.csv > $OUT/ncu.csv.gz
python3 - <<'PY' >> $OUT/log.txt
import csv, collections
rows = list(csv.reader(open('/tmp/ncu.csv')))
hdr = None
data = collections.OrderedDict()
for r in rows:
    if r and r[0] == 'ID': hdr = r; continue
    if not hdr or len(r) != len(hdr): continue
    d = dict(zip(hdr, r))
    key = (d['ID'], d['Kernel Name'][:40])
    data.setdefault(key, []).append((d['Section Name'], d['Metric Name'], d['Metric Unit'], d['Metric Value']))
want = ['Duration','DRAM Throughput','Memory Throughput','Achieved Occupancy','Theoretical Occupancy','Registers Per Thread','Issue Slots Busy','Issued Warp Per Scheduler','No Eligible','Active Warps Per Scheduler','Eligible Warps Per Scheduler','Warp Cycles Per Issued Instruction','Grid Size','Block Size','Waves Per SM','L1/TEX Hit Rate','L2 Hit Rate','Mem Busy','Max Bandwidth','Block Limit Registers']
for k, ms in data.items():
    print(k, '; '.join(f"{n}={v}{u}" for s,n,u,v in ms if n in want or 'stalled' in n))
PY
