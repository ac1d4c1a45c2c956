#!/bin/bash
# `kernels --check` for the device scripts: runs it (170 s cap), keeps the JSON gzipped as
# $OUT/check.json.gz and appends check_summary.py's lines (the total, then each LABEL:SUBSTR
# class) to $LOG. Usage: B=binary W=scratch OUT=dir LOG=file bash kernel_check.sh [LABEL:SUBSTR ...]
D=$(cd $(dirname $0) && pwd)
timeout 170 $B kernels --check --json >$W/check.json 2>>$LOG; echo "rc=$?" >>$LOG
gzip -c $W/check.json >$OUT/check.json.gz
python3 $D/check_summary.py $W/check.json "$@" | tee -a $LOG
