# Sourced by the round scripts (h200_round30_run.sh, h200_round31_run.sh): CUDA's libraries on the
# path; D (tests/gpu), B (the binary, $LLMDIFF), W and M (scratch and its models), LOG
# ($OUT/log.txt) and say (a timed heading, to the screen and LOG).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
D=$(cd $(dirname ${BASH_SOURCE[0]}) && pwd)
B=${LLMDIFF:?}
W=/tmp/gpu; M=$W/models; mkdir -p $M
T0=$(date +%s); LOG=$OUT/log.txt
say() { echo "== $* (t=$(( $(date +%s) - T0 ))s)" | tee -a $LOG; }
