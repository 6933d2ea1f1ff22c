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
# The device's torch lives in its own virtual environment (/opt/torch/.venv, first on PATH): a venv made from it would
# not see its packages, so the wheels go into a folder on PYTHONPATH instead, without their dependencies (torch and
# numpy are the environment's).
site=/tmp/sagebwd-py-site
rm -rf "$site"
"$py" -m pip install --quiet --no-index --no-deps --target "$site" .whl/dist/sagebwd-*.whl 2>&1 | tee "$R/install.txt"
for w in $(ls .whl/extra/*.whl 2>/dev/null); do
  case "$(basename "$w")" in numpy-*) "$py" -c 'import numpy' 2>/dev/null && continue ;; esac
  "$py" -m pip install --quiet --no-index --no-deps --target "$site" "$w" 2>&1 | tee -a "$R/install.txt"
done
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
BUNDLE=${BUNDLE:-dev/bundle}
[ -d "$BUNDLE/cache" ] && export SAGEBWD_CACHE_DIR=$PWD/$BUNDLE/cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/nvidia-smi.txt" 2>&1
timeout "${TIMEOUT:-230}" "$py" crates/sagebwd-py/tests/gpu_test.py "$R" ${PARTS:-}
rc=$?
echo "gpu_test.py exit status $rc" | tee -a "$R/log.txt"
exit $rc
