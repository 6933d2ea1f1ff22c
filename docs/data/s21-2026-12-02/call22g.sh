#!/usr/bin/env bash
# Session 21 call 7 (final). Carry ["dev/bin/sagebwd", "dev/bench-cache", "dev/call22g.sh"] (bench.sh --prepare on main ad019e9,
# whose kernels = f44's, verified 182/182 default and lean in call22f). The official sweep with the clock table; training
# perf1024 and perf4096 (base model, both preset orders).
set -uo pipefail
R=${OUT:-/tmp/call22g}; mkdir -p "$R"
S=$R/summary.txt
OUT=$R/sweep timeout 300 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; echo "sweep rc=$?" > "$S"
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
grep -A2 "### SM clock" "$R/sweep/compare.md" | tail -1 | cut -c1-600 >> "$S"
TRAIN_BIN=dev/bin/sagebwd TRAIN_CACHE=$PWD/dev/bench-cache OUT=$R/train timeout 240 bash scripts/gpu/train.sh perf1024 perf4096 > "$R/train-stdout.txt" 2>&1; echo "train rc=$?" >> "$S"
grep -E "^==|tokens/s|plateau|MHz" "$R/train/summary.txt" | head -30 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
