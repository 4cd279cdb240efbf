#!/usr/bin/env bash
# The H200 verification of the boundary, core and serving work, as one pipeline that fits one
# 30-minute device budget. Started by `PIPELINE=round scripts/gpu/verify.sh OUT_DIR`, which
# packs RUN_DIR; writes RUN_DIR/finished when done. Every step is time-boxed, so a budget that
# runs out leaves the earlier steps' results; the order puts what nothing else can show first.
#
# 1. the build of the bf16 flashinfer modules, beside the conformance of the backends that need
#    no flashinfer JIT (flex, torch-sdpa) and the model zoo in bf16 on cuda with heads of 16
#    (served by flex and torch-sdpa);
# 2. the build of the remaining modules (fp16, windows, soft-cap, ALiBi; not FMHA v2), beside
#    the GPU tests that load only bf16 modules (RoPE kernel, graph runner, graph encoder);
# 3. the flashinfer-rope and flashinfer conformance runs, beside tests/gpu/test_nvidia_gpu.py;
# 4. timing, with nothing else running: the serving benchmark, attention TFLOP/s, the
#    benchmark's host mode, whole models (those with local layers first);
# 5. the zoo with heads of 64 (served by flashinfer), then trt's conformance (its FMHA v2
#    modules build on first use) while time remains.
set -u
run_dir=${1:?usage: scripts/gpu/round_pipeline.sh RUN_DIR}
. scripts/gpu/pipeline_start.sh || exit 1
export PYTHONPATH="$PWD:$PWD/benchmarks:$PWD/plugins:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1

step "1. prebuild of the bf16 modules, beside flex/torch-sdpa conformance and the zoo (d16)"
(
    RUN_TIMEOUT=200 scripts/gpu/conformance.sh "$run_dir/conformance-torch" flex torch-sdpa \
        >"$run_dir/conformance-torch.log" 2>&1
    step "conformance flex torch-sdpa done"
    zoo zoo-d16 16 200
) &
beside=$!
python3 benchmarks/gpu/prebuild.py --budget 420 \
    --only "$BF16_MODULES" \
    >"$run_dir/prebuild-bf16.log" 2>&1
step "prebuild bf16 rc=$?"
tail -12 "$run_dir/prebuild-bf16.log"
wait "$beside"

gpu_tests() {  # gpu_tests FILE...: one pytest per file, so one file's device assert stays there
    local file
    for file in "$@"; do
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -k "not trt" \
            -o junit_family=xunit1 --junitxml="$run_dir/gpu-$file.xml" "tests/gpu/$file.py" \
            >"$run_dir/gpu-$file.log" 2>&1
        step "gpu $file rc=$? $(tail -1 "$run_dir/gpu-$file.log")"
    done
}

step "2. prebuild of the remaining modules (no FMHA v2), beside the bf16-only GPU tests"
gpu_tests test_rope_kernel test_graph_runner_gpu test_graph_encoder &
beside=$!
python3 benchmarks/gpu/prebuild.py --budget 420 --skip fmha_v2 >"$run_dir/prebuild-rest.log" 2>&1
step "prebuild rest rc=$?"
tail -6 "$run_dir/prebuild-rest.log"
wait "$beside"

step "3. conformance flashinfer-rope flashinfer, beside test_nvidia_gpu"
gpu_tests test_nvidia_gpu &
beside=$!
RUN_TIMEOUT=300 scripts/gpu/conformance.sh "$run_dir/conformance" flashinfer-rope flashinfer
wait "$beside"
step "conformance done"

step "4a. serving benchmark, one process per model"
for model in bge-m3 qwen3; do
    timeout "${SERVING_TIMEOUT:-200}" python3 benchmarks/serving_bench.py \
        --out "$run_dir/serving-$model" --models "$model" --repeats 20 \
        >"$run_dir/serving-$model.log" 2>&1
    step "serving $model rc=$?"
    grep '^|' "$run_dir/serving-$model.log" | tail -20
done

step "4b. attention TFLOP/s"
timeout 120 python3 benchmarks/attention_tflops.py --out "$run_dir/tflops" \
    >"$run_dir/tflops.log" 2>&1
step "tflops rc=$?"
tail -28 "$run_dir/tflops.log"

step "4c. host time per call (benchmark host mode, 11 workloads)"
timeout 170 python3 benchmarks/bench.py --out "$run_dir/bench-host" --modes host \
    --time-budget-s 140 >"$run_dir/bench-host.log" 2>&1
step "bench host rc=$?"
tail -24 "$run_dir/bench-host.log"

step "4d. whole models: local layers first (ModernBERT, EmbeddingGemma), then XLM-R, Qwen3"
e2e modernbert embeddinggemma xlmr qwen3

step "5. zoo with heads of 64, then trt"
zoo zoo-d64 64 300
RUN_TIMEOUT=400 scripts/gpu/conformance.sh "$run_dir/conformance-trt" trt
touch "$run_dir/finished"
step "finished"
