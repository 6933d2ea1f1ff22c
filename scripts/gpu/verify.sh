#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE, in the repository root, after scripts/gpu/bundle.sh here, carrying the bundle
# (["dev/bundle"]; BUNDLE=DIR for another): the mma.sync self-test, every GPU-vs-simulator
# comparison (tensor-core and scalar kernels), the σ sweep against the exact reference, the error
# paths and a timing table, in one process (sagebwd-gpu-check). Summary table last on stdout; full log,
# results.tsv and the GPU description under $OUT. Extra arguments go to the binary (--quick: small shapes only;
# --fp8-only: only the FP8 P·V forward section).
set -uo pipefail
OUT=${OUT:-/tmp/sagebwd-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
BUNDLE=${BUNDLE:-dev/bundle}
. "$(dirname "${BASH_SOURCE[0]}")/unpack.sh" && unpack_bundle "$BUNDLE" || exit 1
export SAGEBWD_CACHE_DIR=${SAGEBWD_CACHE_DIR:-$PWD/$BUNDLE/cache}
BIN=${BIN:-$BUNDLE/sagebwd-gpu-check}
if [ ! -x "$BIN" ]; then
  echo "error: $BIN not found: run 'bash scripts/gpu/bundle.sh' on the build machine and carry $BUNDLE" >&2
  exit 1
fi
{ date -u; cat "$(dirname "$BIN")/BUILD.txt" 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
"$BIN" --out "$OUT" "$@" > "$OUT/log.txt" 2>&1
rc=$?
# The summary is the tail of the log; print the whole log if it is short enough to come back.
if [ "$(wc -c < "$OUT/log.txt")" -lt 11000 ]; then cat "$OUT/log.txt"; else sed -n '/^# summary/,$p' "$OUT/log.txt"; fi
echo "exit code $rc"
exit $rc
