#!/usr/bin/env bash
# Session 19 call 3. Carry ["dev/f29", "dev/f28", "dev/call20c.sh"]. f29 = 54f977c (Gpu drops the side stream first), f28 = d383323.
# 1. exit code of `bench --lean-memory` (f28 segfaulted at exit in call20b); 2. quick verify of f29;
# 3. the training shape (d 64 causal, H·D 768, N 1k-8k): every forward variant and both backward grids, two rounds;
# 4. lean vs default at non-causal N 8k/16k, two rounds alternated.
set -uo pipefail
R=${OUT:-/tmp/call20c}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
for who in f28 f29; do
  SAGEBWD_CACHE_DIR=$PWD/dev/$who/cache timeout 60 dev/$who/sagebwd bench --lean-memory -d 64 -n 1024 --causal off --reps 3 --warmup 1 > $R/log/exit-$who.txt 2>&1; lap "$who bench --lean-memory exit" $?
done
N=dev/f29; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check timeout 60 bash scripts/gpu/verify.sh --quick > "$R/verify-stdout.txt" 2>&1; lap "quick verify" $?
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
T="--head-dim 64 --n 1024,2048,4096,8192 --causal on --hidden 768"
run() { local name=$1; shift; env "$@" timeout 60 $N/sagebwd bench --preset sagebwd $B $T --json $R/json/$name.json > $R/log/$name.txt 2>&1 || echo "FAIL $name" >> $S; }
for r in 1 2; do
  run def-r$r TUNE=def
  for v in wsp3s wsp3s-nopp wsp3s-x wsp3s-stagger; do run f_$v-r$r SAGEBWD_FORWARD_WGMMA=$v; done
  for p in 0 1; do run bp$p-r$r SAGEBWD_BWD_PERSIST=$p; done
done
lap "training-shape tune" 0
for r in 1 2; do
  for l in "" --lean-memory; do
    timeout 60 $N/sagebwd bench --preset sagebwd $B -n 8192,16384 --causal off $l --json $R/json/lean${l:+1}-r$r.json > $R/log/lean${l:+1}-r$r.txt 2>&1 || echo "FAIL lean $l $r" >> $S
  done
done
lap "lean at long N" 0
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
grep -HE "passed, .* failed|mismatch" "$R"/verify/log.txt | head -3 >> "$S"
cat "$S"
