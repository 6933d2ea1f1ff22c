#!/usr/bin/env bash
# Session 24 call 3. Carry ["dev/z2", "dev/z3a", "dev/calls"]. z2 = lazy24 + pamax24 (verified in call 2); z3a = z2 + scales24
# (the d 128 sage backward loop with bwd16's branch-free group scales). Verify z3a default, lean, 4 SMs; A/B z3a vs z2,
# sagebwd d 128 (and d 64: identical SASS, a control), 3 rounds; sweep on z3a; training perf4096, perf1024 on z3a.
set -uo pipefail
R=${OUT:-/tmp/d3}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/z3a; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify z3a" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify z3a" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify z3a 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
for r in 1 2 3; do
  for v in z2 z3a; do
    for d in 128 64; do
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset sagebwd -d $d --json $R/json/s${d}_$v-r$r.json > $R/log/s${d}_$v-r$r.txt 2>&1 || echo "FAIL $v $d $r" >> $S
    done
  done
done
lap "A/B z3a vs z2, 3 rounds" 0
python3 dev/calls/ab.py $R/json z2 z3a bwd_ms fwd_ms > $R/ab.txt; grep "==" $R/ab.txt >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 200 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep z3a" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/train timeout 240 bash scripts/gpu/train.sh perf4096 perf1024 > "$R/train-stdout.txt" 2>&1; lap "training perf4096 perf1024 z3a" $?
tail -30 "$R/train-stdout.txt" >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
