#!/usr/bin/env bash
# Session 21 call 2. Carry ["dev/f42", "dev/call22b.sh"]. Why fpa's d 128 non-causal timings step between levels within
# one bench run (call22a: N 4k fwd 1.15 → 1.21 → 1.28 ms, bwd 3.03 → 3.37 ms) while sagebwd's are flat: SM clock and
# board power logged every 20 ms during long runs of one shape, fpa / sagebwd / cuDNN alternated.
set -uo pipefail
R=${OUT:-/tmp/call22b}; mkdir -p "$R/json"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt
N=dev/f42; export SAGEBWD_CACHE_DIR=$PWD/$N/cache
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv,noheader,nounits -lms 20 > "$R/smi.csv" &
SMI=$!
sleep 1
W=$R/windows.txt
run() {  # name, command...
  local name=$1; shift
  local a; a=$(date +%s.%N); "$@" > "$R/$name.txt" 2>&1; echo "$name $a $(date +%s.%N) rc=$?" >> "$W"
}
B="--reps 400 --min-reps 400 --warmup 5 --max-time 30 --input-sets 3 --causal off"
for pass in 1 2; do
  for n in 4096 8192; do
    run fpa-$n-p$pass $N/sagebwd bench --preset fpa -d 128 -n $n $B --json $R/json/fpa-$n-p$pass.json
    run sage-$n-p$pass $N/sagebwd bench --preset sagebwd -d 128 -n $n $B --json $R/json/sage-$n-p$pass.json
    run cudnn-$n-p$pass python3 scripts/gpu/bench_sdpa.py -d 128 -n $n --causal off --backends cudnn --reps 400 --min-reps 400 --warmup 5 --max-time 30 --json $R/json/cudnn-$n-p$pass.json
  done
done
sleep 1; kill $SMI
python3 - "$R" >> "$S" <<'PY'
import json, sys, statistics as st, datetime
R = sys.argv[1]
smi = []
for line in open(f"{R}/smi.csv"):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        smi.append((t, float(f[1]), float(f[2]), float(f[4])))
    except Exception:
        pass
print(f"smi samples {len(smi)}")
for line in open(f"{R}/windows.txt"):
    name, a, b, rc = line.split()
    a, b = float(a), float(b)
    w = [s for s in smi if a + 0.3 < s[0] < b]  # skip the process start
    clk = [s[1] for s in w]; pw = [s[2] for s in w]; tp = [s[3] for s in w]
    try:
        j = json.load(open(f"{R}/json/{name}.json"))["results"][0]
        fw, bw = j["fwd_ms_all"], j["bwd_ms_all"]
        q = lambda x: f"{st.median(x[:50]):.3f}/{st.median(x[len(x)//2:len(x)//2+50]):.3f}/{st.median(x[-50:]):.3f}"
        tim = f"fwd first/mid/last-50 med {q(fw)}  bwd {q(bw)}  (min {min(fw):.3f}/{min(bw):.3f}, max {max(fw):.3f}/{max(bw):.3f})"
    except Exception as e:
        tim = f"no json ({e})"
    if clk:
        print(f"{name} {rc} {b-a:.1f}s | SM MHz med {st.median(clk):.0f} min {min(clk):.0f} max {max(clk):.0f} | W med {st.median(pw):.0f} max {max(pw):.0f} | {st.median(tp):.0f} C | {tim}")
    else:
        print(f"{name} {rc} {b-a:.1f}s | no smi samples | {tim}")
PY
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null
cat "$S"
