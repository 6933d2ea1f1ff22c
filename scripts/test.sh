#!/usr/bin/env bash
# Runs the whole test suite. No GPU needed: the CUDA kernels are compiled (not run) with NVRTC from
# pinned pip wheels, installed once into .cache/nvrtc.
set -euo pipefail
cd "$(dirname "$0")/.."

nvrtc_dir=.cache/nvrtc
if [ ! -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  echo "installing NVRTC 13.0 (pip wheels) into $nvrtc_dir ..."
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$nvrtc_dir" \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
export LD_LIBRARY_PATH="$PWD/$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_HOME="${CUDA_HOME:-$PWD/$nvrtc_dir/nvidia/cu13}"
# The kernel compile test fails (instead of skipping) when NVRTC cannot be loaded.
export SAGEBWD_REQUIRE_NVRTC=1

# Formatting (rustfmt.toml) and lints: a diff or a clippy warning fails the suite.
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --quiet -- -D warnings

# The README's main command must resolve to the `sagebwd` binary from the repository root.
cargo run --release --quiet -- train --help > /dev/null

# The benchmark comparison's parsing (no GPU, standard library only).
python3 scripts/gpu/test_compare.py

# The Python package: wheel built, installed in a fresh venv, tested without GPU or PyTorch.
NVRTC_LIB_DIR="$PWD/$nvrtc_dir/nvidia/cu13/lib" scripts/test_python.sh

cargo test --workspace --release "$@"
