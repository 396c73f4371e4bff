#!/usr/bin/env bash
# Fetch the wheels a lent GPU machine lacks, here, where pip can download:  benchmarks/gpu_wheels.sh [--dali]
#
# That machine (device/KINDS.md: Python 3.12, torch 2.11 for CUDA 13, CuPy, cuFile, pyarrow, fsspec, typer,
# rich, OpenCV, torchvision) can fetch nothing. loadopt needs pydantic there, and the GDS checks need kvikio
# for CUDA 13; simplejpeg is the tuned torch variant's decoder. About 7 MB, into .whl/ (git-ignored).
#
# --dali also fetches DALI for CUDA 13 with what it needs there (about 270 MB) into .whl-dali/, cut into
# parts of 56 MiB, one folder each (.whl-dali/1, 2, ...): one call carries at most 64 MiB, so each part
# travels in its own short call (`bash benchmarks/gpu_session.sh stage N`, carry [".whl-dali/N"]) before the
# main one. Without it, gpu_check's DALI rows say DALI is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
fetch() {  # fetch DEST NAME...: wheels for the machine's Python 3.12, without their dependencies
  local dest="$1"; shift
  local platforms=()
  for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
  done
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "$@"
}
# pydantic and pydantic-core are released in lockstep: pin the pair loadopt is tested with.
fetch .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions \
  simplejpeg kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 "rapids-logger==0.3.*"
du -sh .whl
if [ "${1:-}" = "--dali" ]; then
  staging="$(mktemp -d)"
  trap 'rm -rf "$staging"' EXIT
  # nvidia-dali-cuda130's requirements that the machine does not have already (numpy, packaging, six do)
  fetch "$staging" nvidia-dali-cuda130==2.4.0 "nvidia-nvimgcodec-cu13>=0.9,<0.10" "nvidia-nvjpeg==13.*" \
    "nvidia-nvjpeg2k-cu13>=0.11,<0.12" "nvidia-nvtiff-cu13>=0.8,<0.9" nvidia-libnvcomp-cu13==5.3.0.16 \
    "astunparse<=1.6.3" "gast<=0.7.0" optree makefun "libcst~=1.8" nvtx
  rm -rf .whl-dali
  mkdir -p .whl-dali
  tar -C "$staging" -cf - . | split -b 56M -d -a 2 - .whl-dali/part-
  n=0
  for part in .whl-dali/part-*; do
    n=$((n + 1)); mkdir -p ".whl-dali/$n"; mv "$part" ".whl-dali/$n/"
  done
  echo "$n" > .whl-dali/1/parts  # the last part's stage call reassembles once it has them all
  du -sh .whl-dali; echo "DALI in $n parts: .whl-dali/1 .. .whl-dali/$n"
fi
