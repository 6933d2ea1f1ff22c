#!/usr/bin/env bash
# The Python package in CI (no GPU): builds the abi3 manylinux wheel with maturin (zig as the linker,
# for glibc 2.28 compatibility), installs it into a fresh venv, imports it and runs the tests that
# need neither a GPU nor PyTorch (crates/sagebwd-py/tests/test_no_gpu.py), then, in a venv with PyTorch,
# the PyTorch layer on fake tensors (test_torch_cpu.py); the op itself is tested on the GPU
# (scripts/gpu/python.sh). Tools pinned; everything from PyPI and crates.io. Own target dir (target/wheel):
# the zig linker settings would otherwise change the fingerprints of the workspace build.
set -euo pipefail
cd "$(dirname "$0")/.."

tools=.whl/tools
dist=.whl/dist
if [ ! -x "$tools/bin/maturin" ] || [ ! -e "$tools/.pinned-1" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install --quiet --disable-pip-version-check maturin==1.16.0 ziglang==0.13.0
  touch "$tools/.pinned-1"
fi
rm -rf "$dist"
# maturin finds zig through the venv's python (`python -m ziglang`).
PATH="$PWD/$tools/bin:$PATH" nice "$tools/bin/maturin" build --release --strip --zig --compatibility manylinux_2_28 \
  -m crates/sagebwd-py/Cargo.toml -o "$dist" --quiet --target-dir target/wheel
wheel=$(ls "$dist"/sagebwd-*-cp39-abi3-manylinux_2_28_x86_64.whl)
echo "built $wheel ($(du -h "$wheel" | cut -f1))"

venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$wheel"
(cd crates/sagebwd-py/tests && "$venv/bin/python" -c "import sagebwd; print('imported', sagebwd.__name__, sagebwd.PRESETS)" &&
  SAGEBWD_TEST_NVRTC_DIR="${NVRTC_LIB_DIR:-}" "$venv/bin/python" -m unittest -v test_no_gpu)

# The PyTorch layer without a GPU (crates/sagebwd-py/tests/test_torch_cpu.py): the ops' schemas, errors on real
# tensors, fake-tensor shapes and one dynamo graph without breaks. torch pinned to the device's version; PyPI's wheel
# is the CUDA build (~4.6 GB installed with its nvidia wheels, ~1.5 min here) and imports without a GPU. Its own venv,
# kept in .cache (test_no_gpu checks the package without torch).
torch_venv=$PWD/.cache/torch-venv
if [ ! -e "$torch_venv/.pinned-2.11.0" ]; then
  rm -rf "$torch_venv"
  python3 -m venv "$torch_venv"
  "$torch_venv/bin/pip" install --quiet --disable-pip-version-check torch==2.11.0
  touch "$torch_venv/.pinned-2.11.0"
fi
"$torch_venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"
(cd crates/sagebwd-py/tests && "$torch_venv/bin/python" -m unittest -v test_torch_cpu)
