#!/usr/bin/env bash
# Adds to .fa4c/ what ../shared/gpu/fetch-fa4.sh leaves out and flash-attn-4 needs to import:
#   nvidia-cutlass-dsl-libs-core 4.8.1  the CuTe DSL's Python layer (``cutlass``, ``cutlass.cute``);
#                                       libs-base 4.8.1 requires it, and no other wheel holds it
#   cuda-bindings 13, cuda-pathfinder   libs-base's requirement (installed only where the image
#   protobuf                            lacks them: see install-fa4.sh)
# and moves the tail of .fa4b's part of the CUDA-13 library wheel into .fa4c: the 64 MiB a call
# may carry count the working tree too, and 60 MiB beside it do not fit (`SECOND` below).
# Run it from the project root after ../shared/gpu/fetch-fa4.sh.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .fa4c ] || { echo "run ../shared/gpu/fetch-fa4.sh first (no .fa4c/)" >&2; exit 1; }
SECOND=52  # MiB of the wheel in .fa4b; .fa4a keeps its 22
if [ "$(stat -c %s .fa4b/cu13.p1)" -gt $((SECOND * 1048576)) ]; then
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    cat .fa4b/cu13.p1 .fa4c/cu13.p2 > "$tmp/rest"
    dd if="$tmp/rest" of=.fa4b/cu13.p1 bs=1M count=$SECOND status=none
    dd if="$tmp/rest" of=.fa4c/cu13.p2 bs=1M skip=$SECOND status=none
fi
mkdir -p .fa4c/deps
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .fa4c nvidia-cutlass-dsl-libs-core==4.8.1
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .fa4c/deps \
  "cuda-bindings>=13,<14" cuda-pathfinder "protobuf>=4.21.12"
du -sh .fa4a .fa4b .fa4c
