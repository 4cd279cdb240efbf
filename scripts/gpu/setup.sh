# Prepare the offline H200 machine for the NVIDIA backends. Source it from the repository root
# at the start of every command that uses flashinfer:
#
#     . scripts/gpu/setup.sh
#
# It installs flashinfer and its loader from .whl/ into /tmp/site and this package in editable
# mode (entry points need installed metadata), each only when missing, and exports what
# flashinfer's JIT needs. prebuild.py, the conformance run and the benchmark must all run with
# these exports: the JIT cache directory and the modules' build files depend on them, and a
# change would rebuild every module. Cheap when everything is in place (no Python import);
# never exits the calling shell, but returns non-zero when something failed.

_ab_root=$(pwd)
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_CUDA_ARCH_LIST="9.0a"  # sm90a: fa3 and FMHA v2's warp-specialized kernels
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # ninja -j for flashinfer's JIT builds
# flashinfer's JIT cache: in the git-ignored build/ of the checkout unless already set (a run
# that warmed up through the README's commands shares its cache this way).
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$_ab_root/build/gpu-cache}"
export FLASHINFER_NO_DOWNLOAD=1  # offline: fail at once instead of trying to fetch kernels

_ab_setup() {
    local installed=0
    if [ ! -d /tmp/site/flashinfer ]; then
        echo "setup: installing flashinfer from .whl/ into /tmp/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            "$_ab_root"/.whl/*.whl || return 1
        installed=1
    fi
    if ! python3 -m pip show attn-backends 2>/dev/null \
        | grep -qx "Editable project location: $_ab_root"; then
        echo "setup: installing attn-backends (editable)"
        python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "$_ab_root" \
            || return 1
        installed=1
    fi
    [ "$installed" = 1 ] || [ "${AB_SETUP_VERIFY:-0}" = 1 ] || return 0
    python3 - <<'EOF'
import importlib.metadata as md

import flashinfer  # noqa: F401  (the import itself is the check)
import torch

from attn_backends import detect_platform
from attn_backends.deploy import get_registry

names = [e.backend.name for e in get_registry().entries()]
missing = {"flashinfer", "flashinfer-rope", "trt", "headwise"} - set(names)
print(f"setup: torch {torch.__version__}, flashinfer {md.version('flashinfer-python')}, "
      f"platform {detect_platform()}, backends {', '.join(names)}")
if missing:
    raise SystemExit(f"setup: backends not registered: {sorted(missing)}")
EOF
}
_ab_setup
_ab_status=$?
unset -f _ab_setup
[ "$_ab_status" = 0 ] || echo "setup: FAILED (see above)" >&2
[ "$_ab_status" = 0 ]  # the status of `. scripts/gpu/setup.sh`, so `&&` chains stop on failure
