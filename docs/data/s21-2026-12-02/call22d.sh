#!/usr/bin/env bash
# Session 21 call 4. Carry ["dev/f42", "dev/v21c", "dev/call22d.sh"]. f42's binary with its cache (base) and two caches whose
# d 128 backward_main cubin was compiled with -DSB21_BULK_WARP=4 / =5 (sb21: the staged dQ tile of a query block added
# by one 32 KB bulk reduce from one warp of warpgroup 1 instead of one 4 KB bulk per warp).
set -uo pipefail
R=${OUT:-/tmp/call22d}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f42
for v in w4 w5; do
  OUT=$R/verify-$v BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/v21c/$v timeout 60 bash scripts/gpu/verify.sh --quick > "$R/verify-$v-stdout.txt" 2>&1; lap "verify --quick $v" $?
done
grep -HE "passed, .* failed|mismatch" "$R"/verify-*/log.txt | head -4 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset sagebwd --head-dim 128"
cache() { [ "$1" = base ] && echo "$PWD/$N/cache" || echo "$PWD/dev/v21c/$1"; }
for r in 1 2 3; do
  for v in base w4 w5; do
    SAGEBWD_CACHE_DIR=$(cache $v) timeout 60 $N/sagebwd bench $B --json $R/json/$v-r$r.json > $R/log/$v-r$r.txt 2>&1 || echo "FAIL $v $r" >> $S
  done
done
lap "base, w4, w5: d 128, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]; rows = {}
for f in sorted(glob.glob(d + "/*.json")):
    v = f.split("/")[-1].split("-")[0]
    for r in json.load(open(f))["results"]:
        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r["bwd_ms"])
g = {"w4": [], "w5": []}
for k in sorted(rows):
    b = st.median(rows[k]["base"]); line = f"{k[0]} {'causal' if k[1] else 'full'} | base {b:.4f}"
    for v in ("w4", "w5"):
        x = st.median(rows[k][v]); g[v].append(x / b); line += f" | {v} {x:.4f} {100*(x/b-1):+.2f}"
    print(line)
for v in g:
    print(f"geo bwd {v} {100*(math.exp(sum(map(math.log, g[v]))/len(g[v]))-1):+.2f} %")
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
