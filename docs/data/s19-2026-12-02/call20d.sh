#!/usr/bin/env bash
# Session 19 call 4. Carry ["dev/f30", "dev/call20d.sh"]. f30 = d725bf4 (tune20 rules + Gpu drop fix + GroupPolicy::Auto).
# 1. verify full default + lean + 4-SM quick; 2. the official sweep with SDPA; 3. bench exit code with the side stream (auto groups).
set -uo pipefail
R=${OUT:-/tmp/call20d}; mkdir -p "$R"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f30
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 30 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
mkdir -p dev/bin && cp $N/sagebwd dev/bin/sagebwd && rm -rf dev/bench-cache && cp -r $N/cache dev/bench-cache && cp $N/BUILD.txt dev/bench-cache/
OUT=$R/sweep timeout 100 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "full sweep" $?
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
{
  echo; grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6
  echo; sed -n '/Peak device memory/,/^$/p' "$R/sweep/compare.md" | head -3
  echo; sed -n '/Summary: geometric/,$p' "$R/sweep/compare.md" | head -12
} >> "$S"
cat "$S"
