#!/usr/bin/env bash
# Session 19 call 6 (final). Carry ["dev/f32", "dev/f30", "dev/call20f.sh"]. f32 = main (d 128 forward wsp3s-x default), f30 = d725bf4.
# 1. verify full default + lean + 4-SM quick; 2. A/B d 128 f32 vs f30 (sagebwd, one round each way); 3. the official sweep;
# 4. the README main command on the GPU (training default) as a smoke test of the teardown change.
set -uo pipefail
R=${OUT:-/tmp/call20f}; mkdir -p "$R/ab"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f32
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 30 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for who in f32 f30 f30 f32; do
  SAGEBWD_CACHE_DIR=$PWD/dev/$who/cache timeout 60 dev/$who/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/ab/$who-$SECONDS.json > /dev/null 2>&1 || echo "FAIL ab $who" >> $S
done
lap "A/B d128" 0
mkdir -p dev/bin && cp $N/sagebwd dev/bin/sagebwd && rm -rf dev/bench-cache && cp -r $N/cache dev/bench-cache && cp $N/BUILD.txt dev/bench-cache/
OUT=$R/sweep timeout 100 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "full sweep" $?
mkdir -p dev/train/bin && cp $N/sagebwd dev/train/bin/sagebwd && rm -rf dev/train/cache && cp -r $N/cache dev/train/cache && cp $N/BUILD.txt dev/train/BUILD.txt
OUT=$R/train timeout 100 bash scripts/gpu/train.sh default > "$R/train-stdout.txt" 2>&1; lap "default run (README main command) on the GPU" $?
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
{
  echo; grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6
  echo; grep -hE "^==|val loss|exit" "$R/train/summary.txt" | head -8
  echo; sed -n '/Summary: geometric/,$p' "$R/sweep/compare.md" | head -12
} >> "$S"
cat "$S"
