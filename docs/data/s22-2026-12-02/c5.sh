#!/usr/bin/env bash
# Session 22 call 5. Carry ["dev/f4", "dev/calls"]. f4 = 8ae8c96. With the producer's cp.async gone (fwd22), is the turn-free
# stagger kernel (wsp3s-sx, d 64's default) better at d 128, or the ping-pong one (wsp3s-x, d 128's default) at d 64? No code:
# SAGEBWD_FORWARD_WGMMA forces either. Three rounds, alternated.
set -uo pipefail
R=${OUT:-/tmp/c5}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f4; C=$PWD/$N/cache
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset sagebwd"
for r in 1 2 3; do
  for v in def alt; do
    if [ $v = def ]; then e128=""; e64=""; else e128=wsp3s-sx; e64=wsp3s-x; fi
    SAGEBWD_FORWARD_WGMMA=$e128 SAGEBWD_CACHE_DIR=$C timeout 60 $N/sagebwd bench $B -d 128 --json $R/json/d128_$v-r$r.json > $R/log/d128_$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
    SAGEBWD_FORWARD_WGMMA=$e64 SAGEBWD_CACHE_DIR=$C timeout 60 $N/sagebwd bench $B -d 64 --json $R/json/d64_$v-r$r.json > $R/log/d64_$v-r$r.txt 2>&1 || echo "FAIL d64 $v $r" >> $S
    SAGEBWD_FORWARD_WGMMA=$e64 SAGEBWD_CACHE_DIR=$C timeout 60 $N/sagebwd bench $B -d 64 --hidden 768 --causal on -n 1024,2048,4096,8192 --json $R/json/train_$v-r$r.json > $R/log/train_$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "3 rounds" 0
grep -h "kernel\|wgmma\|WGMMA" $R/log/d128_alt-r1.txt | head -3 >> $S
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]
def table(prefix, base, vs, key):
    rows = {}
    for f in sorted(glob.glob(f"{d}/{prefix}_*.json")):
        v = f.split("/")[-1][len(prefix) + 1:].split("-")[0]
        for r in json.load(open(f))["results"]:
            rows.setdefault((r["n"], r["causal"]), {}).setdefault(v, []).append(r[key])
    g = []
    for k in sorted(rows):
        b = st.median(rows[k][base]); x = st.median(rows[k][vs]); g.append(x / b)
        print(f"{prefix} {key} {k[0]} {'causal' if k[1] else 'full'} | {base} {b:.4f} | {vs} {x:.4f} {100*(x/b-1):+.2f}")
    print(f"== {prefix} {key} geo {vs}/{base} {100*(math.exp(sum(map(math.log, g))/len(g))-1):+.2f} %")
for p in ["d128", "d64", "train"]:
    table(p, "def", "alt", "fwd_ms")
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
