#!/usr/bin/env bash
# Session 19 call 1 (tune20). Carry ["dev/f27", "dev/tune20.sh"]. f27 = main 76c7397.
# Every host-selectable kernel variant at every sweep shape (B·N 16384, H·D 2048, d 64/128, N 1k-16k, both masks),
# two rounds in the same order: the data for the host rules (forward kernel per shape, persistent backward grid).
set -uo pipefail
R=${OUT:-/tmp/tune20}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
N=dev/f27; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
S=$R/summary.txt; t0=$SECONDS
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
run() { # name preset d VAR=value
  local name=$1 preset=$2 d=$3; shift 3
  env "$@" timeout 60 $N/sagebwd bench --preset $preset --head-dim $d $B --json $R/json/$name.json > $R/log/$name.txt 2>&1 || echo "FAIL $name" >> $S
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> $S
for r in 1 2; do
  for d in 64 128; do
    run sage-def-d$d-r$r sagebwd $d TUNE=def
    for v in wsp3s wsp3s-nopp wsp3s-x wsp3s-stagger; do run sage-f_$v-d$d-r$r sagebwd $d SAGEBWD_FORWARD_WGMMA=$v; done
    for p in 0 1; do run sage-bp$p-d$d-r$r sagebwd $d SAGEBWD_BWD_PERSIST=$p; done
    run fpa-def-d$d-r$r fpa $d TUNE=def
    for v in fpp3s fpp3g fws3; do run fpa-f_$v-d$d-r$r fpa $d SAGEBWD_FORWARD_WGMMA=$v; done
    for p in 0 1; do run fpa-bp$p-d$d-r$r fpa $d SAGEBWD_BWD_PERSIST=$p; done
    echo "round $r d $d ($((SECONDS-t0)) s)" >> $S
  done
done
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> $S
tar czf "$R/all.tgz" -C "$R" json log
cat $S
