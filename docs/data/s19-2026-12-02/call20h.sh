#!/usr/bin/env bash
# Session 19 call 8 (final). Carry ["dev/f34", "dev/call20h.sh"]. f34 = main (wsp3s-sx the d 64 default, wsp3s-x the d 128 one).
set -uo pipefail
R=${OUT:-/tmp/call20h}; mkdir -p "$R"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f34
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 30 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6 >> "$S"
mkdir -p dev/bin && cp $N/sagebwd dev/bin/sagebwd && rm -rf dev/bench-cache && cp -r $N/cache dev/bench-cache && cp $N/BUILD.txt dev/bench-cache/
OUT=$R/sweep timeout 60 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "full sweep" $?
sed -n '/Summary: geometric/,$p' "$R/sweep/compare.md" | head -8 >> "$S"
cat "$S"
