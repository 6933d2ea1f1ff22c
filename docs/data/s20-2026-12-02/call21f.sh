#!/usr/bin/env bash
# Session 20 call 6 (last). Carry ["dev/f40", "dev/call21f.sh"]. f40 = main after call21e: f38's kernels (comments only
# changed) + a new verify case (d 64, GQA, N_q 320, non-causal) that runs the default d 64 plain-grid kernel.
set -uo pipefail
R=${OUT:-/tmp/call21f}; mkdir -p "$R"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f40; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean}/log.txt | head -4 >> "$S"
grep -E "H4/2 Nq=320" "$R"/verify/log.txt | head -6 >> "$S"
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$PWD/$N/cache OUT=$R/train timeout 150 bash scripts/gpu/train.sh default > "$R/train-stdout.txt" 2>&1; lap "README main command on the GPU" $?
grep -E "^==|validation|exit" "$R/train/summary.txt" | head -8 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
