#!/usr/bin/env bash
# Session 20 call 2. Carry ["dev/f35", "dev/f36", "dev/call21b.sh"]. f35 = sb20's TMA copies (main 461a722's kernels);
# f36 = + SB20_SPLIT: the pipelined loops (d 64 and d 128) quantize P̂, issue dV's first chunks, then quantize dŜ.
set -uo pipefail
R=${OUT:-/tmp/call21b}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
OUT=$R/verify BIN=dev/f36/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/f36/cache timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
grep -HE "passed, .* failed|mismatch" "$R"/verify/log.txt | head -3 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2 3; do
  for v in f35 f36; do
    export SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache
    timeout 60 dev/$v/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/d128-$v-r$r.json > $R/log/d128-$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
    timeout 60 dev/$v/sagebwd bench --preset sagebwd --head-dim 64 $B --json $R/json/d64-$v-r$r.json > $R/log/d64-$v-r$r.txt 2>&1 || echo "FAIL d64 $v $r" >> $S
    timeout 60 dev/$v/sagebwd bench --preset sagebwd --head-dim 64 --n 1024,2048,4096,8192 --causal on --hidden 768 $B --json $R/json/train-$v-r$r.json > $R/log/train-$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "f36 vs f35, d 128 + d 64 sweeps + training shape, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st
d = sys.argv[1]
for grp in ["d128", "d64", "train"]:
    rows = {}
    for f in sorted(glob.glob(f"{d}/{grp}-*.json")):
        v = f.split("/")[-1].split("-")[1]
        for r in json.load(open(f))["results"]:
            k = (r["n"], r["causal"]); rows.setdefault(k, {}).setdefault(v, []).append((r["fwd_ms"], r["bwd_ms"]))
    print(f"{grp}: n causal | bwd f35 | bwd f36 | d bwd % | d fwd %")
    for k in sorted(rows):
        o, t = rows[k].get("f35", []), rows[k].get("f36", [])
        if not o or not t: continue
        bo, bt = st.median(x[1] for x in o), st.median(x[1] for x in t)
        fo, ft = st.median(x[0] for x in o), st.median(x[0] for x in t)
        print(f"{k[0]} {k[1]} | {bo:.4f} | {bt:.4f} | {100*(bt/bo-1):+.2f} | {100*(ft/fo-1):+.2f}")
PY
OUT=$R/lean BIN=dev/f36/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/f36/cache SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
grep -HE "passed, .* failed|mismatch" "$R"/lean/log.txt | head -2 >> "$S"
OUT=$R/multi BIN=dev/f36/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/f36/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 30 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs persistent" $?
grep -HE "passed, .* failed|mismatch" "$R"/multi/log.txt | head -2 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
