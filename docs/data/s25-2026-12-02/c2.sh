#!/usr/bin/env bash
# Session 25 call 2. Carry ["dev/m0"]. m0 = main 354f084's kernels. Profiles only (ncu): the d 64 backward main kernel
# (N 4k causal and full), the d 128 forward (N 16k full), and the Q/K/V quantization kernels at the sweep shape
# (d 64 N 1k: sage_k_mean_partial, sage_k_mean, sage_quantize_qkv; memory sections) to check the glue's bandwidth.
set -uo pipefail
R=${OUT:-/tmp/c2}; mkdir -p "$R/prof"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
pack() { tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/m0; C=$PWD/$N/cache
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SEC="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats --section InstructionStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
prof() {  # name regex count bench-args...
  local name=$1 rx=$2 cnt=$3; shift 3
  SAGEBWD_CACHE_DIR=$C timeout 60 $NCU --clock-control none $SEC -k "regex:$rx" --launch-count $cnt -f -o $R/prof/$name \
    $N/sagebwd bench --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 "$@" > $R/prof/$name.log 2>&1
  lap "ncu $name" $?
  $NCU -i $R/prof/$name.ncu-rep --page details --csv > $R/prof/$name-details.csv 2> $R/prof/$name-details.err
  $NCU -i $R/prof/$name.ncu-rep --page source --csv --print-source sass 2> $R/prof/$name-source.err | gzip > $R/prof/$name-source.csv.gz
  rm -f $R/prof/$name.ncu-rep
}
prof bwd64c4k 'sage_bwd_main' 1 --preset sagebwd -d 64 -n 4096 --causal on
prof bwd64n4k 'sage_bwd_main' 1 --preset sagebwd -d 64 -n 4096 --causal off
prof fwd128n16k 'sage_forward' 1 --preset sagebwd -d 128 -n 16384 --causal off
pack
# The glue: memory sections, every kernel of one forward's preparation.
SAGEBWD_CACHE_DIR=$C timeout 60 $NCU --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
  -k 'regex:sage_k_mean|sage_quantize|sage_transpose' --launch-count 4 -f -o $R/prof/glue64n1k \
  $N/sagebwd bench --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 --preset sagebwd -d 64 -n 1024 --causal on > $R/prof/glue64n1k.log 2>&1
lap "ncu glue d64 N1k" $?
$NCU -i $R/prof/glue64n1k.ncu-rep --page details --csv > $R/prof/glue64n1k-details.csv 2> $R/prof/glue64n1k-details.err
rm -f $R/prof/glue64n1k.ncu-rep
pack
cat "$S"
