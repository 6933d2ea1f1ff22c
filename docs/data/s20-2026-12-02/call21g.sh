#!/usr/bin/env bash
# Session 20 call 7. Carry ["dev/f40", "dev/f40A", "dev/f40B", "dev/f40C", "dev/call21g.sh"]. f40 = main 22cde10; f40X = its caches
# with the d 128 backward_main cubin of: A -DSB20_TMA_THREAD=128 (the TMA copies issued by warp 4, warpgroup 1), B A +
# -DSB20_ROW_BASE=128 (the row constants by warps 4-5 too), C -DSB20_ROW_BASE=128 only.
set -uo pipefail
R=${OUT:-/tmp/call21g}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f40
for v in A B C; do
  OUT=$R/verify-$v BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/f40$v timeout 40 bash scripts/gpu/verify.sh --quick > "$R/verify-$v-stdout.txt" 2>&1; lap "quick verify $v" $?
  grep -HE "passed, .* failed" "$R"/verify-$v/log.txt | head -1 >> "$S"
done
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2 3; do
  for v in 0 A B C; do
    C=$PWD/dev/f40$v; [ $v = 0 ] && C=$PWD/$N/cache
    SAGEBWD_CACHE_DIR=$C timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/d128-v$v-r$r.json > $R/log/d128-v$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
  done
done
lap "variants, d 128 sweep, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]; rows = {}
for f in sorted(glob.glob(d + "/d128-*.json")):
    v = f.split("/")[-1].split("-")[1]
    for r in json.load(open(f))["results"]:
        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r["bwd_ms"])
vs = ["vA", "vB", "vC"]
print("n causal | bwd v0 ms | " + " | ".join(f"{v} %" for v in vs))
geo = {v: [] for v in vs}
for k in sorted(rows):
    b = st.median(rows[k]["v0"]); out = []
    for v in vs:
        x = st.median(rows[k][v]) / b; geo[v].append(x); out.append(f"{100*(x-1):+.2f}")
    print(f"{k[0]} {k[1]} | {b:.4f} | " + " | ".join(out))
print("geo | | " + " | ".join(f"{100*(math.exp(sum(map(math.log, geo[v]))/len(geo[v]))-1):+.2f}" for v in vs))
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
