#!/usr/bin/env bash
# Session 20 final call. Carry ["dev/f38", "dev/f34", "dev/call21d.sh"]. f38 = main 4f3755a (sb20: d 128 TMA query copies +
# the P-hat/dS-hat split); f34 = 9e69ef8 (the session's starting kernels; main 339baf0 differs from it on the host only,
# by the review commits, which do not change any kernel choice at these shapes).
set -uo pipefail
R=${OUT:-/tmp/call21d}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f38
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 30 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2; do
  for v in f34 f38; do
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/d128-$v-r$r.json > $R/log/d128-$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
  done
done
lap "session A/B f38 vs f34, d 128, 2 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]; rows = {}
for f in sorted(glob.glob(d + "/d128-*.json")):
    v = f.split("/")[-1].split("-")[1]
    for r in json.load(open(f))["results"]:
        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append((r["fwd_ms"], r["bwd_ms"]))
print("n causal | bwd f34 | bwd f38 | d bwd % | d fwd %"); g = []
for k in sorted(rows):
    o, t = rows[k]["f34"], rows[k]["f38"]
    bo, bt = st.median(x[1] for x in o), st.median(x[1] for x in t)
    fo, ft = st.median(x[0] for x in o), st.median(x[0] for x in t)
    g.append(bt / bo)
    print(f"{k[0]} {k[1]} | {bo:.4f} | {bt:.4f} | {100*(bt/bo-1):+.2f} | {100*(ft/fo-1):+.2f}")
print(f"geo bwd {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} %")
PY
mkdir -p dev/bin && cp $N/sagebwd dev/bin/sagebwd && rm -rf dev/bench-cache && cp -r $N/cache dev/bench-cache && cp $N/BUILD.txt dev/bench-cache/
OUT=$R/sweep timeout 70 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "full sweep" $?
sed -n '/Summary: geometric/,$p' "$R/sweep/compare.md" | head -8 >> "$S"
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$PWD/$N/cache OUT=$R/train timeout 240 bash scripts/gpu/train.sh perf1024 perf4096 > "$R/train-stdout.txt" 2>&1; lap "train perf1024 perf4096" $?
grep -E "^==|steady" "$R/train/summary.txt" | sed -E 's/, peak memory.*//' >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
