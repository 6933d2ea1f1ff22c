#!/usr/bin/env bash
# Session 22 call 4 (final). Carry ["dev/f4", "dev/bin/sagebwd", "dev/bench-cache", "dev/calls"]. f4 = main 8ae8c96 (fpab22 +
# fwd22 + fwd22s at d 128), the same kernels as dev/bench-cache (bench.sh --prepare on 8ae8c96). Verify default and lean,
# 4 SMs; the README main command on the GPU; the official sweep with the clock table; training perf1024 and perf4096.
set -uo pipefail
R=${OUT:-/tmp/c4}; mkdir -p "$R"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f4; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6 >> "$S"
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/readme timeout 150 bash scripts/gpu/train.sh default > "$R/readme-stdout.txt" 2>&1; lap "README main command on the GPU" $?
OUT=$R/sweep timeout 300 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
TRAIN_BIN=dev/bin/sagebwd TRAIN_CACHE=$PWD/dev/bench-cache OUT=$R/train timeout 240 bash scripts/gpu/train.sh perf1024 perf4096 > "$R/train-stdout.txt" 2>&1; lap "train" $?
grep -E "^==|tokens/s|plateau|MHz" "$R/train/summary.txt" | head -30 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
