#!/usr/bin/env bash
# Fetch the wheels a lent GPU machine lacks into .whl/ (git-ignored), here, where pip can download.
#
# That machine (device/KINDS.md: Python 3.12, torch 2.11 for CUDA 13, CuPy, cuFile, pyarrow, fsspec, typer,
# rich, OpenCV) can fetch nothing. loadopt needs pydantic there, and the GDS checks need kvikio for CUDA 13;
# simplejpeg is the tuned torch variant's decoder. About 7 MB in all: a call carries at most 64 MiB, so
# DALI (nvidia-dali-cuda130 is 199 MB with nvImageCodec beside it) stays behind and its GPU rows say so.
# Then run the checks there in one call: see bench/gpu_session.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
# pydantic and pydantic-core are released in lockstep: pin the pair loadopt is tested with.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions \
  simplejpeg kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 "rapids-logger==0.3.*"
du -sh .whl
