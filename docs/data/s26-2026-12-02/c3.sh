#!/usr/bin/env bash
# Session 26 call 3. Carry ["dev/p26b"]. p26b = main (aa42bcb, sb26) + sb26b (the d 128 sagebwd backward's query loop
# run once with the mask for the masked tiles, then without it, as bwd16 did at d 64). Host code unchanged, so the
# baseline "p26" is p26b's binary with dev/p26b/cache_p26: sb26's cubins (dev/p26) under p26b's cache names.
# Verify p26b (default, lean, 4 SMs); A/B p26 vs p26b, sagebwd d 128, 3 rounds alternated; ncu of p26b's d 128
# backward at N 4k.
. scripts/dev/calllib.sh
N=dev/p26b; C=$PWD/$N/cache
OUT=$R/verify BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1; lap "verify p26b" $?
OUT=$R/lean BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh > "$R/lean-stdout.txt" 2>&1; lap "lean verify p26b" $?
OUT=$R/multi BIN=$N/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$C SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1; lap "verify p26b 4 SMs" $?
grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
pack
for r in 1 2 3; do
  for v in p26 p26b; do
    cache=$C; [ $v = p26 ] && cache=$PWD/$N/cache_p26
    SAGEBWD_CACHE_DIR=$cache timeout 60 $N/sagebwd bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 --input-sets 2 \
      --preset sagebwd -d 128 --json "$R/json/s128_$v-r$r.json" > "$R/log/s128_$v-r$r.txt" 2>&1 || echo "FAIL $v round $r" >> "$S"
  done
done
lap "A/B p26b vs p26 (d 128 x3)" 0
python3 scripts/dev/ab.py "$R/json" p26 p26b bwd_ms fwd_ms > "$R/ab.txt"; grep "==" "$R/ab.txt" >> "$S"
pack
prof bwd128n4k p26b 'sage_bwd_main' --preset sagebwd -d 128 -n 4096 --causal off
prof bwd128c4k p26b 'sage_bwd_main' --preset sagebwd -d 128 -n 4096 --causal on
finish
