#!/usr/bin/env bash
# Builds a device bundle in dev/NAME (git-ignored) to `carry` to the GPU: the stripped release `sagebwd` and
# `sagebwd-gpu-check` binaries and their sm_90a kernel cache (both head dims), so the device call spends no
# time in NVRTC. Needs the NVRTC wheels that scripts/test.sh installs into .cache/nvrtc. ~16 MB; ~1.5 min after a
# release build, ~4.5 min from a cold target/ on this 2-core machine.
# Usage: bash scripts/dev/mkbuild.sh NAME
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: mkbuild.sh NAME}
out=dev/$name
nvrtc=$PWD/.cache/nvrtc/nvidia/cu13
[ -e "$nvrtc/lib/libnvrtc.so.13" ] || { echo "no NVRTC in .cache/nvrtc: run scripts/test.sh once (it installs the wheels)" >&2; exit 1; }
cargo build --release --quiet -p sagebwd-cli -p sagebwd-cuda --bins
rm -rf "$out"; mkdir -p "$out/cache"
cp target/release/sagebwd target/release/sagebwd-gpu-check "$out/"
strip "$out/sagebwd" "$out/sagebwd-gpu-check"
LD_LIBRARY_PATH=$nvrtc/lib CUDA_HOME=$nvrtc SAGEBWD_CACHE_DIR=$PWD/$out/cache "$out/sagebwd-gpu-check" --precompile sm_90a
echo "$out: $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty'), $(du -sh "$out" | cut -f1)"
git rev-parse HEAD > "$out/COMMIT"; git diff > "$out/DIRTY.patch"
