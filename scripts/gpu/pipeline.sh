#!/usr/bin/env bash
# Everything the H200 verification runs, in order, each step logged with its time:
# flashinfer's JIT modules (benchmarks/gpu/prebuild.py), the GPU tests (tests/gpu, graph mode on
# a whole encoder included), the whole-encoder graph timing (scripts/gpu/graph_encoder.py; off
# with GRAPH_TIMING=0), the
# conformance suite of every CUDA backend (scripts/gpu/conformance.sh), the host-time profile
# (scripts/gpu/host_profile.py), then the benchmark
# (BENCH_ARGS are passed to it). Started by
# scripts/gpu/verify.sh, which packs RUN_DIR; writes RUN_DIR/finished when done.
set -u
run_dir=${1:?usage: scripts/gpu/pipeline.sh RUN_DIR}
. scripts/gpu/pipeline_start.sh || exit 1

step "prebuild: every flashinfer module the conformance runs and the benchmark load"
python3 benchmarks/gpu/prebuild.py --budget "${PREBUILD_BUDGET:-1000}" >"$run_dir/prebuild.log" 2>&1
step "prebuild rc=$?"
tail -16 "$run_dir/prebuild.log"

step "GPU tests: forward allocates and syncs nothing, RoPE kernel, graph mode on a whole encoder"
timeout "${GPU_TESTS_TIMEOUT:-360}" python3 -m pytest -q -p no:cacheprovider -o junit_family=xunit1 \
    --junitxml="$run_dir/gpu-tests.xml" tests/gpu \
    "tests/test_nvidia_backends.py::test_fake_signatures_match_real_flashinfer" \
    >"$run_dir/gpu-tests.log" 2>&1
step "gpu tests rc=$?"
tail -5 "$run_dir/gpu-tests.log"

if [ "${GRAPH_TIMING:-1}" = 1 ]; then
    step "graph mode timing on a whole encoder"
    timeout 240 python3 scripts/gpu/graph_encoder.py "$run_dir/graph_encoder.json" \
        >"$run_dir/graph_encoder.log" 2>&1
    step "graph encoder rc=$?"
    tail -8 "$run_dir/graph_encoder.log"
fi

step "conformance: flashinfer flashinfer-rope trt torch-sdpa headwise"
RUN_TIMEOUT=${RUN_TIMEOUT:-420} scripts/gpu/conformance.sh "$run_dir/conformance" \
    flashinfer flashinfer-rope trt torch-sdpa headwise
step "conformance done"

step "where forward's host time goes"
timeout 120 python3 scripts/gpu/host_profile.py "$run_dir/host_profile.json" \
    >"$run_dir/host_profile.log" 2>&1
step "host profile rc=$?"
head -12 "$run_dir/host_profile.log"

step "benchmark"
python3 benchmarks/bench.py --out "$run_dir/bench" ${BENCH_ARGS:-} \
    >"$run_dir/bench.log" 2>&1
step "bench rc=$?"
tail -30 "$run_dir/bench.log"
touch "$run_dir/finished"
step "finished"
