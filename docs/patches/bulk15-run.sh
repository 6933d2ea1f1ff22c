#!/usr/bin/env bash
# bulk15's device call (NOT RUN YET). Before it: copy dev/bulk15/{run.sh,var,SECTION.md,bulk15.patch} aside (mkbuild.sh
# rm -rf's dev/bulk15), `bash dev/mkbuild.sh bulk15 /work/wt-bulk15`, copy them back. BASE (default dev/base, which is now
# an old build of e272877) must be a build of main 5e5c5af: e.g. `git worktree add /work/wt-b5e 5e5c5af && bash dev/mkbuild.sh
# base /work/wt-b5e`. Carry ["dev/bulk15", "$BASE", "dev/ab.sh"] (~2 × 20 MiB). ~130-150 s of work on a warm machine.
# new = plain-grid sage kernel (sage_bwd_main_mma_sage, d 64) with bulk dQ + conflict-free (XOR-permuted) staging stores.
# Variants (cubin-swapped caches of new's build; same host, same 149 632 B of shared memory):
#   NR = bulk dQ, unpermuted stores (4-way conflicts), Z = no bulk (= main 5e5c5af's plain kernel SASS, but with the
#   staging shared memory allocated), H = half the permutation (stores 4 wavefronts, 16 selects instead of 32).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=${OUT:-/tmp/bulk15}; mkdir -p "$R/var"; S=$R/summary.txt; t0=$SECONDS
N=dev/bulk15; B=${BASE:-dev/base}
lap() { echo "$1 rc=$2 ($((SECONDS - t0)) s)" >> "$S"; }
left() { [ $((SECONDS - t0)) -lt $1 ]; }
md5sum $N/cache/backward_main-sm_90a-d64-*.cubin $N/var/*.cubin > "$R/md5.txt" 2>&1  # new's d64 cubin should equal var/ROT-expected.cubin
for v in NR Z H; do
  mkdir -p $N/cache$v; cp $N/cache/* $N/cache$v/
  f=$(ls $N/cache$v/backward_main-sm_90a-d64-*.cubin); cp $N/var/$v.cubin "$f"
done
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 50 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap verify $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_BWD_GROUPS=lean timeout 50 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 25 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify 4 SMs" $?
for v in NR H; do
  left 70 && { OUT=$R/q$v BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache$v timeout 15 bash scripts/gpu/verify.sh --quick > "$R/q$v-stdout.txt" 2>&1; lap "variant $v --quick" $?; }
done
{ grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi,qNR,qH}/log.txt 2>/dev/null | head -12; } >> "$S"
OUT=$R/ab BASE=$B PRESETS=sagebwd timeout 75 bash dev/ab.sh bulk15 train d64 > "$R/ab-stdout.txt" 2>&1; lap "A/B train d64" $?
for rep in 1 2; do for v in NR Z H; do
  left 150 && { SAGEBWD_CACHE_DIR=$PWD/$N/cache$v timeout 10 $N/sagebwd bench --preset sagebwd --head-dim 64 --n 1024,4096 --causal on \
    --hidden 768 --reps 20 --warmup 3 --max-time 4 --json "$R/var/$v-train-sagebwd-$rep.json" > "$R/var/$v-$rep.txt" 2>&1 || echo "variant $v $rep failed" >> "$S"; }
done; done
lap variants 0
python3 - "$R/var" "$R/ab/json" >> "$S" 2>&1 <<'PY'
import json,glob,sys,os
from collections import defaultdict
ms=defaultdict(list)
for d in sys.argv[1:]:
    for f in sorted(glob.glob(d+"/*-train-sagebwd-*.json")):
        who=os.path.basename(f).split("-")[0]
        for r in json.load(open(f))["results"]:
            ms[(r["n"],who)].append(r["bwd_ms"])
for n in sorted({k[0] for k in ms}):
    print(f"train N{n} bwd ms:", "  ".join(f"{w}: "+", ".join(f"{b:.4f}" for b in ms[(n,w)]) for w in ["base","new","NR","Z","H"] if (n,w) in ms))
PY
cat "$R/ab/ab.md" >> "$S" 2>/dev/null
tar czf "$R/all.tgz" -C "$R" --exclude all.tgz --exclude summary.txt . 2>/dev/null
echo "total $((SECONDS - t0)) s" >> "$S"; cat "$S"
