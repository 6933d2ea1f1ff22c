#!/usr/bin/env bash
# Session 21 call 5. Carry ["dev/f43", "dev/f42", "dev/v21d", "dev/call22e.sh"]. f43 = main 1ab46ce (sb21 at d 128: one 32 KB
# bulk dQ from warp 5, the default); f42 = the clean-up build (before sb21). v21d/{t4,t5} = f43's cache with the d 64
# backward_main cubin compiled with -DSB21_TQ_WARP=4 / 5 (all 8 dQ tensor reduces of a tile from one warp).
set -uo pipefail
R=${OUT:-/tmp/call22e}; mkdir -p "$R/json" "$R/log"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f43; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 90 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 90 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 40 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
for v in t4 t5; do
  OUT=$R/verify-$v BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/dev/v21d/$v timeout 60 bash scripts/gpu/verify.sh --quick > "$R/verify-$v-stdout.txt" 2>&1; lap "verify --quick $v" $?
done
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi,verify-t4,verify-t5}/log.txt | head -8 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset sagebwd"
for r in 1 2; do
  for v in f42 f43; do
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench $B -d 128 --json $R/json/d128_$v-r$r.json > $R/log/d128_$v-r$r.txt 2>&1 || echo "FAIL d128 $v $r" >> $S
  done
done
lap "d 128: f43 vs f42, 2 rounds" 0
cache() { [ "$1" = base ] && echo "$C" || echo "$PWD/dev/v21d/$1"; }
for r in 1 2 3; do
  for v in base t4 t5; do
    SAGEBWD_CACHE_DIR=$(cache $v) timeout 60 $N/sagebwd bench $B -d 64 --json $R/json/d64_$v-r$r.json > $R/log/d64_$v-r$r.txt 2>&1 || echo "FAIL d64 $v $r" >> $S
    SAGEBWD_CACHE_DIR=$(cache $v) timeout 60 $N/sagebwd bench $B -d 64 --hidden 768 --causal on -n 1024,2048,4096,8192 --json $R/json/train_$v-r$r.json > $R/log/train_$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "d 64 and training shape: base, t4, t5, 3 rounds" 0
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
table("d128", "f42", ["f43"])
table("d64", "base", ["t4", "t5"])
table("train", "base", ["t4", "t5"])
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
