#!/usr/bin/env bash
# Session 20 call 5. Carry ["dev/f39", "dev/call21e.sh"]. f39 = main + sb20 at d 64 (sage_bwd_main_mma_sage_qt: the TMA
# query copies on bwd18's TMA-dQ kernel, the default where n_q % 64 == 0; SAGEBWD_SAGE_TMA_STAGE=0 = the cp.async kernels).
set -uo pipefail
R=${OUT:-/tmp/call21e}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f39; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
grep -HE "passed, .* failed|mismatch" "$R"/verify/log.txt | head -3 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2 3; do
  for v in tma old; do
    E=$( [ $v = tma ] && echo TUNE=def || echo SAGEBWD_SAGE_TMA_STAGE=0 )
    env $E timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 64 $B --json $R/json/d64-$v-r$r.json > $R/log/d64-$v-r$r.txt 2>&1 || echo "FAIL d64 $v $r" >> $S
    env $E timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 64 --n 1024,2048,4096,8192 --causal on --hidden 768 $B --json $R/json/train-$v-r$r.json > $R/log/train-$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "tma vs old, d 64 sweep + training shape, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]
for grp in ["d64", "train"]:
    rows = {}
    for f in sorted(glob.glob(f"{d}/{grp}-*.json")):
        v = f.split("/")[-1].split("-")[1]
        for r in json.load(open(f))["results"]:
            rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append((r["fwd_ms"], r["bwd_ms"]))
    print(f"{grp}: n causal | bwd old | bwd tma | d bwd % | d fwd %"); g = []
    for k in sorted(rows):
        o, t = rows[k]["old"], rows[k]["tma"]
        bo, bt = st.median(x[1] for x in o), st.median(x[1] for x in t)
        fo, ft = st.median(x[0] for x in o), st.median(x[0] for x in t)
        g.append(bt / bo)
        print(f"{k[0]} {k[1]} | {bo:.4f} | {bt:.4f} | {100*(bt/bo-1):+.2f} | {100*(ft/fo-1):+.2f}")
    print(f"{grp} geo bwd {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} %")
PY
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
grep -HE "passed, .* failed|mismatch" "$R"/lean/log.txt | head -2 >> "$S"
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
