#!/usr/bin/env bash
# Session 19 call 2. Carry ["dev/f28", "dev/f27", "dev/call20b.sh"]. f28 = d383323 (tune20's host rules), f27 = 76c7397 (base).
# 1. verify f28: full default + lean + 4-SM quick (persistent grids forced); 2. A/B f28 vs f27 over the sweep, both
# presets, two rounds alternated; 3. the official sweep of f28 with SDPA (compare.md); 4. f28 sagebwd --lean-memory sweep.
set -uo pipefail
R=${OUT:-/tmp/call20b}; mkdir -p "$R/ab"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f28
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 30 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2; do
  for who in f28 f27; do
    for p in sagebwd fpa; do
      SAGEBWD_CACHE_DIR=$PWD/dev/$who/cache timeout 60 dev/$who/sagebwd bench --preset $p $B --json $R/ab/$who-$p-r$r.json > $R/ab/$who-$p-r$r.txt 2>&1 || echo "FAIL $who $p $r" >> $S
    done
  done
done
lap "A/B f28 vs f27, 2 rounds" 0
mkdir -p dev/bin && cp $N/sagebwd dev/bin/sagebwd && rm -rf dev/bench-cache && cp -r $N/cache dev/bench-cache && cp $N/BUILD.txt dev/bench-cache/
OUT=$R/sweep timeout 100 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "full sweep" $?
SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 60 $N/sagebwd bench --preset sagebwd --lean-memory $B --json $R/lean-sweep.json > $R/lean-sweep.txt 2>&1; lap "lean sweep" $?
NCU=/usr/local/cuda/bin/ncu; mkdir -p $R/ncu
prof() {  # name n regex: the d 128 non-causal sagebwd forward at the sweep shape
  local name=$1 n=$2 rx=$3
  SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 90 $NCU --clock-control none -k regex:"$rx" --launch-skip 0 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \
    --section LaunchStats --section Occupancy --section SourceCounters --section MemoryWorkloadAnalysis \
    --import-source no -o "$R/ncu/$name" -f \
    $N/sagebwd bench --preset sagebwd --head-dim 128 --n $n --causal off --reps 1 --min-reps 1 \
    --warmup 1 --max-time 0.1 --input-sets 1 > "$R/ncu/$name.log" 2>&1
  lap "ncu $name" $?
  $NCU -i "$R/ncu/$name.ncu-rep" --print-details all > "$R/ncu/$name.txt" 2>&1
  $NCU -i "$R/ncu/$name.ncu-rep" --page source --csv --print-source sass > "$R/ncu/$name-sass.csv" 2>&1
  gzip -f "$R/ncu/$name-sass.csv"
  grep -hE "Duration|DRAM Throughput|Executed Instructions |Warp Cycles Per Issued|Issue Slots Busy|Registers Per|Achieved Occupancy|SM Active Cycles|Elapsed Cycles" "$R/ncu/$name.txt" | sed "s/^/$name  /" >> "$S"
}
prof fwd128-n1k 1024 "sage_forward_ws_p3s$"
prof fwd128-n16k 16384 "sage_forward_ws_p3s_nopp"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
{
  echo; grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6
  echo; sed -n '/Summary: geometric/,$p' "$R/sweep/compare.md" | head -12
} >> "$S"
cat "$S"
