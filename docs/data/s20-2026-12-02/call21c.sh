#!/usr/bin/env bash
# Session 20 call 3. Carry ["dev/f37", "dev/f37v1", "dev/f37v5", "dev/f37v7", "dev/call21c.sh"]. f37 = 0275f3b + SB20_LATE
# (default 0: f36's d 128 kernels up to one moved move); f37vL = f37's caches with the d 128 backward_main cubin of
# -DSB20_LATE=L (bits: 1 the next blocks' copies, 2 the row loads, 4 the bulk dQ moved after dV's first chunks).
set -uo pipefail
R=${OUT:-/tmp/call21c}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f37
for v in v1 v5 v7; do
  OUT=$R/verify-$v BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/f37$v timeout 40 bash scripts/gpu/verify.sh --quick > "$R/verify-$v-stdout.txt" 2>&1; lap "quick verify $v" $?
  grep -HE "passed, .* failed" "$R"/verify-$v/log.txt | head -1 >> "$S"
done
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2 3; do
  for v in v0 v1 v5 v7; do
    C=$PWD/dev/f37$v; [ $v = v0 ] && C=$PWD/$N/cache
    SAGEBWD_CACHE_DIR=$C timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/d128-$v-r$r.json > $R/log/d128-$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
  done
done
lap "LATE variants, d 128 sweep, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st
d = sys.argv[1]; rows = {}
for f in sorted(glob.glob(d + "/d128-*.json")):
    v = f.split("/")[-1].split("-")[1]
    for r in json.load(open(f))["results"]:
        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r["bwd_ms"])
vs = ["v1", "v5", "v7"]
print("n causal | bwd v0 ms | " + " | ".join(f"{v} %" for v in vs))
geo = {v: [] for v in vs}
for k in sorted(rows):
    b = st.median(rows[k]["v0"]); out = []
    for v in vs:
        x = st.median(rows[k][v]) / b; geo[v].append(x); out.append(f"{100*(x-1):+.2f}")
    print(f"{k[0]} {k[1]} | {b:.4f} | " + " | ".join(out))
import math
print("geo | | " + " | ".join(f"{100*(math.exp(sum(map(math.log, geo[v]))/len(geo[v]))-1):+.2f}" for v in vs))
PY
NCU=/usr/local/cuda/bin/ncu; mkdir -p $R/ncu
for c in off on; do
  SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 90 $NCU --clock-control none -k regex:"quant|mean|transpose" --launch-skip 0 --launch-count 6 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    -o "$R/ncu/glue-$c" -f $N/sagebwd bench --preset sagebwd --head-dim 128 --n 1024 --causal $c --reps 1 --min-reps 1 \
    --warmup 0 --max-time 0.1 --input-sets 1 > "$R/ncu/glue-$c.log" 2>&1
  lap "ncu glue $c" $?
  $NCU -i "$R/ncu/glue-$c.ncu-rep" --print-details all > "$R/ncu/glue-$c.txt" 2>&1
  $NCU -i "$R/ncu/glue-$c.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed > "$R/ncu/glue-$c.csv" 2>&1
  rm -f "$R/ncu/glue-$c.ncu-rep"
  cut -c1-400 "$R/ncu/glue-$c.csv" | head -12 >> "$S"
done
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
