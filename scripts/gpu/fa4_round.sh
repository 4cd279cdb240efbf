#!/usr/bin/env bash
# flash-attn-4 on the H200, in the third call of one warm machine: the first two carried and
# stashed .fa4a and .fa4b (stash-fa4.sh), this one carries .fa4c, installs flash-attn-4
# (install-fa4.sh) and runs what the H200 issue asks of it. Every step is time-boxed and writes
# under OUT, so a call cut short keeps the earlier steps.
#
#     scripts/gpu/fa4_round.sh 1 "$OUT"   # fa4: conformance, GPU tests, TFLOP/s; ST + FA4 serving
#     scripts/gpu/fa4_round.sh 2 "$OUT"   # the whole tests/gpu (flashinfer, TRT too; carry .whl)
set -u
part=${1:?usage: scripts/gpu/fa4_round.sh 1|2 OUT}
out=${2:?usage: scripts/gpu/fa4_round.sh 1|2 OUT}
mkdir -p "$out"
. scripts/gpu/stash-fa4.sh >"$out/stash.log" 2>&1
. scripts/gpu/setup.sh >"$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
if [ "$part" = 1 ] || [ -f /tmp/fa4/cu13.sha ]; then  # part 2: fa4 too where it was carried
    . scripts/gpu/install-fa4.sh >>"$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
fi
. scripts/gpu/boxed.sh  # step, boxed

step "part $part on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
python3 -c "import torch, transformers, sentence_transformers as s, importlib.metadata as m; \
print(torch.__version__, transformers.__version__, s.__version__, m.version('flash-attn-4'), \
m.version('nvidia-cutlass-dsl-libs-core'))" 2>&1 | tee -a "$out/steps.log"
case "$part" in
1)
    boxed 150 fa4-conformance python3 -m pytest -q -p no:cacheprovider -rfE \
        --attn-backend fa4 --attn-device cuda --durations=15
    boxed 75 fa4-gpu-tests python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu \
        -k "fa4" --durations=10
    boxed 100 tflops-fa4 python3 benchmarks/attention_tflops.py --out "$out/tflops" \
        --backends fa4,torch-varlen --seq-lens 512,1024,2048,4096
    boxed 200 serving-fa4 python3 benchmarks/serving_bench.py --out "$out/serving-fa4" \
        --models bge-m3 --repeats 10 --workloads "documents,queries 8,bulk" \
        --paths st-packed,st-flash-packed
    ;;
2)
    boxed 400 gpu-tests python3 -m pytest -v -p no:cacheprovider -rfE tests/gpu --durations=25
    ;;
esac
step "done"
