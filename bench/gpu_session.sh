#!/usr/bin/env bash
# On a lent GPU machine, in one call: install the carried wheels, build the native module, print
# `loadopt doctor`, then run bench/gpu_check.py (every GPU test and benchmark, one table at the end).
# Its whole output is also written to $OUT/gpu_check.log.
#
# Here first: bench/gpu_wheels.sh. Then the device tool's run, with carry [".whl"] and
#   command: bash bench/gpu_session.sh 330      (seconds for gpu_check; leaves time for a rerun)
set -uo pipefail
cd "$(dirname "$0")/.."
limit_s="${1:-330}"
log="${OUT:-/tmp}/gpu_check.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_session: the carried wheels (.whl/) did not install; run bench/gpu_wheels.sh here first"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 LOADOPT_CACHE=/tmp/loadopt-cache
# The native module is optional: without a C compiler loadopt uses its NumPy/OpenCV paths (doctor says which).
python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || tail -3 /tmp/build_ext.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$log"
COLUMNS=160 python3 -m loadopt doctor 2>&1 | tee -a "$log"
timeout "$limit_s" python3 bench/gpu_check.py 2>&1 | tee -a "$log"
echo "gpu_check exit: ${PIPESTATUS[0]} (124: stopped at ${limit_s} s)" | tee -a "$log"
