#!/usr/bin/env bash
# Session 19 call 5. Carry ["dev/f31", "dev/call20e.sh"]. f31 = main + fwd17 bits / stagger at d 128 in opt-in entries, new wsp3s-nx.
# 1. quick verify with each opt-in d 128 variant forced; 2. d 128 sweep shapes: default / x / nx / stagger, two rounds.
set -uo pipefail
R=${OUT:-/tmp/call20e}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f31; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
for v in wsp3s-x wsp3s-nx wsp3s-stagger; do
  OUT=$R/verify-$v BIN=$N/sagebwd-gpu-check SAGEBWD_FORWARD_WGMMA=$v timeout 60 bash scripts/gpu/verify.sh --quick > "$R/verify-$v-stdout.txt" 2>&1; lap "quick verify $v" $?
done
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2; do
  for v in def wsp3s-x wsp3s-nx wsp3s-stagger; do
    env $( [ $v = def ] && echo TUNE=def || echo SAGEBWD_FORWARD_WGMMA=$v ) timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/$v-r$r.json > $R/log/$v-r$r.txt 2>&1 || echo "FAIL $v $r" >> $S
  done
done
lap "d128 variants, 2 rounds" 0
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
grep -HE "passed, .* failed|mismatch" "$R"/verify-*/log.txt | head -6 >> "$S"
cat "$S"
