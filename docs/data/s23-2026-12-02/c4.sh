#!/usr/bin/env bash
# Session 23 call 4. Carry ["dev/m0", "dev/m2", "dev/calls"]. m0 = main 678e0a8; m2 = kmean23b (K-sum blocks, then K-quantize blocks a chunk later; K_m inside
# sage_quantize_qkv). Verify m2 default + lean (188 comparisons expected: the d 64 case added in s22), 4 SMs, and
# with SAGEBWD_KMEAN_IN_QKV=0 (quick); A/B m2 vs m0 at d 64 / 128 (3 rounds); ncu of m2 glue kernels (d 128 N 1k, d 64 N 4k).
set -uo pipefail
R=${OUT:-/tmp/c4}; mkdir -p "$R/prof" "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/m2; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 50 bash scripts/gpu/verify.sh --quick > "$R/lean-stdout.txt" 2>&1; lap "lean verify (quick)" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
OUT=$R/off BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_KMEAN_IN_QKV=0 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/off-stdout.txt" 2>&1; lap "verify KMEAN_IN_QKV=0" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi,off}/log.txt | head -8 >> "$S"
for r in 1 2 3; do
  for v in m0 m2; do
    for d in 64 128; do
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
        --preset sagebwd -d $d --json $R/json/d${d}_$v-r$r.json > $R/log/d${d}_$v-r$r.txt 2>&1 || echo "FAIL $v $d $r" >> $S
    done
  done
done
lap "A/B m2 vs m0, 3 rounds" 0
python3 dev/calls/ab.py $R/json m0 m2 fwd_ms quant_ms bwd_ms >> $S
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SEC="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis"
for shape in "128 1024 off"; do
  set -- $shape; tag=d$1n$2$3
  SAGEBWD_CACHE_DIR=$C timeout 100 $NCU --clock-control none $SEC -k 'regex:sage_(quant|fill|k_mean)' --launch-count 3 -f -o $R/prof/$tag \
    $N/sagebwd bench --preset sagebwd -d $1 -n $2 --causal $3 --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 > $R/prof/$tag.log 2>&1
  lap "ncu $tag" $?
  $NCU -i $R/prof/$tag.ncu-rep --page details --csv > $R/prof/$tag-details.csv 2> $R/prof/$tag-details.err
  $NCU -i $R/prof/$tag.ncu-rep --page details --csv --print-units base > $R/prof/$tag-base.csv 2>/dev/null
  rm -f $R/prof/$tag.ncu-rep
  lap "export $tag" $?
done
ls -la $R/prof >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
