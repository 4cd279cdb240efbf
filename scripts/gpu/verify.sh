#!/usr/bin/env bash
# One device call of the H200 verification, within a 10-minute slot. From the repository root:
#
#     scripts/gpu/verify.sh a OUT_DIR   # flashinfer modules, native RoPE kernel, conformance of
#                                       # torch-sdpa, flashinfer, flashinfer-rope, headwise, GPU tests
#     scripts/gpu/verify.sh b OUT_DIR   # FMHA v2 modules, conformance of trt, the benchmark
#
# Phase b reuses phase a's JIT cache when the machine is still the same; otherwise it builds the
# modules the benchmark needs. Every step has a deadline so the call ends with its logs written;
# with PACK_TO=DIR the whole OUT_DIR is packed into DIR/<phase>.tgz on exit (the device tool
# brings back only a few files).
set -u
phase=${1:?usage: scripts/gpu/verify.sh a|b OUT_DIR}
out=${2:?usage: scripts/gpu/verify.sh a|b OUT_DIR}
budget=${BUDGET:-560}
mkdir -p "$out"
if [ -n "${PACK_TO:-}" ]; then
    trap 'tar czf "$PACK_TO/$phase.tgz" -C "$(dirname "$out")" "$(basename "$out")"' EXIT
fi
exec > >(tee -a "$out/verify.log") 2>&1
left() { echo $((budget - SECONDS)); }
step() { echo "[$(date +%T) +${SECONDS}s] $*"; }

step "setup"
. scripts/gpu/setup.sh
{
    nvidia-smi
    python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version)"
    nvcc --version | tail -1
} >"$out/env.txt" 2>&1

case $phase in
a)
    step "prebuild flashinfer modules (no FMHA v2), native kernel build, headwise conformance"
    timeout $(($(left) - 210)) python3 scripts/gpu/prebuild.py --skip fmha_v2 \
        --budget $(($(left) - 220)) >"$out/prebuild.log" 2>&1 &
    prebuild=$!
    timeout 300 python3 -c "from attn_backends import _native; _native.load(); print('native kernel built')" \
        >"$out/native-build.log" 2>&1 &
    native=$!
    timeout $(($(left) - 40)) scripts/gpu/conformance.sh "$out/conformance-headwise" headwise &
    headwise=$!
    wait "$native"; step "native build rc=$?"
    wait "$prebuild"; step "prebuild rc=$?"
    tail -15 "$out/prebuild.log"
    step "rope kernel numerics and bandwidth"
    timeout $(($(left) - 140)) python3 scripts/gpu/rope_kernel.py "$out/rope" >"$out/rope.log" 2>&1
    step "rope rc=$?"; tail -25 "$out/rope.log"
    step "conformance torch-sdpa flashinfer flashinfer-rope gpu-tests"
    timeout $(($(left) - 20)) scripts/gpu/conformance.sh "$out/conformance" \
        torch-sdpa flashinfer flashinfer-rope gpu-tests
    wait "$headwise"; step "headwise rc=$?"
    cat "$out/conformance-headwise/summary.txt" 2>/dev/null
    ;;
b)
    step "prebuild FMHA v2 and the benchmark's flashinfer modules"
    timeout $(($(left) - 230)) python3 scripts/gpu/prebuild.py --skip "fa3 float16" \
        --skip "fa2 float16" --budget $(($(left) - 240)) >"$out/prebuild.log" 2>&1
    step "prebuild rc=$?"; tail -15 "$out/prebuild.log"
    step "conformance trt"
    timeout 90 scripts/gpu/conformance.sh "$out/conformance-trt" trt
    step "benchmark"
    timeout $(($(left) - 10)) python3 -m attn_backends.bench --out "$out/bench" \
        --time-budget-s $(($(left) - 60)) --iters 50 --warmup 10 2>"$out/bench.log"
    step "bench rc=$?"
    ;;
*) echo "unknown phase $phase" ;;
esac
step "done"
