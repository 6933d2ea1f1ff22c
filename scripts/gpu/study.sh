#!/usr/bin/env bash
# The pre-training study (issue: the seed paper's findings at small scale): `small` at sequence 1024 on
# Gutenberg, tokens per step (TPS) 16K / 128K / 1M by --accum, the same token budget per run, fpa vs
# sagebwd with 2 seeds, and at 1M TPS the ablations (QK-norm off; dQ and dK in BF16; K-smoothing off;
# Q-smoothing on). Every run traces the per-layer attention error (--trace); the seed-1 parts end with
# `sagebwd diagnose` on their sagebwd checkpoint (the paper's Table 2, CPU simulator vs f64).
#
# 1. HERE (no GPU needed), in the repository root:   bash scripts/gpu/bundle.sh --corpus --compact
#    (the binaries xz-compressed, the precompiled sm_90a kernels and Gutenberg train-00 + val in dev/bundle; ~56 MB:
#    with the tree it fits one 64 MiB carry, and the same call can run `verify.sh --quick` or `--fp8-only` too)
# 2. ON THE DEVICE, in the repository root, carrying ["dev/bundle"] (BUNDLE=DIR for another), parts per call:
#      bash scripts/gpu/study.sh PART [PART ...]
#    PART: tps16k-seed1 tps16k-seed2 tps128k-seed1 tps128k-seed2 tps1m-seed1 tps1m-seed2
#          qknorm-off (fpa and sagebwd)           ablate-grads (sagebwd --bf16 dq,dk; --smooth-k off)
#          ablate-smoothq (sagebwd --smooth-q)    smoke (a few steps of each kind, ~1 min: try first)
#    (the ablations at 1M TPS, or at ABLATE_TPS=16k|128k; seed 1, or ABLATE_SEED=N)
#    Each part writes $OUT/study-PART.tar.gz (metrics.jsonl, config.json, summary.json, plots and logs of
#    its runs; diagnose's table, JSON and plot) and refreshes it after every run, so a part cut off at
#    the call's limit still returns what it finished.
#
# Settings (environment): TOKENS per run (default 100663296 = 96 × 2^20: 6144 steps at 16K, 768 at 128K,
# 96 at 1M); EVAL_TOKENS (default 1048576 validation tokens per evaluation, 10 evaluations per run).
# Learning rate and warmup per TPS (peak, cosine to peak/10; not tuned, chosen by the square-root rule
# from the 16K default, capped): 16K lr 2e-3 warmup 5 % of steps; 128K lr 3e-3 warmup 5 %; 1M lr 4e-3
# warmup 10 %. LR16K / LR128K / LR1M override them.
#
# Time (measured 2026-12-07 on an H100, docs/STUDY.md): a 100M-token pair (fpa + sagebwd, ~1.65M tokens/s each) is
# 162-166 s with its evaluations and traces, + 9 s of tokenizing once per machine, + 23 s of diagnose in seed-1 parts:
# three parts fit one 10-minute call. The --bf16 dq,dk run is on the general kernels (0.69M tokens/s): ablate-grads
# takes 169 + 85 s, so it shares a call with one pair; --smooth-q (also general kernels) is not measured yet.
set -uo pipefail
cd "$(dirname "$0")/../.."

# Several parts in one call (each ~3 min on an H100 at the default budget): one after the other, each its own tarball;
# the tokens are made once.
if [ $# -gt 1 ]; then
  rc=0
  for p in "$@"; do bash "$0" "$p" || rc=1; done
  exit $rc
fi
part=${1:-}
case "$part" in
  tps16k-seed1|tps16k-seed2|tps128k-seed1|tps128k-seed2|tps1m-seed1|tps1m-seed2|qknorm-off|ablate-grads|ablate-smoothq|smoke) ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac

OUT=${OUT:-/tmp/sagebwd-study-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
BUNDLE=${BUNDLE:-dev/bundle}
. scripts/gpu/unpack.sh && unpack_bundle "$BUNDLE" || exit 1
export SAGEBWD_CACHE_DIR=${TRAIN_CACHE:-$PWD/$BUNDLE/cache}
BIN=${TRAIN_BIN:-$BUNDLE/sagebwd}
# DATA, MODEL, DEVICE, SEQ, BATCH: for a dry run elsewhere (e.g. MODEL=tiny DEVICE=cpu SEQ=64 BATCH=2 STEPS=2).
DATA=${DATA:-$BUNDLE/data}
MODEL=${MODEL:-small}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-1024}
BATCH=${BATCH:-16}
WORK=/tmp/sagebwd-study
RUNS=$WORK/runs
KEEP=$WORK/keep/$part
TOKENS=${TOKENS:-100663296}
# The TPS of the ablation parts: 1m (the paper's setting, the default), or 16k/128k — at 100M tokens 1M TPS is 96
# steps, too early in training to compare presets (docs/STUDY.md), and the sagebwd gap was measured at 16K.
AT=${ABLATE_TPS:-1m}
case "$AT" in 16k|128k|1m) ;; *) echo "ABLATE_TPS=$AT: expected 16k, 128k or 1m" >&2; exit 2 ;; esac
# The seed of the ablation parts (their second seed: ABLATE_SEED=2); the compared runs are the tps parts' of that seed.
AS=${ABLATE_SEED:-1}
case "$AS" in [1-9]) ;; *) echo "ABLATE_SEED=$AS: expected a seed 1-9" >&2; exit 2 ;; esac
EVAL_TOKENS=${EVAL_TOKENS:-1048576}
mkdir -p "$RUNS" "$KEEP"
log=$KEEP/study.log
{ date -u; echo "part $part, binary $BIN"; cat $BUNDLE/BUILD.txt 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$log"

pack() { # the part's tarball from what is kept so far
  tar -czf "$OUT/study-$part.tar.gz.tmp" -C "$WORK/keep" "$part" && mv "$OUT/study-$part.tar.gz.tmp" "$OUT/study-$part.tar.gz"
}

keep_runs() { # prefix: copy the small files of runs/PREFIX-* into the kept folder
  for d in "$RUNS/$1"-*/; do
    [ -d "$d" ] || continue
    local k=$KEEP/runs/$(basename "$d"); mkdir -p "$k"
    cp "$d"/metrics.jsonl "$d"/config.json "$d"/summary.json "$d"/*.png "$k"/ 2>/dev/null
  done
  cp "$RUNS/$1"-compare*.png "$KEEP"/ 2>/dev/null
}

# Token shards once per part: train-00 for training, val.txt.xz for validation.
tok=$WORK/tokens
if [ ! -e "$tok/info-val.json" ]; then
  t0=$SECONDS
  $BIN tokenize $DATA/train-00.txt.xz -o "$tok" --split train >> "$log" 2>&1 &&
    $BIN tokenize $DATA/val.txt.xz -o "$tok" --split val >> "$log" 2>&1 || { echo "tokenizing failed" | tee -a "$log"; pack; exit 1; }
  echo "tokenized in $((SECONDS - t0)) s" >> "$log"
fi

status=0
# study_run NAME TPS SEED [train flags...]: one `sagebwd train` invocation (its --preset list and method
# flags in the flags), then its files into the tarball.
study_run() {
  local name=$1 tps=$2 seed=$3; shift 3
  local accum lr warm steps
  case $tps in
    16k) accum=1; lr=${LR16K:-2e-3} ;;
    128k) accum=8; lr=${LR128K:-3e-3} ;;
    1m) accum=64; lr=${LR1M:-4e-3} ;;
  esac
  steps=${STEPS:-$((TOKENS / (16384 * accum)))}
  if [ "$tps" = 1m ]; then warm=$((steps / 10 + 1)); else warm=$((steps / 20 + 1)); fi
  local eval_every=$((steps / 10)); [ "$eval_every" -ge 1 ] || eval_every=1
  echo "== $name: TPS $tps (accum $accum), $steps steps, lr $lr, warmup $warm, seed $seed, $*" | tee -a "$log"
  local t0=$SECONDS
  $BIN train "$tok" --device "$DEVICE" --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --accum $accum --steps "$steps" --lr "$lr" \
    --warmup "$warm" --eval-every "$eval_every" --eval-tokens "$EVAL_TOKENS" --ckpt-every 1000000 --seed "$seed" \
    --trace --name "$name" --runs-dir "$RUNS" --overwrite "$@" > "$KEEP/$name.log" 2>&1
  local rc=$?
  echo "   rc $rc, $((SECONDS - t0)) s" | tee -a "$log"
  grep -E "^[^ ]+: [0-9]+ steps|diverged|^note:|error" "$KEEP/$name.log" | tee -a "$log"
  [ $rc = 0 ] || status=1
  keep_runs "$name"
  pack
}

# diagnose_run RUN: the paper's Table 2 on that run's last checkpoint (CPU), all heads, one validation sequence.
diagnose_run() {
  local run=$RUNS/$1 t0=$SECONDS
  [ -e "$run/checkpoint.safetensors" ] || { echo "no checkpoint in $run" | tee -a "$log"; return; }
  $BIN diagnose "$run" --data "$tok" --preset sagebwd --plot "$KEEP/diagnose-$1.png" --json > "$KEEP/diagnose-$1.json" 2>> "$log"
  $BIN diagnose "$run" --data "$tok" --preset sagebwd --no-isolate > "$KEEP/diagnose-$1.txt" 2>> "$log"
  echo "diagnose $1: $((SECONDS - t0)) s" | tee -a "$log"
  pack
}

case "$part" in
  tps*-seed*)
    tps=${part#tps}; tps=${tps%-seed*}; seed=${part#*-seed}
    study_run "tps$tps-seed$seed" "$tps" "$seed" --preset fpa,sagebwd
    [ "$seed" = 1 ] && diagnose_run "tps$tps-seed$seed-sagebwd" ;;
  qknorm-off)
    study_run tps$AT-noqknorm-seed$AS $AT $AS --preset fpa,sagebwd --no-qk-norm ;;
  ablate-grads)
    study_run tps$AT-bf16grads-seed$AS $AT $AS --preset sagebwd --bf16 dq,dk
    study_run tps$AT-nosmoothk-seed$AS $AT $AS --preset sagebwd --smooth-k off ;;
  ablate-smoothq)
    study_run tps$AT-smoothq-seed$AS $AT $AS --preset sagebwd --smooth-q ;;
  smoke)
    # Every kind of run for a few steps: that they start, their kernels, their tokens/s.
    STEPS=8 EVAL_TOKENS=65536 study_run smoke 16k 1 --preset fpa,sagebwd
    STEPS=3 EVAL_TOKENS=65536 study_run smoke-1m 1m 1 --preset sagebwd
    STEPS=8 EVAL_TOKENS=65536 study_run smoke-noqknorm 16k 1 --preset sagebwd --no-qk-norm
    STEPS=8 EVAL_TOKENS=65536 study_run smoke-bf16grads 16k 1 --preset sagebwd --bf16 dq,dk
    STEPS=8 EVAL_TOKENS=65536 study_run smoke-nosmoothk 16k 1 --preset sagebwd --smooth-k off
    STEPS=8 EVAL_TOKENS=65536 study_run smoke-smoothq 16k 1 --preset sagebwd --smooth-q
    diagnose_run smoke-sagebwd ;;
esac
echo "done: status $status" | tee -a "$log"
pack
exit $status
