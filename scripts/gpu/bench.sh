#!/usr/bin/env bash
# Throughput of our CUDA kernels against PyTorch SDPA (BF16: cuDNN, FlashAttention-2) on one GPU,
# in one call: `sagebwd bench` per preset, scripts/gpu/bench_sdpa.py, then scripts/gpu/compare.py
# (side-by-side Markdown table with ratios against cuDNN, PNG plot of throughput vs N).
#
# 1. HERE (no GPU needed), in the repository root: bash scripts/gpu/bundle.sh (binaries + sm_90a kernel cache in
#    dev/bundle, so the device spends no time in NVRTC; dev/ is git-ignored).
# 2. ON THE DEVICE, in the repository root, carrying ["dev/bundle"] (BUNDLE=DIR for another bundle):
#      bash scripts/gpu/bench.sh --quick     # N ∈ {1024, 4096}, few repetitions, fpa and sagebwd
#      bash scripts/gpu/bench.sh             # the standard sweep (N 1k-16k, d 64 and 128, causal and not), 3 presets
#      bash scripts/gpu/bench.sh --presets fpa,sagebwd   # the sweep of docs/PERFORMANCE.md, ~1 min on an H200
#    Our kernels run on the library's default path (tensor cores); --ours "--scalar" times the
#    scalar reference kernels instead (reported as ours-<preset>-scalar).
#
# Options: --quick; --presets fpa,sagebwd[,int8-all] (default fpa,sagebwd with --quick, all three
# without); --no-sdpa; --ours "ARGS" and --sdpa "ARGS" append arguments to either bench
# (e.g. --ours "--head-dim 128 --causal off").
# Writes under $OUT (default /tmp/sagebwd-bench): log.txt, ours-<preset>.json, sdpa.json, smi.csv (SM clock and
# board power every 20 ms while the benches run: compare.md's clock table), compare.md, compare.png (at most 8
# files); prints compare.md last. Exit code: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."

quick=0 sdpa=1 presets="" ours_extra="" sdpa_extra=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --no-sdpa) sdpa=0 ;;
    --presets) presets=$2; shift ;;
    --ours) ours_extra=$2; shift ;;
    --sdpa) sdpa_extra=$2; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ $quick = 1 ]; then
  presets=${presets:-fpa,sagebwd}
  # Scalar kernels take ~1.5 s per fwd+bwd at N = 4096: 3-5 repetitions, 3 s per point.
  ours_args="-n 1024,4096 --reps 5 --min-reps 3 --warmup 1 --max-time 3"
  sdpa_args="--quick"
else
  presets=${presets:-fpa,sagebwd,int8-all}
  ours_args=""
  sdpa_args=""
fi

OUT=${OUT:-/tmp/sagebwd-bench}
mkdir -p "$OUT"
LOG=$OUT/log.txt
: > "$LOG"
# Results of an earlier run in the same folder must not join this comparison.
rm -f "$OUT"/ours-*.json "$OUT/sdpa.json" "$OUT/smi.csv" "$OUT/compare.md" "$OUT/compare.png"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BUNDLE=${BUNDLE:-dev/bundle}
. scripts/gpu/unpack.sh && unpack_bundle "$BUNDLE" || exit 1
export SAGEBWD_CACHE_DIR=${SAGEBWD_CACHE_DIR:-$PWD/$BUNDLE/cache}
BIN=${BIN:-$BUNDLE/sagebwd}
failed=()

# Runs a step with its output appended to the log and a one-line status on stdout; a failed step's
# last lines are kept for the end of stdout (the log may not come back if the call is cut short).
TMP_STEP=$(mktemp)
trap 'rm -f "$TMP_STEP"' EXIT
failures=""
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" >> "$LOG"
  "$@" > "$TMP_STEP" 2>&1
  local rc=$?
  cat "$TMP_STEP" >> "$LOG"
  echo "$name: exit $rc, $((SECONDS - t0)) s"
  if [ $rc != 0 ]; then
    failed+=("$name")
    failures+=$'\n'"--- $name (exit $rc), last lines:"$'\n'"$(tail -n 12 "$TMP_STEP")"
  fi
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv 2>&1
  cat "$(dirname "$BIN")/BUILD.txt" 2>/dev/null || echo "no $(dirname "$BIN")/BUILD.txt (not a bundle of scripts/gpu/bundle.sh)"
  echo "quick=$quick presets=$presets ours_args=$ours_args $ours_extra sdpa_args=$sdpa_args $sdpa_extra"
} >> "$LOG" 2>&1

if [ ! -x "$BIN" ]; then
  echo "error: $BIN not found: run 'bash scripts/gpu/bundle.sh' on the build machine and carry $BUNDLE" | tee -a "$LOG" >&2
  exit 1
fi

# The SM clock and board power while the benches run (compare.py matches them to each point's timed span).
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 20 \
  > "$OUT/smi.csv" 2>/dev/null &
smi_pid=$!
trap 'rm -f "$TMP_STEP"; kill $smi_pid 2>/dev/null' EXIT

# SDPA first: the baseline on a cool GPU is the conservative choice for our ratios.
if [ $sdpa = 1 ]; then
  # shellcheck disable=SC2086
  step sdpa python3 scripts/gpu/bench_sdpa.py $sdpa_args $sdpa_extra --json "$OUT/sdpa.json"
fi
for p in ${presets//,/ }; do
  # shellcheck disable=SC2086
  step "ours-$p" "$BIN" bench --preset "$p" $ours_args $ours_extra --json "$OUT/ours-$p.json"
done

kill $smi_pid 2>/dev/null
results=()
for f in "$OUT/sdpa.json" "$OUT"/ours-*.json; do [ -s "$f" ] && results+=("$f"); done
if [ ${#results[@]} -gt 0 ]; then
  step compare python3 scripts/gpu/compare.py "${results[@]}" --md "$OUT/compare.md" --png "$OUT/compare.png" \
    --smi "$OUT/smi.csv"
else
  failed+=("compare (no results)")
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}$failures"
  echo
fi
[ -s "$OUT/compare.md" ] && cat "$OUT/compare.md"
[ ${#failed[@]} = 0 ]
