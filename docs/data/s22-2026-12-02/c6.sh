#!/usr/bin/env bash
# Session 22 call 6 (final). Carry ["dev/f5", "dev/bin/sagebwd", "dev/bench-cache", "dev/calls"]. f5 = main be7fc83
# (f4 = 8ae8c96 with wsp3s-sx the default at d 128 too; the same cubins); dev/bench-cache from bench.sh --prepare on
# be7fc83. Verify default and lean, 4 SMs; d 128 A/B f5 vs f4, three rounds; the README main command; the official sweep.
set -uo pipefail
R=${OUT:-/tmp/c6}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f5; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -6 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset sagebwd -d 128"
for r in 1 2 3; do
  for v in f4 f5; do
    # f4's forward = f5 with wsp3s-x forced (the same cubins; only the host's default changed)
    e=""; [ $v = f4 ] && e=wsp3s-x
    SAGEBWD_FORWARD_WGMMA=$e SAGEBWD_CACHE_DIR=$C timeout 60 $N/sagebwd bench $B --json $R/json/d128_$v-r$r.json > $R/log/d128_$v-r$r.txt 2>&1 || echo "FAIL $v $r" >> $S
  done
done
lap "d 128 A/B" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]; rows = {}
for f in sorted(glob.glob(f"{d}/d128_*.json")):
    v = f.split("/")[-1][5:].split("-")[0]
    for r in json.load(open(f))["results"]:
        rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r["fwd_ms"])
g = []
for k in sorted(rows):
    b = st.median(rows[k]["f4"]); x = st.median(rows[k]["f5"]); g.append(x / b)
    print(f"d128 fwd_ms {k[0]} {'causal' if k[1] else 'full'} | f4 {b:.4f} | f5 {x:.4f} {100*(x/b-1):+.2f}")
print(f"== d128 fwd_ms geo f5/f4 {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} %")
PY
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/readme timeout 150 bash scripts/gpu/train.sh default > "$R/readme-stdout.txt" 2>&1; lap "README main command on the GPU" $?
OUT=$R/sweep timeout 300 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
