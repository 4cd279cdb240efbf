#!/usr/bin/env bash
# The verification of the two torch/FlashAttention-4 backends and of attention sinks on an
# H200, as one time-boxed pipeline. Started by `PIPELINE=backends scripts/gpu/verify.sh OUT_DIR`
# after flash-attn-4 is installed into /tmp/site (../shared/gpu/fetch-fa4.sh's header says how);
# writes RUN_DIR/finished when done. What only the GPU can show goes first:
#
# 1. conformance of fa4 and torch-varlen (the whole suites, sinks cases included), beside the
#    build of flashinfer's fa3 bf16 modules for d64 and d128 (the comparison's kernels);
# 2. GPT-OSS with sinks on cuda through torch-varlen, fa4 and torch-sdpa against its own eager;
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
python3 -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" \
    >>"$run_dir/env.txt" 2>&1
tail -1 "$run_dir/env.txt"

# FA4 keeps its compiled kernels on disk, so the benchmark's process reuses the suite's
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1

step "1. conformance of fa4, beside torch-varlen's and the fa3 bf16 build"
(
    RUN_TIMEOUT=300 scripts/gpu/conformance.sh "$run_dir/conformance-varlen" torch-varlen
    python3 scripts/gpu/prebuild.py --budget 300 --only '^fa3 bfloat16 d(64|128) posenc=NONE$' \
        >"$run_dir/prebuild-fa3.log" 2>&1
    step "prebuild fa3 rc=$? $(tail -1 "$run_dir/prebuild-fa3.log")"
) &
beside=$!
RUN_TIMEOUT=420 scripts/gpu/conformance.sh "$run_dir/conformance-fa4" fa4
wait "$beside"

step "2. sinks on cuda against GPT-OSS eager"
timeout 240 python3 -m pytest -q -s -p no:cacheprovider -rfEs tests/gpu/test_sinks_gpu.py \
    >"$run_dir/gpu-sinks.log" 2>&1
step "gpu sinks rc=$? $(tail -1 "$run_dir/gpu-sinks.log")"
grep -E "against fp32 eager|SKIPPED|FAILED" "$run_dir/gpu-sinks.log"

step "2b. GPU tests of torch-varlen and fa4 (numbers on long batches, no host sync, allocations)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -k "varlen or fa4" \
    tests/gpu/test_nvidia_gpu.py >"$run_dir/gpu-nvidia.log" 2>&1
step "gpu nvidia rc=$? $(tail -1 "$run_dir/gpu-nvidia.log")"

step "3. TFLOP/s and host µs: varlen batches, then the FA3 grid"
timeout 420 python3 benchmarks/attention_tflops.py --out "$run_dir/tflops" \
    >"$run_dir/tflops.log" 2>&1
step "tflops rc=$?"
grep '^|' "$run_dir/tflops.log" | tail -60
touch "$run_dir/finished"
step "finished"
