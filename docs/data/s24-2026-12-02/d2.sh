#!/usr/bin/env bash
# Session 24 call 2. Carry ["dev/m0", "dev/z2", "dev/calls"]. m0 = main's kernels (678e0a8); z2 = lazy24 (INT8 #1 only; the
# BF16 forward's SASS = main's) + pamax24 (the backward's P amax by VIMNMX3). Verify z2 default, lean, 4 SMs; A/B z2 vs m0:
# sagebwd d 64 / 128 (fwd: lazy24, bwd: pamax24), fpa d 64 (control: forward SASS identical), 3 rounds; sweep on z2.
set -uo pipefail
R=${OUT:-/tmp/d2}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/z2; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify z2" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify z2" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify z2 4 SMs" $?
grep -HE "passed, .* failed|mismatch|ex2" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
for r in 1 2 3; do
  for v in m0 z2; do
    for pd in sagebwd:128 sagebwd:64 fpa:64; do
      p=${pd%:*}; d=${pd#*:}; tag=${p:0:1}$d
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset $p -d $d --json $R/json/${tag}_$v-r$r.json > $R/log/${tag}_$v-r$r.txt 2>&1 || echo "FAIL $v $tag $r" >> $S
    done
  done
done
lap "A/B z2 vs m0, 3 rounds" 0
python3 dev/calls/ab.py $R/json m0 z2 fwd_ms bwd_ms > $R/ab.txt; grep "==" $R/ab.txt >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 300 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep z2" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/readme timeout 150 bash scripts/gpu/train.sh default > "$R/readme-stdout.txt" 2>&1; lap "README main command on the GPU" $?
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
