#!/usr/bin/env bash
# Session 20 call 8. Carry ["dev/f41", "dev/f40", "dev/call21h.sh"]. f41 = f40 with call21g's variant B as the default
# (SB20_TMA_THREAD=128, SB20_ROW_BASE=128: both extra duties of sb16's loop on warpgroup 1).
set -uo pipefail
R=${OUT:-/tmp/call21h}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f41
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 30 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2; do
  for v in f40 f41; do
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/d128-$v-r$r.json > $R/log/d128-$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
  done
done
lap "f41 vs f40, d 128, 2 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]; rows = {}
for f in sorted(glob.glob(d + "/d128-*.json")):
    v = f.split("/")[-1].split("-")[1]
    for r in json.load(open(f))["results"]:
        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r["bwd_ms"])
g = []
for k in sorted(rows):
    a, b = st.median(rows[k]["f40"]), st.median(rows[k]["f41"]); g.append(b / a)
    print(f"{k[0]} {k[1]} | {a:.4f} | {b:.4f} | {100*(b/a-1):+.2f}")
print(f"geo bwd {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} %")
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
