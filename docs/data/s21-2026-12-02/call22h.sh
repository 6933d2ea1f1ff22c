#!/usr/bin/env bash
# Session 21 call 8. Carry ["dev/f44", "dev/v21e", "dev/call22h.sh"]. f44 = main's kernels (d 64: the dQ reduces from warp 5 of
# warpgroup 1, the row constants by threads 0..63 of warpgroup 0). v21e/r128: the row constants by threads 128..191
# (both duties on warpgroup 1); v21e/q1: the dQ reduces from warp 1 (both duties on warpgroup 0). Cubin swaps of f44's cache.
set -uo pipefail
R=${OUT:-/tmp/call22h}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f44
for v in r128 q1; do
  OUT=$R/verify-$v BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/v21e/$v timeout 60 bash scripts/gpu/verify.sh --quick > "$R/verify-$v-stdout.txt" 2>&1; lap "verify --quick $v" $?
done
grep -HE "passed, .* failed|mismatch" "$R"/verify-*/log.txt | head -4 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset sagebwd -d 64"
cache() { [ "$1" = base ] && echo "$PWD/$N/cache" || echo "$PWD/dev/v21e/$1"; }
for r in 1 2 3; do
  for v in base r128 q1; do
    SAGEBWD_CACHE_DIR=$(cache $v) timeout 60 $N/sagebwd bench $B --json $R/json/d64_$v-r$r.json > $R/log/d64_$v-r$r.txt 2>&1 || echo "FAIL d64 $v $r" >> $S
    SAGEBWD_CACHE_DIR=$(cache $v) timeout 60 $N/sagebwd bench $B --hidden 768 --causal on -n 1024,2048,4096,8192 --json $R/json/train_$v-r$r.json > $R/log/train_$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "d 64 and training shape: base, r128, q1, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]
def table(prefix, base, vs, key="bwd_ms"):
    rows = {}
    for f in sorted(glob.glob(f"{d}/{prefix}_*.json")):
        v = f.split("/")[-1][len(prefix) + 1:].split("-")[0]
        for r in json.load(open(f))["results"]:
            rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r[key])
    g = {v: [] for v in vs}
    for k in sorted(rows):
        b = st.median(rows[k][base]); line = f"{prefix} {k[0]} {'causal' if k[1] else 'full'} | {base} {b:.4f}"
        for v in vs:
            x = st.median(rows[k][v]); g[v].append(x / b); line += f" | {v} {x:.4f} {100*(x/b-1):+.2f}"
        print(line)
    for v in vs:
        print(f"== {prefix} {key} geo {v}/{base} {100*(math.exp(sum(map(math.log, g[v]))/len(g[v]))-1):+.2f} %")
table("d64", "base", ["r128", "q1"])
table("train", "base", ["r128", "q1"])
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
