#!/usr/bin/env bash
# Issue 16's GPU measurements in one run (about 8 minutes on an H200); see scripts/gpu_measure.py.
# On the GPU machine, from the project root. TRL, Liger, hydra... come from the GPU check kit's wheels
# when they are carried in .gpu-check/whl (bash ../shared/gpu/setup.sh prepares them); results in $OUT.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
mkdir -p "${OUT:=/tmp/out}"
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ -d .gpu-check/whl ] && [ ! -d /tmp/site/trl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu-check/whl/*.whl 2>&1 | tail -3
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
python3 scripts/gpu_measure.py 2>&1 | tee "$OUT/gpu_measure.log"
