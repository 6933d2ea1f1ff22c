#!/usr/bin/env bash
# Session 23 call 3: generic memory compression for the FP32 dQ accumulator (microbenchmark dev/comp/comp.cu).
set -uo pipefail
R=${OUT:-/tmp/c3}; mkdir -p "$R"
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvcc -O3 -arch=sm_90a dev/comp/comp.cu -lcuda -o $R/comp > $R/build.txt 2>&1; echo "build rc=$?" >> $R/summary.txt
cat $R/build.txt >> $R/summary.txt
timeout 60 $R/comp >> $R/summary.txt 2>&1; echo "run rc=$?" >> $R/summary.txt
rm -f $R/comp
cat $R/summary.txt
