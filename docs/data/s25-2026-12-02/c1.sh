#!/usr/bin/env bash
# Session 25 call 1. Carry ["dev/m0", "dev/z1", "dev/calls"]. m0 = main 354f084 (session 24's kernels, bfma24 included);
# z1 = m0 + tq25 (the d 128 sage backward's dQ staged in the dQ map's 128-byte swizzle and added by one TMA tensor reduce).
# Verify z1 (default, lean, 4 SMs); A/B z1 vs m0 sagebwd d 128 (3 rounds) and d 64 (1 round: register renames only);
# sweep z1; README command; training perf4096 perf1024 (z1); ncu of the d 64 causal forward and z1's d 128 backward.
set -uo pipefail
R=${OUT:-/tmp/c1}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
pack() { tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/z1; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify z1" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify z1" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify z1 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
pack
for r in 1 2 3; do
  for v in m0 z1; do
    for d in 128 64; do
      [ $d = 64 ] && [ $r != 1 ] && continue
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 40 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset sagebwd -d $d --json $R/json/s${d}_$v-r$r.json > $R/log/s${d}_$v-r$r.txt 2>&1 || echo "FAIL $v $d $r" >> $S
    done
  done
done
lap "A/B z1 vs m0 (d 128 x3, d 64 x1)" 0
python3 dev/calls/ab.py $R/json m0 z1 bwd_ms fwd_ms > $R/ab.txt; grep "==" $R/ab.txt >> $S
pack
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 150 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep z1" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
pack
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/readme timeout 60 bash scripts/gpu/train.sh default > "$R/readme-stdout.txt" 2>&1; lap "README main command on the GPU (z1)" $?
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/train timeout 150 bash scripts/gpu/train.sh perf4096 perf1024 > "$R/train-stdout.txt" 2>&1; lap "training perf4096 perf1024 z1" $?
tail -24 "$R/train-stdout.txt" >> "$S"
pack
mkdir -p $R/prof
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SEC="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats --section InstructionStats --section Occupancy --section LaunchStats"
prof() {  # name regex bench-args...
  local name=$1 rx=$2; shift 2
  SAGEBWD_CACHE_DIR=$C timeout 50 $NCU --clock-control none $SEC -k "regex:$rx" --launch-count 1 -f -o $R/prof/$name \
    $N/sagebwd bench --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 "$@" > $R/prof/$name.log 2>&1
  lap "ncu $name" $?
  $NCU -i $R/prof/$name.ncu-rep --page details --csv > $R/prof/$name-details.csv 2> $R/prof/$name-details.err
  $NCU -i $R/prof/$name.ncu-rep --page source --csv --print-source sass 2> $R/prof/$name-source.err | gzip > $R/prof/$name-source.csv.gz
  rm -f $R/prof/$name.ncu-rep
}
prof fwd64c4k 'sage_forward' --preset sagebwd -d 64 -n 4096 --causal on
prof fwd64c1k 'sage_forward' --preset sagebwd -d 64 -n 1024 --causal on
prof bwd128n4k 'sage_bwd_main' --preset sagebwd -d 128 -n 4096 --causal off
pack
cat "$S"
