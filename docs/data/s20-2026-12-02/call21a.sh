#!/usr/bin/env bash
# Session 20 call 1. Carry ["dev/f35", "dev/call21a.sh"]. f35 = main + sb20 (d 128 sage plain-grid backward: in-loop
# query-block copies by TMA, sage_bwd_main_mma_sage_t, the default where n_q % 64 == 0; SAGEBWD_SAGE128_TMA_STAGE=0 = sb16).
set -uo pipefail
R=${OUT:-/tmp/call21a}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f35; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check timeout 80 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
grep -HE "passed, .* failed|mismatch" "$R"/verify/log.txt | head -3 >> "$S"
grep -E "448|384" "$R"/verify/log.txt | grep -i "sagebwd" | head -4 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2"
for r in 1 2 3; do
  for v in tma old; do
    E=$( [ $v = tma ] && echo TUNE=def || echo SAGEBWD_SAGE128_TMA_STAGE=0 )
    env $E timeout 60 $N/sagebwd bench --preset sagebwd --head-dim 128 $B --json $R/json/d128-$v-r$r.json > $R/log/d128-$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
  done
done
lap "tma vs old, d 128 sweep, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st
d = sys.argv[1]; rows = {}
for f in sorted(glob.glob(d + "/d128-*.json")):
    v = f.split("/")[-1].split("-")[1]
    for r in json.load(open(f))["results"]:
        k = (r["n"], r["causal"]); rows.setdefault(k, {}).setdefault(v, []).append((r["fwd_ms"], r["bwd_ms"]))
print("n causal | bwd old | bwd tma | d bwd % | d fwd %")
for k in sorted(rows):
    o, t = rows[k].get("old", []), rows[k].get("tma", [])
    if not o or not t: continue
    bo, bt = st.median(x[1] for x in o), st.median(x[1] for x in t)
    fo, ft = st.median(x[0] for x in o), st.median(x[0] for x in t)
    print(f"{k[0]} {k[1]} | {bo:.4f} | {bt:.4f} | {100*(bt/bo-1):+.2f} | {100*(ft/fo-1):+.2f}")
PY
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_BWD_GROUPS=lean timeout 80 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
grep -HE "passed, .* failed|mismatch" "$R"/lean/log.txt | head -2 >> "$S"
NCU=/usr/local/cuda/bin/ncu; mkdir -p $R/ncu
prof() {  # name env n causal: the d 128 sagebwd backward main kernel
  local name=$1 e=$2 n=$3 c=$4
  env $e timeout 90 $NCU --clock-control none -k regex:"sage_bwd_main_mma_sage" --launch-skip 0 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \
    --section LaunchStats --section Occupancy --section SourceCounters \
    --import-source no -o "$R/ncu/$name" -f \
    $N/sagebwd bench --preset sagebwd --head-dim 128 --n $n --causal $c --reps 1 --min-reps 1 \
    --warmup 1 --max-time 0.1 --input-sets 1 > "$R/ncu/$name.log" 2>&1
  lap "ncu $name" $?
  $NCU -i "$R/ncu/$name.ncu-rep" --print-details all > "$R/ncu/$name.txt" 2>&1
  $NCU -i "$R/ncu/$name.ncu-rep" --page source --csv --print-source sass > "$R/ncu/$name-sass.csv" 2>&1
  gzip -f "$R/ncu/$name-sass.csv"; rm -f "$R/ncu/$name.ncu-rep"
  grep -hE "Duration|Executed Instructions |Warp Cycles Per Issued|Issue Slots Busy|Registers Per|Elapsed Cycles" "$R/ncu/$name.txt" | sed "s/^/$name  /" >> "$S"
}
prof tma-4k TUNE=def 4096 on
prof old-4k SAGEBWD_SAGE128_TMA_STAGE=0 4096 on
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
