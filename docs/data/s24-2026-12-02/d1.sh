#!/usr/bin/env bash
# Session 24 call 1. Carry ["dev/m0", "dev/z1", "dev/calls"]. m0 = main's kernels (678e0a8); z1 = lazy24 (the forward's
# running max moves only past a slack of 8: the O rescale skipped on almost every block). Verify z1 default (full), lean
# (full), 4 SMs (quick); A/B z1 vs m0, sagebwd and fpa at d 64 / 128, 3 rounds alternated; README command; sweep on z1.
set -uo pipefail
R=${OUT:-/tmp/d1}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/z1; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify z1" $?
grep -HE "passed, .* failed|mismatch|ex2" "$R"/verify/log.txt | head -4 >> "$S"
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify z1" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify z1 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{lean,multi}/log.txt | head -4 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
for r in 1 2 3; do
  for v in m0 z1; do
    for pd in sagebwd:128 sagebwd:64 fpa:128 fpa:64; do
      p=${pd%:*}; d=${pd#*:}; tag=${p:0:1}$d
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset $p -d $d --json $R/json/${tag}_$v-r$r.json > $R/log/${tag}_$v-r$r.txt 2>&1 || echo "FAIL $v $tag $r" >> $S
    done
  done
done
lap "A/B z1 vs m0, 3 rounds" 0
python3 dev/calls/ab.py $R/json m0 z1 fwd_ms bwd_ms > $R/ab.txt; grep "==" $R/ab.txt >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/readme timeout 150 bash scripts/gpu/train.sh default > "$R/readme-stdout.txt" 2>&1; lap "README main command on the GPU" $?
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 300 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep z1" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
