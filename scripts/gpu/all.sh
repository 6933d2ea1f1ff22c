#!/usr/bin/env bash
# Everything in one device call: the kernels against the simulator (verify.sh), the quick bench
# against cuDNN / FlashAttention-2 (bench.sh --quick) and the GPU training check and throughput
# (train.sh check perf). One call pays the machine's start-up once.
#
# 1. HERE: bash scripts/gpu/bundle.sh (add --corpus for the `corpus` training mode).
# 2. ON THE DEVICE, carrying ["dev/bundle"] (BUNDLE=DIR for another bundle):
#      bash scripts/gpu/all.sh [TRAIN MODES...]      # default train modes: check perf
#    Logs under $OUT/{verify,bench,train}, everything also in $OUT/all.tgz (a call returns a few
#    files only); the summary (exit codes, verify summary, bench table, training lines) is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${OUT:-/tmp/sagebwd-all}
modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(check perf)
mkdir -p "$R/verify" "$R/bench" "$R/train"
status=0
t0=$SECONDS
OUT=$R/verify bash scripts/gpu/verify.sh > "$R/verify/stdout.txt" 2>&1
rc=$?; [ $rc = 0 ] || status=1
echo "verify: exit $rc ($((SECONDS - t0)) s)" > "$R/summary.txt"
t0=$SECONDS
OUT=$R/bench bash scripts/gpu/bench.sh --quick > "$R/bench/stdout.txt" 2>&1
rc=$?; [ $rc = 0 ] || status=1
echo "bench: exit $rc ($((SECONDS - t0)) s)" >> "$R/summary.txt"
t0=$SECONDS
OUT=$R/train bash scripts/gpu/train.sh "${modes[@]}" > "$R/train/stdout.txt" 2>&1
rc=$?; [ $rc = 0 ] || status=1
echo "train ${modes[*]}: exit $rc ($((SECONDS - t0)) s)" >> "$R/summary.txt"
tar czf "$R/all.tgz" -C "$R" verify bench train
{
  echo
  sed -n '/^# summary/,/^## GPU vs CPU/p' "$R/verify/log.txt" 2>/dev/null | head -8
  grep -E "passed, .* failed" "$R/verify/log.txt" 2>/dev/null
  echo
  sed -n '/Summary: geometric/,$p' "$R/bench/compare.md" 2>/dev/null
  sed -n '/Peak device memory/,/^### Our quant/p' "$R/bench/compare.md" 2>/dev/null
  echo
  grep -v "^   M" "$R/train/summary.txt" 2>/dev/null
} >> "$R/summary.txt"
cat "$R/summary.txt"
exit $status
