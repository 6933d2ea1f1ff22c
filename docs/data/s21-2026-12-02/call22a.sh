#!/usr/bin/env bash
# Session 21 call 1. Carry ["dev/f42", "dev/f41", "dev/call22a.sh"]. f42 = main 97b3890 (session 21's clean-up: dead
# compile-time arms and never-default kernel variants removed; every default kernel's normalized SASS identical to
# f41's, sage_forward_mma's sm_90a SASS changed (its wgmma branch gone)). f41 = session 20's final build (5e0910e).
set -uo pipefail
R=${OUT:-/tmp/call22a}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader >> "$S"
N=dev/f42; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 90 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 90 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 40 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
# The mma.sync forward (sm_80's path, sage_forward_mma, whose sm_90a SASS changed) forced on the H200.
OUT=$R/mmafwd BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_FORWARD_WGMMA=off timeout 60 bash scripts/gpu/verify.sh --quick > "$R/mmafwd-stdout.txt" 2>&1; lap "verify mma.sync forward" $?
# The non-default named variants that remain.
OUT=$R/swap BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_FORWARD_WGMMA=wsp3s-sx timeout 60 bash scripts/gpu/verify.sh --quick > "$R/swap-stdout.txt" 2>&1; lap "verify wsp3s-sx at both d" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi,mmafwd,swap}/log.txt | head -10 >> "$S"
# A removed variant is an error, not the default.
SAGEBWD_CACHE_DIR=$C SAGEBWD_FORWARD_WGMMA=wsp3s-nopp timeout 30 $N/sagebwd bench --preset sagebwd --head-dim 64 --n 1024 --reps 3 --max-time 1 > "$R/removed.txt" 2>&1; echo "removed variant rc=$? $(grep -m1 -o 'no such forward variant' $R/removed.txt)" >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1; do
  for v in f41 f42; do
    for p in sagebwd fpa; do
      SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 90 dev/$v/sagebwd bench --preset $p --head-dim 64,128 $B --json $R/json/$p-$v-r$r.json > $R/log/$p-$v-r$r.txt 2>&1 || echo "FAIL $p $v $r" >> $S
    done
  done
done
lap "f42 vs f41, both presets, d 64 and 128, 1 round" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]
for p in ("sagebwd", "fpa"):
    rows = {}
    for f in sorted(glob.glob(f"{d}/{p}-*.json")):
        v = f.split("/")[-1].split("-")[1]
        for r in json.load(open(f))["results"]:
            k = (r["head_dim"], r["n"], r["causal"])
            for ph in ("fwd_ms", "bwd_ms"):
                rows.setdefault((ph,) + k, {}).setdefault(v, []).append(r[ph])
    for ph in ("fwd_ms", "bwd_ms"):
        g = []
        for k in sorted(x for x in rows if x[0] == ph):
            a, b = st.median(rows[k]["f41"]), st.median(rows[k]["f42"]); g.append(b / a)
            print(f"{p} {ph} d{k[1]} N{k[2]} {'causal' if k[3] else 'full'} | {a:.4f} | {b:.4f} | {100*(b/a-1):+.2f}")
        print(f"== {p} {ph} geo f42/f41 {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} % over {len(g)} shapes")
PY
TRAIN_BIN=$N/sagebwd TRAIN_CACHE=$C OUT=$R/train timeout 150 bash scripts/gpu/train.sh default > "$R/train-stdout.txt" 2>&1; lap "README main command on the GPU" $?
grep -E "^==|validation|exit" "$R/train/summary.txt" | head -8 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
