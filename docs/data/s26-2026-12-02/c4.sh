#!/usr/bin/env bash
# Session 26 call 4. Carry ["dev/k26"]: main's sagebwd binary (557781c's kernels = p26's) and four d 128 kernel caches:
# cache (main), cache_w1 / cache_w3 (backward_main d 128 compiled with -DSB21_BULK_WARP=1 / 3: the dQ bulk reduce issued
# by a warp of warpgroup 0 instead of warp 5, which also carries the row constants), cache_u0 (-DSBWD13_UNIFORM_WG=0:
# the warpgroup index without the uniform shuffle; 20 bytes of spill). Compiled here by scripts/dev/nvrtc_regs.py (the
# library's options; SASS identical to the binary's own for the unchanged source) and copied under the cache's names.
# A/B of the four, sagebwd d 128, three rounds alternated. No verify: none of these changes an operation.
. scripts/dev/calllib.sh
ab_caches 3 k26 "m=dev/k26/cache w1=dev/k26/cache_w1 w3=dev/k26/cache_w3 u0=dev/k26/cache_u0" 128
lap "A/B d 128 x3 (m, w1, w3, u0)" 0
for v in w1 w3 u0; do python3 scripts/dev/ab.py "$R/json" m $v bwd_ms > "$R/ab-$v.txt"; grep "==" "$R/ab-$v.txt" >> "$S"; done
finish
