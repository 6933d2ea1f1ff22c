#!/usr/bin/env bash
# The sagebwd PyTorch op on the GPU (crates/sagebwd-py/tests/gpu_test.py): accuracy of the forward
# and every gradient against SDPA, errors, streams, torch.compile(fullgraph=True), speed and host
# overhead, peak memory, and a small Llama trained 50 steps with SDPA and sagebwd (if transformers
# wheels were carried). Under 4 minutes on an H100 with a warm kernel cache.
#
# 1. HERE:   bash scripts/gpu/python.sh --prepare
#            (the wheel into .whl/dist, transformers and its dependencies for CPython 3.12 into
#            .whl/extra; the kernel cache comes from scripts/gpu/bundle.sh, dev/bundle/cache)
# 2. DEVICE: carrying [".whl/dist", ".whl/extra", "dev/bundle"]:  bash scripts/gpu/python.sh
#    (BUNDLE=DIR for another bundle's kernel cache)
#    Results under $OUT/python/ (summary.json last, also printed).
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = "--prepare" ]; then
  set -e
  tools=.whl/tools
  if [ ! -x "$tools/bin/maturin" ]; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install --quiet maturin==1.16.0 ziglang==0.13.0
  fi
  rm -rf .whl/dist
  PATH="$PWD/$tools/bin:$PATH" nice "$tools/bin/maturin" build --release --strip --zig --compatibility manylinux_2_28 \
    -m crates/sagebwd-py/Cargo.toml -o .whl/dist --quiet --target-dir target/wheel
  rm -rf .whl/extra
  python3 -m pip download --quiet transformers==4.57.1 -d .whl/extra --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
  du -sh .whl/dist .whl/extra
  exit 0
fi

R=${OUT:-/tmp/sagebwd-python}/python
mkdir -p "$R"
py=${PYTHON:-python3}
venv=/tmp/sagebwd-py-venv
rm -rf "$venv"
# The device's torch is used as installed: a venv that sees the system site-packages.
$py -m venv --system-site-packages "$venv"
"$venv/bin/pip" install --quiet --no-index --no-deps .whl/dist/sagebwd-*.whl 2>&1 | tee "$R/install.txt"
if ls .whl/extra/transformers-*.whl > /dev/null 2>&1; then
  "$venv/bin/pip" install --quiet --no-index --find-links .whl/extra transformers 2>&1 | tee -a "$R/install.txt"
fi
BUNDLE=${BUNDLE:-dev/bundle}
[ -d "$BUNDLE/cache" ] && export SAGEBWD_CACHE_DIR=$PWD/$BUNDLE/cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/nvidia-smi.txt" 2>&1
timeout 230 "$venv/bin/python" crates/sagebwd-py/tests/gpu_test.py "$R"
rc=$?
echo "gpu_test.py exit status $rc" | tee -a "$R/log.txt"
exit $rc
