#!/usr/bin/env bash
# A kernel variant without a rebuild: copies the sm_90a kernel cache of a device bundle (scripts/dev/mkbuild.sh) for one
# head dim and replaces one stage's cubin with the working tree's source of that stage compiled with extra -D options
# (scripts/dev/nvrtc_regs.py: the library's NVRTC options), under the bundle's own file name. The bundle's binary then
# runs the variant: `SAGEBWD_CACHE_DIR=$PWD/OUT dev/NAME/sagebwd bench ...` (the cache is looked up by file name only).
# Valid only while the variant keeps the kernels' names, parameters and shared-memory sizes (the host code is the
# bundle's); a variant that needs host changes needs its own bundle. Session 26 ran four d 128 backward variants from
# one 22 MB carry this way (docs/data/s26-2026-12-02/c4.sh), where two bundles did not fit the 64 MiB carry.
# Usage: bash scripts/dev/variant_cache.sh dev/NAME/cache OUT_DIR STAGE.cu HEAD_DIM [-DNAME=VALUE ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
base=${1:?usage: variant_cache.sh BASE_CACHE OUT_DIR STAGE.cu HEAD_DIM [-DNAME=VALUE ...]}
out=${2:?}; stage=${3:?}; d=${4:?}; shift 4
stem=${stage%.cu}
target=$(ls "$base"/"$stem"-sm_90a-d"$d"-*.cubin 2>/dev/null | head -1)
[ -n "$target" ] || { echo "no $stem-sm_90a-d$d-*.cubin in $base" >&2; exit 1; }
mkdir -p "$out"
cp "$base"/*-sm_90a-d"$d"-*.cubin "$out"/
LD_LIBRARY_PATH=$PWD/.cache/nvrtc/nvidia/cu13/lib python3 scripts/dev/nvrtc_regs.py "$stage" sm_90a "$d" "$@" \
  --cubin "$out/$(basename "$target")" | grep -E "spill|error" || true
echo "$out: $(basename "$target") = $stage at d $d ${*:-(no -D)}, from the working tree ($(git rev-parse --short HEAD)$(git diff --quiet -- crates/sagebwd-cuda/kernels || echo '+dirty'))"
