#!/usr/bin/env bash
# Session 24 call 6. Carry ["dev/z5", "dev/z6", "dev/calls"]. z5 = main (lazy24 + pamax24 + scales24 + amax24, verified in call 5);
# z6 = z5 + bfma24 (the backward's INT8 #3 P = exp2(fma(a, sc, -L))). Verify z6 default, lean, 4 SMs; A/B z6 vs z5, sagebwd
# d 128 and d 64, 3 rounds.
set -uo pipefail
R=${OUT:-/tmp/d6}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/z6; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify z6" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify z6" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify z6 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
for r in 1 2 3; do
  for v in z5 z6; do
    for d in 128 64; do
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset sagebwd -d $d --json $R/json/s${d}_$v-r$r.json > $R/log/s${d}_$v-r$r.txt 2>&1 || echo "FAIL $v $d $r" >> $S
    done
  done
done
lap "A/B z6 vs z5, 3 rounds" 0
python3 dev/calls/ab.py $R/json z5 z6 bwd_ms fwd_ms > $R/ab.txt; grep "==" $R/ab.txt >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
