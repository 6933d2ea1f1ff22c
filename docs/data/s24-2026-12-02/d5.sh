#!/usr/bin/env bash
# Session 24 call 5. Carry ["dev/z3a", "dev/z5", "dev/calls"]. z3a = main (lazy24 + pamax24 + scales24, verified in call 3);
# z5 = z3a + amax24 (the d 128 loop's tile amax block step by shared atomics). Verify z5 default, lean, 4 SMs; A/B z5 vs z3a, sagebwd
# d 128, 3 rounds.
set -uo pipefail
R=${OUT:-/tmp/d4}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/z5; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify z5" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify z5" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify z5 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
for r in 1 2 3; do
  for v in z3a z5; do
    for d in 128; do
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset sagebwd -d $d --json $R/json/s${d}_$v-r$r.json > $R/log/s${d}_$v-r$r.txt 2>&1 || echo "FAIL $v $d $r" >> $S
    done
  done
done
lap "A/B z5 vs z3a, 3 rounds" 0
python3 dev/calls/ab.py $R/json z3a z5 bwd_ms fwd_ms > $R/ab.txt; grep "==" $R/ab.txt >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/readme timeout 100 bash scripts/gpu/train.sh default > "$R/readme-stdout.txt" 2>&1; lap "README main command on the GPU (z5)" $?
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 200 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep z5" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
mkdir -p $R/prof
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SEC="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats --section InstructionStats"
SAGEBWD_CACHE_DIR=$C timeout 150 $NCU --clock-control none $SEC -k 'regex:sage_bwd_main' --launch-count 1 -f -o $R/prof/bwd128n4k \
  $N/sagebwd bench --preset sagebwd -d 128 -n 4096 --causal off --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 > $R/prof/bwd128n4k.log 2>&1
lap "ncu bwd d128 N4k" $?
$NCU -i $R/prof/bwd128n4k.ncu-rep --page details --csv > $R/prof/bwd128n4k-details.csv 2> $R/prof/bwd128n4k-details.err
$NCU -i $R/prof/bwd128n4k.ncu-rep --page source --csv --print-source sass 2> $R/prof/bwd128n4k-source.err | gzip > $R/prof/bwd128n4k-source.csv.gz
rm -f $R/prof/bwd128n4k.ncu-rep
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
