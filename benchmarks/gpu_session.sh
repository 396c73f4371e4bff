#!/usr/bin/env bash
# On a lent GPU machine, in one call: install the carried wheels, build the native module, print
# `loadopt doctor`, then run benchmarks/gpu_check.py (every GPU test and benchmark, one table at the end).
# Its whole output is also written to $OUT/gpu_check.log.
#
# Here first: benchmarks/gpu_wheels.sh [--dali]. Then the device tool's run:
#   with --dali, one short call per part first (the machine stays warm 30 s between calls):
#     carry [".whl-dali/N"], command: bash benchmarks/gpu_session.sh stage N      (N = 1, 2, ...)
#   then carry [".whl"], command: bash benchmarks/gpu_session.sh 330   (seconds for gpu_check; leaves a rerun)
set -uo pipefail
cd "$(dirname "$0")/.."
parts=/tmp/dali-parts
if [ "${1:-}" = "stage" ]; then  # keep one part of DALI's wheels on this machine until the main call
  mkdir -p "$parts" && cp ".whl-dali/$2/"* "$parts/" || { echo "gpu_session: .whl-dali/$2 was not carried"; exit 1; }
  echo "gpu_session: DALI part $2 of $(cat "$parts/parts" 2>/dev/null || echo '?') kept in $parts"
  exit 0
fi
limit_s="${1:-330}"
log="${OUT:-/tmp}/gpu_check.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_session: the carried wheels (.whl/) did not install; run benchmarks/gpu_wheels.sh here first"; exit 1; }
if [ -f "$parts/parts" ]; then
  if [ "$(ls "$parts"/part-* | wc -l)" = "$(cat "$parts/parts")" ]; then
    mkdir -p /tmp/dali-wheels && cat "$parts"/part-* | tar -C /tmp/dali-wheels -xf - \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        /tmp/dali-wheels/*.whl && echo "gpu_session: DALI installed from $(cat "$parts/parts") parts"
  else
    echo "gpu_session: only $(ls "$parts"/part-* | wc -l) of $(cat "$parts/parts") DALI parts here: DALI not installed"
  fi
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 LOADOPT_CACHE=/tmp/loadopt-cache
# The native module is optional: without a C compiler loadopt uses its NumPy/OpenCV paths (doctor says which).
python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || tail -3 /tmp/build_ext.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$log"
COLUMNS=160 python3 -m loadopt doctor 2>&1 | tee -a "$log"
timeout "$limit_s" python3 benchmarks/gpu_check.py 2>&1 | tee -a "$log"
echo "gpu_check exit: ${PIPESTATUS[0]} (124: stopped at ${limit_s} s)" | tee -a "$log"
