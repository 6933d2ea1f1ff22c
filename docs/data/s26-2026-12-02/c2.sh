#!/usr/bin/env bash
# Session 26 call 2. Carry ["dev/p26"]. p26 = main + sb26 (the d 128 sagebwd backward's dQ staging keeps its
# bank-conflict-free chunk order in the FP32 accumulator, SAGE_DQ_ACC_ROT, instead of undoing it with 64 FSEL per thread
# and tile; the postprocess reads the chunks back in order). Its host code is main's, so the baseline "m0x" is p26's
# binary with dev/p26/cache_m0: main's (dev/m0, 354f084) d 128 cubins under p26's cache names (the carry limit left room
# for one binary only). Verify p26 (default, lean, 4 SMs); A/B m0x vs p26, sagebwd d 128, 3 rounds alternated; ncu of
# p26's d 128 backward main kernel (N 4k); the sweep on p26.
. scripts/dev/calllib.sh
N=dev/p26; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify p26" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify p26" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify p26 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
pack
for r in 1 2 3; do
  for v in m0x p26; do
    cache=$C; [ $v = m0x ] && cache=$PWD/$N/cache_m0
    SAGEBWD_CACHE_DIR=$cache timeout 60 $N/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
      --preset sagebwd -d 128 --json "$R/json/s128_$v-r$r.json" > "$R/log/s128_$v-r$r.txt" 2>&1 || echo "FAIL $v round $r" >> "$S"
  done
done
lap "A/B p26 vs m0x (d 128 x3)" 0
python3 scripts/dev/ab.py "$R/json" m0x p26 bwd_ms fwd_ms > "$R/ab.txt"; grep "==" "$R/ab.txt" >> "$S"
pack
prof bwd128n4k p26 'sage_bwd_main' --preset sagebwd -d 128 -n 4096 --causal off
pack
BIN=$N/sagebwd SAGEBWD_CACHE_DIR=$C OUT=$R/sweep timeout 150 bash scripts/gpu/bench.sh --presets fpa,sagebwd > "$R/sweep-stdout.txt" 2>&1; lap "sweep p26" $?
grep -A12 "### Summary" "$R/sweep/compare.md" >> "$S"
finish
