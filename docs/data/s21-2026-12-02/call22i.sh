#!/usr/bin/env bash
# Session 21 call 9 (review). Carry ["dev/f45", "dev/f44", "dev/call22i.sh"]. f45 = main 25cf125: the bulk-group helpers shared
# in hopper.cuh; sage_bwd_main_persist_bf16q (fpa, d 128) commits its tensor reduce from every lane (SASS: the branch around
# the commit gone); every other kernel's SASS identical to f44's.
set -uo pipefail
R=${OUT:-/tmp/call22i}; mkdir -p "$R/json"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt
N=dev/f45
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 90 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; echo "verify rc=$?" >> "$S"
grep -HE "passed, .* failed|mismatch" "$R"/verify/log.txt | head -3 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset fpa -d 128"
for r in 1 2; do for v in f44 f45; do
  SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench $B --json $R/json/$v-r$r.json > /dev/null 2>&1 || echo "FAIL $v $r" >> $S
done; done
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    v = f.split("/")[-1].split("-")[0]
    for r in json.load(open(f))["results"]:
        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r["bwd_ms"])
g = [st.median(x["f45"]) / st.median(x["f44"]) for x in rows.values()]
for k in sorted(rows):
    a, b = st.median(rows[k]["f44"]), st.median(rows[k]["f45"]); print(f"fpa d128 bwd {k[0]} {k[1]} | {a:.4f} | {b:.4f} | {100*(b/a-1):+.2f}")
print(f"geo fpa d128 bwd f45/f44 {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} %")
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
