#!/usr/bin/env bash
# Session 22 call 3. Carry ["dev/f2", "dev/f3", "dev/calls"]. f2 = 02be58f (fwd22); f3 = f2 + fwd22s (O by TMA tensor stores from a staging box per consumer warp). Old header: (the persistent INT8
# forward copies K̂ and Q̂ by TMA from one producer thread where n_k % 16 == 0).
set -uo pipefail
R=${OUT:-/tmp/c2}; mkdir -p "$R/json" "$R/log" "$R/prof"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; t0=$SECONDS; }
N=dev/f3; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify f3" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify f3 4 SMs" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 50 bash scripts/gpu/verify.sh --quick > "$R/lean-stdout.txt" 2>&1; lap "verify f3 lean quick" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,multi,lean}/log.txt | head -6 >> "$S"
B="--reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 --preset sagebwd"
for r in 1 2 3; do
  for v in f2 f3; do
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench $B --json $R/json/sage_$v-r$r.json > $R/log/sage_$v-r$r.txt 2>&1 || echo "FAIL sage $v $r" >> $S
    SAGEBWD_CACHE_DIR=$PWD/dev/$v/cache timeout 60 dev/$v/sagebwd bench $B -d 64 --hidden 768 --causal on -n 1024,2048,4096,8192 --json $R/json/train_$v-r$r.json > $R/log/train_$v-r$r.txt 2>&1 || echo "FAIL train $v $r" >> $S
  done
done
lap "sagebwd sweep + training shape: f3 vs f2, 3 rounds" 0
python3 - "$R/json" >> "$S" <<'PY'
import json, sys, glob, statistics as st, math
d = sys.argv[1]
def table(prefix, base, vs, key, split=True):
    rows = {}
    for f in sorted(glob.glob(f"{d}/{prefix}_*.json")):
        v = f.split("/")[-1][len(prefix) + 1:].split("-")[0]
        for r in json.load(open(f))["results"]:
            rows.setdefault((r["head_dim"], r["n"], r["causal"]), {}).setdefault(v, []).append(r[key])
    g = {}
    for k in sorted(rows):
        b = st.median(rows[k][base]); line = f"{prefix} {key} d{k[0]} {k[1]} {'causal' if k[2] else 'full'} | {base} {b:.4f}"
        for v in vs:
            x = st.median(rows[k][v]); g.setdefault((v, k[0]), []).append(x / b); g.setdefault((v, 0), []).append(x / b); line += f" | {v} {x:.4f} {100*(x/b-1):+.2f}"
        print(line)
    for (v, hd), xs in sorted(g.items()):
        print(f"== {prefix} {key} geo {v}/{base} {'all' if hd == 0 else 'd%d' % hd} {100*(math.exp(sum(map(math.log, xs))/len(xs))-1):+.2f} %")
for key in ["fwd_ms", "bwd_ms", "quant_ms"]:
    table("sage", "f2", ["f3"], key)
for key in ["fwd_ms", "bwd_ms"]:
    table("train", "f2", ["f3"], key)
PY
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SEC="--section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats"
tag=f3d128n1024off
timeout 60 $NCU --clock-control none $SEC -k 'regex:sage_forward' --launch-count 1 -f -o $R/prof/$tag \
    dev/f3/sagebwd bench --preset sagebwd -d 128 -n 1024 --causal off --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 > $R/prof/$tag.log 2>&1
lap "ncu $tag" $?
$NCU -i $R/prof/$tag.ncu-rep --page details --csv > $R/prof/$tag-details.csv 2>&1
$NCU -i $R/prof/$tag.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $R/prof/$tag-source.csv.gz
rm -f $R/prof/*.ncu-rep
lap "export" 0
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
