#!/usr/bin/env bash
# GPU training: correctness (GPU vs CPU), throughput/MFU, and the corpus comparison, in one call.
#
# 1. HERE (no GPU needed), in the repository root: bash scripts/gpu/bundle.sh [--corpus]
#    (binaries + sm_90a kernel cache in dev/bundle; --corpus adds the Gutenberg shards for `corpus`).
# 2. ON THE DEVICE, in the repository root, carrying ["dev/bundle"] (BUNDLE=DIR for another bundle):
#      bash scripts/gpu/train.sh check            # sagebwd train-check (GPU vs CPU step), ~1 min
#      bash scripts/gpu/train.sh perf             # base model, seq 1024 and 4096, fpa and sagebwd
#      bash scripts/gpu/train.sh perf4096         # base, 4096, 60 steps (STEPS=n), both preset orders (fpa first, sagebwd first)
#      bash scripts/gpu/train.sh perf1024         # the same at 1024 (batch 16, 60 steps)
#      bash scripts/gpu/train.sh perf8192         # the same at 8192 (batch 2, 40 steps)
#      bash scripts/gpu/train.sh corpus STEPS     # small model on Gutenberg, fpa vs sagebwd (SEED=n: another seed)
#      bash scripts/gpu/train.sh default          # the README's main command (no arguments) on the GPU
#      bash scripts/gpu/train.sh profile          # base, 1024: GPU time per phase (SAGEBWD_PROFILE=1, CUDA events)
#      bash scripts/gpu/train.sh fpa1024 [NAME]   # base, 1024, fpa only, 40 steps: a quick A/B point (log NAME)
#      bash scripts/gpu/train.sh profile-fpa [NAME] # `profile` with fpa only (log NAME)
#      bash scripts/gpu/train.sh profile4096      # `profile` at seq 4096 (batch 4), fpa and sagebwd
#      bash scripts/gpu/train.sh multi            # 2 GPUs of one machine: data-parallel
#                                                 # throughput, and 2 GPUs × 8 vs 1 GPU × 16 sequences
#    Several modes may follow each other (check perf corpus 2000). Logs, metrics and plots go to
#    $OUT (default /tmp/sagebwd-train-out); a summary is printed last. Each run also logs SM clock and
#    board power (NAME.smi.csv) and summarizes its plateaus of high draw (scripts/gpu/power_log.py).
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ] || [ $# = 0 ]; then sed -n '2,22p' "$0"; exit 0; fi

OUT=${OUT:-/tmp/sagebwd-train-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# BUNDLE=DIR: another bundle (e.g. a baseline in the same call); TRAIN_BIN / TRAIN_CACHE: a binary and cache apart.
BUNDLE=${BUNDLE:-dev/bundle}
. scripts/gpu/unpack.sh && unpack_bundle "$BUNDLE" || exit 1
export SAGEBWD_CACHE_DIR=${TRAIN_CACHE:-$PWD/$BUNDLE/cache}
BIN=${TRAIN_BIN:-$BUNDLE/sagebwd}
if [ ! -x "$BIN" ]; then
  echo "error: $BIN not found: run 'bash scripts/gpu/bundle.sh' on the build machine and carry $BUNDLE" >&2
  exit 1
fi
RUNS=/tmp/sagebwd-runs
summary=$OUT/summary.txt
{ date -u; echo "binary $BIN"; cat "$(dirname "$BIN")/BUILD.txt" 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$summary"
status=0

run_logged() { # name, command...: runs, keeps the log, copies summary lines
  local name=$1; shift
  echo "== $name: $*" | tee -a "$summary"
  local t0=$SECONDS smi=""
  # SM clock, board power and GPU temperature every 100 ms (power_log.py: why they matter): $OUT/NAME.smi.csv
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv,noheader,nounits -lms 100 \
      > "$OUT/$name.smi.csv" 2> /dev/null &
    smi=$!
  fi
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ -n "$smi" ] && kill "$smi" 2> /dev/null && wait "$smi" 2> /dev/null
  grep -E "tokens/s|all checks|FAIL|^loss|after .* steps|error|validation loss|^\| (fpa|sagebwd)" "$OUT/$name.log" | sed 's/^/  /' >> "$summary"
  [ -n "$smi" ] && python3 scripts/gpu/power_log.py "$OUT/$name.smi.csv" >> "$summary" 2>&1
  echo "  exit $rc, $((SECONDS - t0)) s" >> "$summary"
  [ $rc = 0 ] || status=1
}

while [ $# -gt 0 ]; do
  case "$1" in
    check)
      run_logged check $BIN train-check
      # A length that is not a multiple of the attention blocks or of 4: their partial blocks.
      run_logged check-odd $BIN train-check --seq 203 --steps 5 ;;
    default)
      run_logged default $BIN train --runs-dir $RUNS
      cp $RUNS/sample-compare.png "$OUT/default-compare.png" 2>/dev/null ;;
    perf)
      for cfg in "1024 16" "4096 4"; do
        seq=${cfg% *} batch=${cfg#* }
        run_logged "perf-$seq" $BIN train --device cuda --model base --seq "$seq" --batch "$batch" --steps 30 \
          --warmup 5 --eval-every 1000 --eval-tokens 16384 --ckpt-every 1000 --preset fpa,sagebwd \
          --name "perf$seq" --runs-dir $RUNS
      done ;;
    perf1024|perf4096|perf8192)
      # The fpa / sagebwd comparison with less noise: more steps, and each preset once first and once second
      # (a GPU that warms up or down during the call favours neither). STEPS=n: longer runs.
      case $1 in
        perf1024) seq=1024 batch=16 steps=${STEPS:-60} ;;
        perf4096) seq=4096 batch=4 steps=${STEPS:-60} ;;
        *) seq=8192 batch=2 steps=${STEPS:-40} ;;
      esac
      for order in fpa,sagebwd sagebwd,fpa; do
        run_logged "perf$seq-${order/,/-}" $BIN train --device cuda --model base --seq $seq --batch $batch --steps "$steps" \
          --warmup 5 --eval-every 1000 --eval-tokens 16384 --ckpt-every 1000 --preset "$order" \
          --name "p$seq-${order/,/-}" --runs-dir $RUNS
      done ;;
    fpa1024)
      name=fpa1024; case "${2:-}" in ""|check|perf|perf1024|perf4096|perf8192|profile|profile-fpa|profile4096|default|corpus|multi|fpa1024) ;; *) name=$2; shift ;; esac
      run_logged "$name" $BIN train --device cuda --model base --seq 1024 --batch 16 --steps 40 --warmup 5 --eval-every 1000 \
        --eval-tokens 16384 --ckpt-every 1000 --preset fpa --name "$name" --runs-dir $RUNS ;;
    profile-fpa)
      name=profile-fpa; case "${2:-}" in ""|check|perf|perf1024|perf4096|perf8192|profile|profile-fpa|profile4096|default|corpus|multi|fpa1024) ;; *) name=$2; shift ;; esac
      SAGEBWD_PROFILE=1 run_logged "$name" $BIN train --device cuda --model base --seq 1024 --batch 16 --steps 20 \
        --warmup 5 --eval-every 1000 --eval-tokens 16384 --ckpt-every 1000 --preset fpa --name "$name" --runs-dir $RUNS
      grep -E "^profile|^  [a-z]" "$OUT/$name.log" >> "$summary" ;;
    profile)
      SAGEBWD_PROFILE=1 run_logged profile $BIN train --device cuda --model base --seq 1024 --batch 16 --steps 20 \
        --warmup 5 --eval-every 1000 --eval-tokens 16384 --ckpt-every 1000 --preset fpa,sagebwd --name prof --runs-dir $RUNS
      grep -E "^profile|^  [a-z]" "$OUT/profile.log" >> "$summary" ;;
    profile4096)
      SAGEBWD_PROFILE=1 run_logged profile4096 $BIN train --device cuda --model base --seq 4096 --batch 4 --steps 12 \
        --warmup 5 --eval-every 1000 --eval-tokens 16384 --ckpt-every 1000 --preset fpa,sagebwd --name prof4k --runs-dir $RUNS
      grep -E "^profile|^  [a-z]" "$OUT/profile4096.log" >> "$summary" ;;
    corpus)
      steps=$2; shift
      seed=${SEED:-1}
      name=gutenberg; [ "$seed" = 1 ] || name=gutenberg-seed$seed
      data=$BUNDLE/data
      [ -e "$data/train-00.txt.xz" ] || { echo "no $data/train-00.txt.xz: build the bundle with --corpus" | tee -a "$summary"; status=1; shift; continue; }
      run_logged "corpus-seed$seed" $BIN train "$data/train-00.txt.xz" --val "$data/val.txt.xz" --device cuda \
        --model small --seq 1024 --batch 16 --steps "$steps" --warmup $((steps / 20 + 1)) --eval-every $((steps / 10 + 1)) \
        --eval-tokens 262144 --ckpt-every 100000 --preset fpa,sagebwd --seed "$seed" --name $name --runs-dir $RUNS
      cp $RUNS/$name-compare.png "$OUT/" 2>/dev/null
      for p in fpa sagebwd; do cp $RUNS/$name-$p/metrics.jsonl "$OUT/$name-$p-metrics.jsonl" 2>/dev/null; done ;;
    multi)
      # cudarc loads NCCL as libnccl.so; PyTorch's nvidia-nccl wheel ships libnccl.so.2 only.
      nccl=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0] + '/lib')" 2>/dev/null)
      mkdir -p /tmp/nccl-link && ln -sf "$nccl/libnccl.so.2" /tmp/nccl-link/libnccl.so
      export LD_LIBRARY_PATH=/tmp/nccl-link:$LD_LIBRARY_PATH
      nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
      run_logged multi-base-1024 $BIN train --device cuda --gpus 2 --model base --seq 1024 --batch 16 --steps 30 \
        --warmup 5 --eval-every 1000 --eval-tokens 32768 --ckpt-every 1000 --preset fpa,sagebwd --name multi --runs-dir $RUNS
      for g in "2 8" "1 16"; do
        gpus=${g% *} batch=${g#* }
        run_logged "same-step-${gpus}gpu" $BIN train --device cuda --gpus "$gpus" --model small --seq 1024 --batch "$batch" \
          --steps 40 --warmup 5 --eval-every 20 --eval-tokens 65536 --ckpt-every 1000 --preset sagebwd --name "same$gpus" --runs-dir $RUNS
      done
      python3 - "$RUNS/same2-sagebwd/metrics.jsonl" "$RUNS/same1-sagebwd/metrics.jsonl" <<'PY' | tee -a "$summary"
import json, sys
runs = [[json.loads(l) for l in open(p)] for p in sys.argv[1:]]
loss = [[r["loss"] for r in run if r["kind"] == "train"] for run in runs]
val = [[r["val_loss"] for r in run if r["kind"] == "val"] for run in runs]
diffs = [abs(a - b) for a, b in zip(*loss)]
worst = max(range(len(diffs)), key=diffs.__getitem__)
print(f"  2 GPUs x 8 vs 1 GPU x 16 sequences, {len(diffs)} steps: train loss diff at steps 1-3 "
      + ", ".join(f"{d:.1e}" for d in diffs[:3]) + f"; largest {diffs[worst]:.2e} at step {worst + 1} "
      f"({loss[0][worst]:.4f} / {loss[1][worst]:.4f}); final train {loss[0][-1]:.4f} / {loss[1][-1]:.4f}; "
      f"val {[round(v, 5) for v in val[0]]} / {[round(v, 5) for v in val[1]]}")
PY
      ;;
    *) echo "unknown mode $1" | tee -a "$summary"; status=2 ;;
  esac
  shift
done
cat "$summary"
exit $status
