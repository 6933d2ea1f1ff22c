#!/usr/bin/env bash
# sgrp15 device call (NOT YET RUN). Build first (HERE): keep a copy of this folder's run.sh / SECTION.md / sgrp15.patch,
#   because dev/mkbuild.sh rm -rf's dev/sgrp15:  cp -r /work/main/dev/sgrp15 /tmp/sgrp15-keep &&
#   nice bash /work/main/dev/mkbuild.sh sgrp15 /work/wt-sgrp15 && cp /tmp/sgrp15-keep/{run.sh,SECTION.md,sgrp15.patch} /work/main/dev/sgrp15/
# ON THE DEVICE, from the repo root, carrying ["dev/sgrp15", "$BASE", "dev/ab.sh"] (BASE = a build of main 5e5c5af;
# dev/final = 9f3e69f has the same forward SASS): kind nvidia-h200, timeout_s 220. ~145 s of work (step 4 only if < 120 s were used).
# 1. 4-SM quick verify with wsp3g forced (g = 4: many head groups per grid, the turn loop over the block's tiles);
# 2. ab.sh: verify default + lean (default = wsp3g at d128 N <= 2k and non-causal N 4k), then PRESETS=sagebwd
#    d128 (N 1k/4k both masks) and train (d64 causal hidden 768: unchanged kernels, control) new/base/new/base + cuDNN;
# 3. same binary, d128 N 2048 both masks: SAGEBWD_FORWARD_WGMMA=wsp3g ("new") vs wsp3s ("base") alternated, + cuDNN;
# 4. if time is left: same binary, wsp3g vs wsp3s forced at d128 N4k causal and d64 N1k/4k both (where it is not default).
set -uo pipefail
R=${OUT:-/tmp/sgrp15}; mkdir -p "$R"; S=$R/summary.txt; t0=$SECONDS
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
N=${N:-dev/sgrp15}; B=${BASE:-dev/base}
name=${N#dev/}
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$PWD/$N/cache SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_FORWARD_WGMMA=wsp3g \
  timeout 40 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1
echo "verify 4 SMs wsp3g: rc=$? ($((SECONDS - t0)) s)" >> "$S"
grep -E "passed, .* failed|FAIL|mismatch" "$R/multi/log.txt" | head -8 >> "$S"
OUT=$R/ab BASE=$B PRESETS=sagebwd timeout 150 bash dev/ab.sh "$name" verify d128 train > "$R/ab-stdout.txt" 2>&1
echo "ab.sh rc=$? ($((SECONDS - t0)) s)" >> "$S"
cat "$R/ab/summary.txt" >> "$S" 2>/dev/null
# 3. same binary, N 2k: new = wsp3g forced, base = wsp3s forced
mkdir -p "$R/n2k"
for rep in 1 2; do
  for who in new base; do
    k=wsp3g; [ $who = base ] && k=wsp3s
    SAGEBWD_FORWARD_WGMMA=$k SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 20 $N/sagebwd bench --preset sagebwd --head-dim 128 --n 2048 \
      --causal both --reps 20 --warmup 3 --max-time 4 --json "$R/n2k/$who-n2k-sagebwd-$rep.json" > "$R/n2k/$who-$rep.txt" 2>&1 \
      || echo "n2k $who $rep failed" >> "$S"
  done
done
timeout 25 python3 scripts/gpu/bench_sdpa.py --head-dim 128 --n 2048 --causal both --backends cudnn --reps 20 --max-time 4 \
  --json "$R/n2k/sdpa-n2k.json" > "$R/n2k/sdpa.txt" 2>&1 || echo "n2k sdpa failed" >> "$S"
echo "same binary d128 N2k (new = wsp3g forced, base = wsp3s forced):" >> "$S"
python3 scripts/gpu/ab_table.py "$R/n2k" >> "$S" 2>&1
echo "after n2k ($((SECONDS - t0)) s)" >> "$S"
# 4. same binary where wsp3g is not the default (decides whether to extend it), only if time is left
if [ $((SECONDS - t0)) -lt 120 ]; then
  mkdir -p "$R/more"
  for rep in 1 2; do
    for who in new base; do
      k=wsp3g; [ $who = base ] && k=wsp3s
      SAGEBWD_FORWARD_WGMMA=$k SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 10 $N/sagebwd bench --preset sagebwd --head-dim 128 --n 4096 \
        --causal on --reps 10 --warmup 2 --max-time 2 --json "$R/more/$who-c4k-sagebwd-$rep.json" > "$R/more/$who-c4k-$rep.txt" 2>&1
      SAGEBWD_FORWARD_WGMMA=$k SAGEBWD_CACHE_DIR=$PWD/$N/cache timeout 12 $N/sagebwd bench --preset sagebwd --head-dim 64 --n 1024,4096 \
        --causal both --reps 10 --warmup 2 --max-time 2 --json "$R/more/$who-d64-sagebwd-$rep.json" > "$R/more/$who-d64-$rep.txt" 2>&1
    done
  done
  echo "same binary, not default (new = wsp3g forced, base = wsp3s forced; bwd identical kernels):" >> "$S"
  python3 scripts/gpu/ab_table.py "$R/more" >> "$S" 2>&1
  echo "after more ($((SECONDS - t0)) s)" >> "$S"
fi
tar czf "$R/extra.tgz" -C "$R" n2k multi $( [ -d "$R/more" ] && echo more ) 2>/dev/null
cat "$S"
