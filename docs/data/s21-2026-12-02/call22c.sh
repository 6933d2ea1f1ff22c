#!/usr/bin/env bash
# Session 21 call 3. Carry ["dev/bin/sagebwd", "dev/bench-cache", "dev/call22c.sh"] (bench.sh --prepare on 252cb83).
# The official sweep (cuDNN, FA2, fpa, sagebwd) with the new per-point SM clock / board power table.
set -uo pipefail
R=${OUT:-/tmp/call22c}; mkdir -p "$R"
OUT=$R/sweep timeout 560 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; echo "sweep rc=$?" > "$R/summary.txt"
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$R/summary.txt"
grep -B2 -A26 "### SM clock" "$R/sweep/compare.md" >> "$R/summary.txt"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$R/summary.txt"
