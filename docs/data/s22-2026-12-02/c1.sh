#!/usr/bin/env bash
# Session 22 call 1. Carry ["dev/f0", "dev/f1", "dev/calls"]. f0 = main 2205593; f1 = fpab22 (fpa d 128 backward: dQ by two
# 16 KB tensor reduces per tile, one per warpgroup after a named barrier, instead of eight 4 KB ones, one per warp).
set -uo pipefail
R=${OUT:-/tmp/c1}; mkdir -p "$R/json" "$R/log" "$R/prof"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S"
N=dev/f1; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify f1" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify f1 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,multi}/log.txt | head -6 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset fpa -d 128"
for r in 1 2 3; do
  for v in f0 f1; do
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench $B --json $R/json/fpa128_$v-r$r.json > $R/log/fpa128_$v-r$r.txt 2>&1 || echo "FAIL fpa128 $v $r" >> $S
  done
done
lap "fpa d 128: f1 vs f0, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]
def table(prefix, base, vs, key):
    rows = {}
    for f in sorted(glob.glob(f"{d}/{prefix}_*.json")):
        v = f.split("/")[-1][len(prefix) + 1:].split("-")[0]
        for r in json.load(open(f))["results"]:
            rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r[key])
    g = {v: [] for v in vs}
    for k in sorted(rows):
        b = st.median(rows[k][base]); line = f"{prefix} {key} {k[0]} {'causal' if k[1] else 'full'} | {base} {b:.4f}"
        for v in vs:
            x = st.median(rows[k][v]); g[v].append(x / b); line += f" | {v} {x:.4f} {100*(x/b-1):+.2f}"
        print(line)
    for v in vs:
        print(f"== {prefix} {key} geo {v}/{base} {100*(math.exp(sum(map(math.log, g[v]))/len(g[v]))-1):+.2f} %")
table("fpa128", "f0", ["f1"], "bwd_ms")
table("fpa128", "f0", ["f1"], "fwd_ms")
PY
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SEC="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
for shape in "128 1024 off" "128 4096 off"; do
  set -- $shape; tag=d$1n$2$3
  timeout 150 $NCU --clock-control none $SEC -k 'regex:sage_' --launch-count 14 -f -o $R/prof/$tag \
    dev/f0/sagebwd bench --preset sagebwd -d $1 -n $2 --causal $3 --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 > $R/prof/$tag.log 2>&1
  lap "ncu $tag" $?
  $NCU -i $R/prof/$tag.ncu-rep --page details --csv > $R/prof/$tag-details.csv 2> $R/prof/$tag-details.err
  $NCU -i $R/prof/$tag.ncu-rep --page source --csv --print-source sass > $R/prof/$tag-source.csv 2> $R/prof/$tag-source.err
  gzip -f $R/prof/$tag-source.csv
  lap "export $tag" $?
done
ls -la $R/prof >> $S
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
