#!/usr/bin/env bash
# Session 26 call 1. Carry ["dev/m0"] (main's kernels: m0 = 354f084, whose kernels are main's). Profiles only (ncu,
# every kernel of one forward + backward, SASS instruction mix): cuDNN SDPA, FlashAttention-2 SDPA and ours (`sagebwd`
# and `fpa`) at d 64 N 4k, d 128 N 4k and d 128 N 16k, non-causal: instructions per score and issue rates side by side.
. scripts/dev/calllib.sh
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SEC="--section SpeedOfLight --section InstructionStats --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy --section SourceCounters"
export_rep() {  # name
  "$NCU" -i "$R/prof/$1.ncu-rep" --page details --csv > "$R/prof/$1-details.csv" 2> "$R/prof/$1-details.err"
  "$NCU" -i "$R/prof/$1.ncu-rep" --page source --csv --print-source sass 2> "$R/prof/$1-source.err" | gzip > "$R/prof/$1-source.csv.gz"
  rm -f "$R/prof/$1.ncu-rep"
}
sdpa() {  # backend d n
  local name=$1-d$2-n$3
  timeout 120 "$NCU" --clock-control none --profile-from-start off --target-processes all $SEC --launch-count 12 -f \
    -o "$R/prof/$name" python3 scripts/dev/sdpa_once.py "$1" "$2" "$3" > "$R/prof/$name.log" 2>&1
  lap "ncu $name" $?
  export_rep "$name"; pack
}
ours() {  # preset d n
  local name=$1-d$2-n$3
  SAGEBWD_CACHE_DIR=$PWD/dev/m0/cache timeout 120 "$NCU" --clock-control none $SEC -k "regex:sage_" --launch-count 14 -f \
    -o "$R/prof/$name" dev/m0/sagebwd bench --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 \
    --preset "$1" -d "$2" -n "$3" --causal off > "$R/prof/$name.log" 2>&1
  lap "ncu $name" $?
  export_rep "$name"; pack
}
for s in "64 4096" "128 4096" "128 16384"; do
  set -- $s
  sdpa cudnn "$1" "$2"
  ours sagebwd "$1" "$2"
done
sdpa flash 128 4096
ours fpa 128 4096
ours fpa 64 4096
sdpa flash 64 4096
finish
