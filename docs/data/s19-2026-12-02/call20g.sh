#!/usr/bin/env bash
# Session 19 call 7. Carry ["dev/f33", "dev/call20g.sh"]. f33 = main + opt-in wsp3s-sx (stagger + fwd17's bits).
set -uo pipefail
R=${OUT:-/tmp/call20g}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f33; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
OUT=$R/verify-sx BIN=$N/sagebwd-gpu-check SAGEBWD_FORWARD_WGMMA=wsp3s-sx timeout 60 bash scripts/gpu/verify.sh --quick > "$R/verify-sx-stdout.txt" 2>&1; lap "quick verify sx" $?
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2; do
  for v in def wsp3s-sx; do
    E=$( [ $v = def ] && echo TUNE=def || echo SAGEBWD_FORWARD_WGMMA=$v )
    env $E timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 64 $B --json $R/json/d64-$v-r$r.json > $R/log/d64-$v-r$r.txt 2>&1 || echo "FAIL d64 $v $r" >> $S
    env $E timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/d128-$v-r$r.json > $R/log/d128-$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
    env $E timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 64 --n 1024,2048,4096,8192 --causal on --hidden 768 $B --json $R/json/train-$v-r$r.json > $R/log/train-$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "sx vs default, 2 rounds" 0
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
grep -HE "passed, .* failed|mismatch" "$R"/verify-sx/log.txt | head -2 >> "$S"
cat "$S"
