#!/usr/bin/env bash
# Session 23 call 5. Carry ["dev/m0", "dev/m3", "dev/calls"]. m0 = main 678e0a8; m3 = dqclaim23 (d 128 sagebwd backward:
# the FP32 dQ accumulator zeroed by claims in the main kernel, not by the preprocess). Verify m3 default (full), 4 SMs,
# SAGEBWD_DQ_CLAIM=0 (quick); A/B m3 vs m0 at d 128, 3 rounds; main's own full verify (m0) last.
set -uo pipefail
R=${OUT:-/tmp/c5}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/m3; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify m3" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify m3 4 SMs" $?
OUT=$R/off BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_DQ_CLAIM=0 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/off-stdout.txt" 2>&1; lap "verify m3 DQ_CLAIM=0" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,multi,off}/log.txt | head -8 >> "$S"
for r in 1 2 3; do
  for v in m0 m3; do
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
      --preset sagebwd -d 128 --json $R/json/d128_$v-r$r.json > $R/log/d128_$v-r$r.txt 2>&1 || echo "FAIL $v $r" >> $S
  done
done
lap "A/B m3 vs m0 d 128, 3 rounds" 0
python3 dev/calls/ab.py $R/json m0 m3 bwd_ms fwd_ms >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
OUT=$R/main BIN=dev/m0/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/m0/cache timeout 60 bash scripts/gpu/verify.sh > "$R/main-stdout.txt" 2>&1; lap "verify main (m0)" $?
grep -HE "passed, .* failed|mismatch" "$R"/main/log.txt | head -2 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
