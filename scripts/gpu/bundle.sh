#!/usr/bin/env bash
# The device bundle: everything a GPU machine needs to run scripts/gpu/{verify,bench,train,all}.sh from a checkout,
# built HERE (no GPU needed) so that the device spends no time compiling.
#
#   bash scripts/gpu/bundle.sh [--out DIR] [--corpus] [--head-dim D] [--compact]
#       DIR (default dev/bundle, git-ignored) gets the stripped release binaries `sagebwd` and `sagebwd-gpu-check`,
#       their sm_90a kernel cache for head dims 64 and 128 (cache/), and BUILD.txt (the commit and any uncommitted
#       change under crates/: the device copy has no git). ~16 MB. --corpus adds the Gutenberg train-00 and val shards
#       (46 MB of xz, from ../shared/data/gutenberg) as DIR/data/ for `train.sh corpus`.
#       Then on the GPU machine, carrying [DIR]: bash scripts/gpu/verify.sh, bench.sh, train.sh MODES or all.sh
#       (each reads DIR = dev/bundle unless BUNDLE=DIR is set).
#       --head-dim D keeps only head dim D's kernels (the study's models are d 64); --compact stores both binaries
#       xz-compressed (16 → ~4.5 MB; the device scripts unpack them, scripts/gpu/unpack.sh), so that the corpus and
#       the kernel check fit one 64 MiB carry with the tree: one call can run a study part and gpu-check.
#
#   bash scripts/gpu/bundle.sh --variant DIR NAME STAGE.cu HEAD_DIM [-DNAME=VALUE ...]
#       A kernel variant without a second bundle: DIR/cache-NAME = a copy of DIR/cache's sm_90a cubins of that head
#       dim with STAGE.cu (a file of crates/sagebwd-cuda/kernels, from the working tree) compiled with the extra -D
#       options, under the bundle's own cache file name. `SAGEBWD_CACHE_DIR=$PWD/DIR/cache-NAME DIR/sagebwd bench ...`
#       then runs the variant (the cache is looked up by file name). Valid only while the variant keeps the kernels'
#       names, parameters and shared-memory sizes (the host code is the bundle's). Uses lab/kernels/nvrtc_regs.py.
#
# Needs the NVRTC wheels that scripts/test.sh installs into .cache/nvrtc (or libnvrtc.so.13 on LD_LIBRARY_PATH).
# ~1.5 min after a release build, ~4.5 min from a cold target/ on two cores.
set -euo pipefail
cd "$(dirname "$0")/../.."

nvrtc=$PWD/.cache/nvrtc/nvidia/cu13
if [ -e "$nvrtc/lib/libnvrtc.so.13" ]; then
  export LD_LIBRARY_PATH="$nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_HOME=${CUDA_HOME:-$nvrtc}
fi

usage() { sed -n '2,24p' "$0"; exit "${1:-0}"; }

variant() {
  local dir=${1:?} name=${2:?} stage=${3:?} d=${4:?}; shift 4
  local stem=${stage%.cu} target
  target=$(ls "$dir"/cache/"$stem"-sm_90a-d"$d"-*.cubin 2>/dev/null | head -1)
  [ -n "$target" ] || { echo "error: no $stem-sm_90a-d$d-*.cubin in $dir/cache (build the bundle first)" >&2; exit 1; }
  local out=$dir/cache-$name
  rm -rf "$out"; mkdir -p "$out"
  cp "$dir"/cache/*-sm_90a-d"$d"-*.cubin "$out"/
  python3 lab/kernels/nvrtc_regs.py "$stage" sm_90a "$d" "$@" --cubin "$out/$(basename "$target")" | grep -E "spill|error" || true
  echo "$out: $(basename "$target") = $stage at d $d ${*:-(no -D)}, from the working tree" \
    "($(git rev-parse --short HEAD)$(git diff --quiet -- crates/sagebwd-cuda/kernels || echo '+dirty'))" | tee "$out/VARIANT.txt"
}

out=dev/bundle corpus=0 compact=0 only_d=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift ;;
    --corpus) corpus=1 ;;
    --compact) compact=1 ;;
    --head-dim) only_d=${2:?--head-dim needs 64 or 128}; shift ;;
    --variant) shift; variant "$@"; exit 0 ;;
    -h|--help) usage ;;
    *) echo "error: unknown option $1" >&2; usage 2 ;;
  esac
  shift
done

[ -e "$nvrtc/lib/libnvrtc.so.13" ] \
  || echo "note: no NVRTC in .cache/nvrtc ('bash scripts/test.sh' installs it): the precompile needs libnvrtc.so.13" >&2
cargo build --release --quiet -p sagebwd-cli -p sagebwd-cuda --bins
rm -rf "$out"; mkdir -p "$out/cache"
cp target/release/sagebwd target/release/sagebwd-gpu-check "$out/"
strip "$out/sagebwd" "$out/sagebwd-gpu-check" 2>/dev/null || true
SAGEBWD_CACHE_DIR=$PWD/$out/cache "$out/sagebwd-gpu-check" --precompile sm_90a
{ echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)"; git status --short crates/ | sed 's/^/  /'; } \
  > "$out/BUILD.txt"
if [ -n "$only_d" ]; then
  ls "$out"/cache/*-d"$only_d"-*.cubin > /dev/null 2>&1 || { echo "error: no d $only_d kernels in $out/cache" >&2; exit 1; }
  find "$out/cache" -name '*.cubin' ! -name "*-d$only_d-*" -delete
fi
if [ $compact = 1 ]; then
  xz -9 -T0 -f "$out/sagebwd" "$out/sagebwd-gpu-check"
fi
if [ $corpus = 1 ]; then
  mkdir -p "$out/data"
  cp ../shared/data/gutenberg/train-00.txt.xz ../shared/data/gutenberg/val.txt.xz "$out/data/"
fi
du -sh "$out"
echo "carry [\"$out\"] to the GPU machine; there: bash scripts/gpu/verify.sh | bench.sh | train.sh MODES | all.sh" \
  "$([ "$out" = dev/bundle ] || echo "(with BUNDLE=$out)")"
