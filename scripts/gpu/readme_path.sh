#!/usr/bin/env bash
# The README's "On a GPU" path, on an offline maintainer's machine, from the repository root:
#
#     scripts/gpu/readme_path.sh OUT_DIR [PRESET]
#
# The machine has no package index, so the first README command is replaced by installing the
# wheels carried in .whl/ (flashinfer and its loader; flashinfer's other requirements must be
# there already) and this checkout, both without dependency resolution. The README's next
# commands then run verbatim: list, warmup (which prints the cache location, the modules left
# to build with an estimate, and progress while they compile) and check on cuda. Everything is
# logged to OUT_DIR/readme_path.log with the time each command took.
set -u
out=${1:?usage: scripts/gpu/readme_path.sh OUT_DIR [PRESET]}
preset=${2:-qwen3-embedding-0.6b}
mkdir -p "$out"
log="$out/readme_path.log"
step() {
    local start=$SECONDS
    echo "\$ $*" | tee -a "$log"
    "$@" >>"$log" 2>&1
    local rc=$?
    echo "rc=$rc $((SECONDS - start))s" | tee -a "$log"
    return $rc
}
step python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
step python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
step python3 -m pip show flashinfer-python attn-backends
step attn-backends list
step attn-backends warmup --preset "$preset"
step attn-backends warmup --preset "$preset"  # idempotent: every module found built
step attn-backends check --preset "$preset" --device cuda
