#!/usr/bin/env bash
# Session 21 call 6. Carry ["dev/f44", "dev/f43", "dev/call22f.sh"]. f44 = main (sb21 at d 64: the dQ block's 8 warp boxes as
# two 64-row tensor reduces from warp 5, the host's map with 64-row boxes); f43 = sb21 at d 128 only (the base).
set -uo pipefail
R=${OUT:-/tmp/call22f}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f44; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 90 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 90 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 40 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset sagebwd"
for r in 1 2 3; do
  for v in f43 f44; do
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench $B -d 64 --json $R/json/d64_$v-r$r.json > $R/log/d64_$v-r$r.txt 2>&1 || echo "FAIL d64 $v $r" >> $S
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench $B -d 64 --hidden 768 --causal on -n 1024,2048,4096,8192 --json $R/json/train_$v-r$r.json > $R/log/train_$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "d 64 and training shape: f43, f44, 3 rounds" 0
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
table("d64", "f43", ["f44"])
table("train", "f43", ["f44"])
table("d64", "f43", ["f44"], "fwd_ms")
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
