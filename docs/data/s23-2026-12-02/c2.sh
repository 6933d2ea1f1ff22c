#!/usr/bin/env bash
# Session 23 call 2. Carry ["dev/m0", "dev/p1", "dev/calls"]. m0 = main 678e0a8; p1 = pre23 (sage_bwd_pre_do: 4 resident
# blocks asked of ptxas at d 128, 128 registers instead of 167). Verify p1 default + lean, 4 SMs; A/B p1 vs m0 backward
# (d 64 / 128, 3 rounds alternated); the README main command; the official sweep on p1.
set -uo pipefail
R=${OUT:-/tmp/c2}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/p1; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6 >> "$S"
for r in 1 2 3; do
  for v in m0 p1; do
    for d in 128 64; do
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset sagebwd -d $d --json $R/json/d${d}_$v-r$r.json > $R/log/d${d}_$v-r$r.txt 2>&1 || echo "FAIL $v $d $r" >> $S
    done
  done
done
lap "A/B p1 vs m0, 3 rounds" 0
python3 dev/calls/ab.py $R/json m0 p1 bwd_ms quant_do_ms fwd_ms >> $S
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/readme timeout 150 bash scripts/gpu/train.sh default > "$R/readme-stdout.txt" 2>&1; lap "README main command on the GPU" $?
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 300 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
