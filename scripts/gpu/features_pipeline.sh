#!/usr/bin/env bash
# The H200 verification of the model features (windows, soft-capping, ALiBi, RoPE scaling,
# separate Q/K/V) and of the whole-model workloads that need them, as one pipeline. Started by
# `PIPELINE=features scripts/gpu/verify.sh OUT_DIR`, which packs RUN_DIR; writes
# RUN_DIR/finished when done. Order, most needed first:
#
# 1. conformance of the backends that need no flashinfer JIT (flex, torch-sdpa), beside
# 2. the flashinfer JIT prebuild of every module the flashinfer conformance runs load (TRT's
#    FMHA v2 modules skipped: `trt` declares none of these features);
# 3. conformance of flashinfer-rope and flashinfer (the whole suite, feature cases included);
# 4. the ModernBERT-sized whole model (local window on two of three layers);
# 5. the GPU tests (tests/gpu) but trt's: its FMHA v2 modules (about 2,300 CPU-seconds each)
#    are not prebuilt here, and trt declares none of these features;
# 6. the EmbeddingGemma-sized whole model (head dim 256: its flashinfer module builds on first use).
set -u
run_dir=${1:?usage: scripts/gpu/features_pipeline.sh RUN_DIR}
. scripts/gpu/pipeline_start.sh || exit 1

step "conformance without flashinfer (flex, torch-sdpa), beside the prebuild"
RUN_TIMEOUT=${RUN_TIMEOUT:-480} scripts/gpu/conformance.sh "$run_dir/conformance-torch" \
    flex torch-sdpa >"$run_dir/conformance-torch.log" 2>&1 &
torch_runs=$!

step "prebuild: the flashinfer modules of the conformance runs (no FMHA v2)"
python3 benchmarks/gpu/prebuild.py --budget "${PREBUILD_BUDGET:-900}" --skip fmha_v2 \
    >"$run_dir/prebuild.log" 2>&1
step "prebuild rc=$?"
tail -6 "$run_dir/prebuild.log"

step "conformance: flashinfer-rope flashinfer"
RUN_TIMEOUT=${RUN_TIMEOUT:-480} scripts/gpu/conformance.sh "$run_dir/conformance" \
    flashinfer-rope flashinfer
wait "$torch_runs"
step "conformance without flashinfer done"
cat "$run_dir/conformance-torch/summary.txt"

for model in modernbert embeddinggemma; do
    if [ "$model" = embeddinggemma ]; then
        step "GPU tests"
        timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider \
            -o junit_family=xunit1 --junitxml="$run_dir/gpu-tests.xml" tests/gpu -k "not trt" \
            >"$run_dir/gpu-tests.log" 2>&1
        step "gpu tests rc=$?"
        tail -5 "$run_dir/gpu-tests.log"
    fi
    step "whole model: $model"
    timeout "${E2E_TIMEOUT:-420}" python3 scripts/gpu/e2e_models.py --out "$run_dir/e2e-$model" \
        --models "$model" --warmup 2 --runs 5 >"$run_dir/e2e-$model.log" 2>&1
    step "$model rc=$?"
    tail -6 "$run_dir/e2e-$model.log"
done
touch "$run_dir/finished"
step "finished"
