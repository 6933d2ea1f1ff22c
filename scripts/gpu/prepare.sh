#!/usr/bin/env bash
# Run HERE (no GPU needed): builds the GPU check binary and fills a kernel cache for the H200
# (sm_90a), both under dev/ (git-ignored), to be carried to the device machine
# (`run` with carry ["dev/bin/sagebwd-gpu-check", "dev/cache"]) where scripts/gpu/verify.sh uses them. Needs libnvrtc.so.13 on
# LD_LIBRARY_PATH for the precompile step (e.g. the nvidia-cuda-nvrtc==13.0.88 wheel).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p sagebwd-cuda --bin sagebwd-gpu-check
mkdir -p dev/bin dev/cache
cp target/release/sagebwd-gpu-check dev/bin/
strip dev/bin/sagebwd-gpu-check 2>/dev/null || true
SAGEBWD_CACHE_DIR=$PWD/dev/cache dev/bin/sagebwd-gpu-check --precompile sm_90a
du -sh dev/bin dev/cache
