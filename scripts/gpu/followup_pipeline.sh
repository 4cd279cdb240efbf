#!/usr/bin/env bash
# The H200 runs that the round pipeline (scripts/gpu/round_pipeline.sh) left undone or that
# changed after it, as one pipeline for one 30-minute device budget. Started by
# `PIPELINE=followup scripts/gpu/verify.sh OUT_DIR`; writes RUN_DIR/finished when done. Every
# step is time-boxed; what nothing else can show goes first.
#
# 1. the build of the bf16 flashinfer modules, beside the model zoo in bf16 on cuda with heads
#    of 16 (served by flex and torch-sdpa, which need no flashinfer JIT);
# 2. timing, with nothing else running: the serving benchmark (query batches first: the graph
#    runner against torch.compile's buckets), then whole models (local layers first), the mask
#    check's share of a packed forward reported for each;
# 3. tests/gpu/test_nvidia_gpu.py (the separate-(q, k, v) allocation test was fixed after the
#    round), beside the zoo with heads of 64 (served by flashinfer);
# 4. trt's conformance while time remains (its FMHA v2 modules build on first use).
set -u
run_dir=${1:?usage: scripts/gpu/followup_pipeline.sh RUN_DIR}
. scripts/gpu/pipeline_start.sh || exit 1
export PYTHONPATH="$PWD:$PWD/benchmarks:$PWD/plugins:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1

serving() {  # serving MODEL TIMEOUT
    timeout "$2" python3 benchmarks/serving_bench.py --out "$run_dir/serving-$1" --models "$1" \
        --repeats 20 --workloads "queries 8,queries 1,queries 32,documents" \
        >"$run_dir/serving-$1.log" 2>&1
    step "serving $1 rc=$?"
    grep '^|' "$run_dir/serving-$1.log" | tail -20
}

step "1. prebuild of the bf16 modules, beside the zoo (d16)"
zoo zoo-d16 16 280 &
beside=$!
python3 benchmarks/gpu/prebuild.py --budget 400 \
    --only "$BF16_MODULES" \
    >"$run_dir/prebuild-bf16.log" 2>&1
step "prebuild bf16 rc=$?"
tail -12 "$run_dir/prebuild-bf16.log"
wait "$beside"

step "2. timing: serving (queries first), whole models"
serving bge-m3 240
e2e embeddinggemma modernbert
serving qwen3 200
e2e xlmr qwen3

step "3. test_nvidia_gpu, beside the zoo (d64)"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -k "not trt" \
    -o junit_family=xunit1 --junitxml="$run_dir/gpu-test_nvidia_gpu.xml" \
    tests/gpu/test_nvidia_gpu.py >"$run_dir/gpu-test_nvidia_gpu.log" 2>&1 &
beside=$!
zoo zoo-d64 64 300
wait "$beside"
step "gpu test_nvidia_gpu rc=$? $(tail -1 "$run_dir/gpu-test_nvidia_gpu.log")"

step "4. trt conformance"
RUN_TIMEOUT=500 scripts/gpu/conformance.sh "$run_dir/conformance-trt" trt
touch "$run_dir/finished"
step "finished"
