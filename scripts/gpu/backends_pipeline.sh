#!/usr/bin/env bash
# The verification of the two torch/FlashAttention-4 backends and of attention sinks on an
# H200, as one time-boxed pipeline for about 10 minutes of device time. Started by
# `PIPELINE=backends scripts/gpu/verify.sh OUT_DIR` after flash-attn-4 is installed into
# /tmp/site (../shared/gpu/fetch-fa4.sh's header says how); writes RUN_DIR/finished when done.
# What only the GPU can show goes first, independent steps side by side:
#
# 1. conformance of fa4 (the whole suite, sinks cases included), beside torch-varlen's and then
#    the build of flashinfer's fa3 bf16 modules for d64 and d128 (the comparison's kernels);
# 2. GPT-OSS with sinks on cuda through torch-varlen, fa4 and torch-sdpa against its own eager,
#    beside the GPU tests of torch-varlen and fa4 (long batches, no host sync, allocations);
# 3. TFLOP/s and host µs: flashinfer fa3, torch-varlen and fa4 through the API and raw, on the
#    embedding varlen batches first, then FlashAttention-3's paper grid.
set -u
run_dir=${1:?usage: scripts/gpu/backends_pipeline.sh RUN_DIR}
. scripts/gpu/pipeline_start.sh || exit 1
export PYTHONPATH="$PWD:$PWD/benchmarks:$PWD/plugins:${PYTHONPATH:-}"
# the CUTLASS DSL's `cutlass` package is reached through a .pth file, which a --target folder on
# PYTHONPATH never reads (../shared/gpu/README.md)
dsl=/tmp/site/nvidia_cutlass_dsl/dsl_packages
[ -d "$dsl" ] && export PYTHONPATH="$dsl:$PYTHONPATH"
export PYTHONUNBUFFERED=1
# FA4 keeps its compiled kernels on disk, so later processes reuse the suite's
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
python3 -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" \
    >>"$run_dir/env.txt" 2>&1
tail -1 "$run_dir/env.txt"

step "1. conformance of fa4, beside torch-varlen's and the fa3 bf16 build"
(
    RUN_TIMEOUT=150 scripts/gpu/conformance.sh "$run_dir/conformance-varlen" torch-varlen
    python3 benchmarks/gpu/prebuild.py --budget 150 --only '^fa3 bfloat16 d(64|128) posenc=NONE$' \
        >"$run_dir/prebuild-fa3.log" 2>&1
    step "prebuild fa3 rc=$? $(tail -1 "$run_dir/prebuild-fa3.log")"
) &
beside=$!
RUN_TIMEOUT=240 scripts/gpu/conformance.sh "$run_dir/conformance-fa4" fa4
wait "$beside"

step "2. sinks on cuda against GPT-OSS eager, beside the GPU tests of torch-varlen and fa4"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -k "varlen or fa4" \
    tests/gpu/test_nvidia_gpu.py >"$run_dir/gpu-nvidia.log" 2>&1 &
beside=$!
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rfEs tests/gpu/test_sinks_gpu.py \
    >"$run_dir/gpu-sinks.log" 2>&1
step "gpu sinks rc=$? $(tail -1 "$run_dir/gpu-sinks.log")"
grep -E "against fp32 eager|SKIPPED|FAILED" "$run_dir/gpu-sinks.log"
wait "$beside"
step "gpu nvidia rc=$? $(tail -1 "$run_dir/gpu-nvidia.log")"

step "3. TFLOP/s and host µs: varlen batches, then the FA3 grid"
timeout 200 python3 benchmarks/attention_tflops.py --out "$run_dir/tflops" \
    --seq-lens 1024,8192 >"$run_dir/tflops.log" 2>&1
step "tflops rc=$?"
grep '^|' "$run_dir/tflops.log" | tail -60
touch "$run_dir/finished"
step "finished"
