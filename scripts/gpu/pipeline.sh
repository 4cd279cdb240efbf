#!/usr/bin/env bash
# Everything the H200 verification runs, in order, each step logged with its time:
# flashinfer's JIT modules (scripts/gpu/prebuild.py), the fused-RoPE crossover
# (scripts/gpu/rope_crossover.py), the conformance suite of the flashinfer backends and the GPU
# tests (scripts/gpu/conformance.sh), then the benchmark. Started by
# scripts/gpu/verify.sh, which packs RUN_DIR; writes RUN_DIR/finished when done.
set -u
run_dir=${1:?usage: scripts/gpu/pipeline.sh RUN_DIR}
step() { echo "[$(date +%T) +${SECONDS}s] $*"; }

step "setup"
. scripts/gpu/setup.sh || exit 1
{
    nvidia-smi
    python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version)"
    nvcc --version | tail -1
    ninja --version
} >"$run_dir/env.txt" 2>&1

step "prebuild: every flashinfer module the conformance runs and the benchmark load"
python3 scripts/gpu/prebuild.py --budget "${PREBUILD_BUDGET:-1000}" >"$run_dir/prebuild.log" 2>&1
step "prebuild rc=$?"
tail -16 "$run_dir/prebuild.log"

step "fused RoPE crossover"
timeout 240 python3 scripts/gpu/rope_crossover.py "$run_dir/crossover" >"$run_dir/crossover.log" 2>&1
step "crossover rc=$?"
tail -16 "$run_dir/crossover.log"

step "conformance: flashinfer flashinfer-rope trt, GPU tests"
RUN_TIMEOUT=${RUN_TIMEOUT:-420} scripts/gpu/conformance.sh "$run_dir/conformance" \
    flashinfer flashinfer-rope trt gpu-tests
step "conformance done"

step "benchmark"
python3 -m attn_backends.bench --out "$run_dir/bench" --time-budget-s "${BENCH_BUDGET:-480}" \
    --iters 50 --warmup 10 >"$run_dir/bench.log" 2>&1
step "bench rc=$?"
tail -30 "$run_dir/bench.log"
touch "$run_dir/finished"
step "finished"
