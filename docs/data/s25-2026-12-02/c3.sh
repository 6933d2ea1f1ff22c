#!/usr/bin/env bash
# Session 25 call 3. Carry ["dev/m0"]. m0 = main's kernels (354f084; main since only adds a script and a test's line break).
# The official sweep (fpa, sagebwd, cuDNN, FlashAttention-2) and training perf4096 perf1024 on main itself (c1's ran on
# z1 = main + tq25, whose d 128 backward measured +0.64 %).
set -uo pipefail
R=${OUT:-/tmp/c3}; mkdir -p "$R"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
pack() { tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/m0; C=$PWD/$N/cache
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 150 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep m0" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
pack
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/train timeout 150 bash scripts/gpu/train.sh perf4096 perf1024 > "$R/train-stdout.txt" 2>&1; lap "training perf4096 perf1024 m0" $?
grep -E "^== |^  (fpa|sagebwd):" "$R/train-stdout.txt" | cut -c1-200 >> "$S"
pack
cat "$S"
