#!/usr/bin/env bash
# What the H200 issue still asks of the serving paths, in two calls of one warm machine (each
# under the 600 s a call may run; the second finds the first's flashinfer JIT cache in build/).
# Every step is time-boxed and writes under OUT, so a call cut short keeps the earlier steps.
#
#     scripts/gpu/serving_round.sh 1 "$OUT"   # BGE-M3: every workload; a larger batch; API-raw
#     scripts/gpu/serving_round.sh 2 "$OUT"   # the other models' 1 and 32 queries; GPU tests
#     scripts/gpu/serving_round.sh 3 "$OUT"   # the contract's host time per call (flashinfer,
#                                             # torch-varlen); BGE-M3's mask-check share
#     scripts/gpu/serving_round.sh 4 "$OUT"   # EmbeddingGemma's mask-check share
#     scripts/gpu/serving_round.sh 5 "$OUT"   # the hot path's GPU tests; BGE-M3 packed and
#                                             # padded in alternating rounds, this tree and the
#                                             # one in .old/ (git archive REV attn_backends
#                                             # plugins | tar -x -C .old), one process each
#     scripts/gpu/serving_round.sh 6 "$OUT"   # the same A/B again; BGE-M3 and Qwen3 with the
#                                             # host time per layer; API-raw
#     scripts/gpu/serving_round.sh 7 "$OUT"   # the hot path's GPU tests; BGE-M3's issue rows
#                                             # (1 and 8 queries, documents, bulk; packed, graph
#                                             # runner) with the bound path's host time; API-raw;
#                                             # cProfile of BGE-M3's queries, both paths
#     scripts/gpu/serving_round.sh 8 "$OUT"   # BGE-M3's host time per attention call: this
#                                             # tree, the one in .old/, this tree again
#     scripts/gpu/serving_round.sh 9 "$OUT"   # flashinfer's direct kernel call: its GPU tests
#                                             # and the hot path's; part 8's A/B; torch-varlen
#                                             # on the queries
#     scripts/gpu/serving_round.sh 10 "$OUT"  # the contract's host time per call on flashinfer,
#                                             # this tree, .old/'s, this tree again, and on
#                                             # torch-varlen; the direct call's GPU test (one
#                                             # head dim: one JIT build)
#     scripts/gpu/serving_round.sh 11 "$OUT"  # the H200 rows of the serving issue on a fresh
#                                             # machine: BGE-M3's workloads (packed, padded,
#                                             # graph runner); API-raw; EmbeddingGemma's mask
#                                             # share on torch-varlen (no head-dim-256 build)
#     scripts/gpu/serving_round.sh 12 "$OUT"  # after 11 on the same warm machine: the direct
#                                             # call's and the hot path's GPU tests; a profile
#                                             # of the graph runner; Qwen3's rows
set -u
part=${1:?usage: scripts/gpu/serving_round.sh 1..12 OUT}
out=${2:?usage: scripts/gpu/serving_round.sh 1..12 OUT}
mkdir -p "$out"
. scripts/gpu/setup.sh || exit 1
. scripts/gpu/boxed.sh  # step, boxed

# BGE-M3's packed and padded paths in alternating rounds (serving_ab.py), this tree's library
# and .old/'s, one process each: round $1 of the pair
ab_round() {
    local args=(--model bge-m3 --workloads "queries 8,queries 1,documents" --rounds 5
        --repeats 10)
    boxed 110 "ab-new-$1" python3 benchmarks/serving_ab.py --label new "${args[@]}"
    if [ -d .old/attn_backends ]; then
        boxed 110 "ab-old-$1" env PYTHONPATH="$PWD/.old:$PWD/.old/plugins:$PYTHONPATH" \
            python3 benchmarks/serving_ab.py --label old "${args[@]}"
    fi
}

# BGE-M3 padded and packed with the host time per attention call: this tree, the one in .old/,
# this tree again (drift bracketed), each in its own process; $1 $2 $3: their boxes in seconds
serving_ab() {
    local args=(--models bge-m3 --workloads "queries 1,queries 8,documents"
        --paths st-padded-sdpa,st-packed --repeats 5 --host-time)
    boxed "$1" serving-new-1 python3 benchmarks/serving_bench.py --out "$out/serving-new-1" \
        "${args[@]}"
    if [ -d .old/attn_backends ]; then
        boxed "$2" serving-old env PYTHONPATH="$PWD/.old:$PWD/.old/plugins:$PYTHONPATH" \
            python3 benchmarks/serving_bench.py --out "$out/serving-old" "${args[@]}"
    fi
    boxed "$3" serving-new-2 python3 benchmarks/serving_bench.py --out "$out/serving-new-2" \
        "${args[@]}"
}

# BGE-M3's issue rows (1 and 8 queries, documents, bulk; padded sdpa, packed, graph runner)
# with the host time per layer, then API-raw; $1 $2: their boxes in seconds, $3: bench.py's
# time budget
bge_rows() {
    boxed "$1" serving-bge python3 benchmarks/serving_bench.py --out "$out/serving-bge" \
        --models bge-m3 --workloads "queries 1,queries 8,documents,bulk" \
        --paths st-padded-sdpa,st-packed,st-packed-graphs --repeats 5 --host-time
    boxed "$2" bench-api-raw python3 benchmarks/bench.py --out "$out/bench" \
        --workloads bge-m3-q4x32,bge-m3 --modes host,latency --backends flashinfer \
        --time-budget-s "$3"
}

step "part $part on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
python3 -c "import torch, transformers, sentence_transformers as s; print(torch.__version__, \
transformers.__version__, s.__version__)" | tee -a "$out/steps.log"
case "$part" in
1)
    boxed 270 serving-bge python3 benchmarks/serving_bench.py --out "$out/serving-bge" \
        --models bge-m3 --repeats 10 --host-time
    boxed 130 serving-bge-batch128 python3 benchmarks/serving_bench.py \
        --out "$out/serving-bge-batch128" --models bge-m3 --repeats 5 --batch-size 128 \
        --workloads "documents,bulk"
    boxed 150 bench-api-raw python3 benchmarks/bench.py --out "$out/bench" \
        --workloads bge-m3-q4x32,bge-m3 --modes host,latency \
        --backends flashinfer,torch-varlen --time-budget-s 120
    ;;
2)
    boxed 380 serving-others python3 benchmarks/serving_bench.py --out "$out/serving-others" \
        --models qwen3,modernbert,embeddinggemma --workloads "queries 1,queries 32" --repeats 10
    boxed 150 gpu-graph-runner python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/gpu/test_graph_runner_gpu.py
    ;;
3)
    # BGE-M3's heads; 4 queries of 32 tokens, 64 texts of 16..512 (one JSON line per log)
    documents=$(python3 -c 'import random; r = random.Random(0); \
print(",".join(str(r.randint(16, 512)) for _ in range(64)))')
    for backend in flashinfer torch-varlen; do
        boxed 90 "contract-$backend-queries" python3 benchmarks/contract_host.py \
            --backend "$backend" --heads 16 --head-dim 64 --lengths 32,32,32,32
        boxed 60 "contract-$backend-documents" python3 benchmarks/contract_host.py \
            --backend "$backend" --heads 16 --head-dim 64 --lengths "$documents" --calls 500
    done
    boxed 240 serving-bge-host python3 benchmarks/serving_bench.py --out "$out/serving-bge-host" \
        --models bge-m3 --workloads "queries 8,queries 1,documents" --paths st-packed \
        --repeats 5 --host-time
    ;;
4)
    # flashinfer's head-dim-256 JIT build comes first: minutes on a fresh machine
    boxed 540 serving-gemma python3 benchmarks/serving_bench.py --out "$out/serving-gemma" \
        --models embeddinggemma --workloads "queries 8,queries 1,documents" \
        --paths st-packed --repeats 5 --host-time
    ;;
5)
    boxed 240 gpu-hot-path python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/gpu/test_hot_path_gpu.py tests/gpu/test_graph_runner_gpu.py
    ab_round 1
    ;;
6)
    boxed 150 gpu-integration python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/gpu/test_hot_path_gpu.py -k integration
    ab_round 2
    boxed 200 serving-host python3 benchmarks/serving_bench.py --out "$out/serving-host" \
        --models bge-m3,qwen3 --workloads "queries 1,queries 8,documents" \
        --paths st-padded-sdpa,st-packed --repeats 5 --host-time
    boxed 60 bench-api-raw python3 benchmarks/bench.py --out "$out/bench" \
        --workloads bge-m3-q4x32,bge-m3 --modes host,latency --backends flashinfer \
        --time-budget-s 40
    ;;
7)
    boxed 180 gpu-hot-path python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/gpu/test_hot_path_gpu.py tests/gpu/test_graph_runner_gpu.py
    bge_rows 220 40 25
    boxed 60 profile-bge python3 benchmarks/serving_profile.py --out "$out/profile-bge" \
        --model bge-m3 --workloads "queries 8,queries 1" --encodes 40 --rows 80
    ;;
8)
    # this tree against .old/ (git archive REV attn_backends plugins | tar -x -C .old) in one
    # call: BGE-M3's host time per attention call, new, old, new again (drift bracketed)
    serving_ab 200 70 70
    ;;
9)
    # a fresh machine builds the JIT modules first (50-100 s each): the first steps' boxes
    # hold one build each (2026-12-08: 100 s and 180 s boxes were cut mid-build)
    nv=tests/gpu/test_nvidia_gpu.py
    boxed 240 gpu-direct python3 -m pytest -q -p no:cacheprovider -rfE \
        "$nv::test_flashinfer_calls_its_kernel_directly_once_proved" \
        "$nv::test_forward_does_not_sync_the_host[flashinfer]" \
        "$nv::test_forward_allocates_only_the_output[flashinfer]" \
        tests/gpu/test_hot_path_gpu.py
    serving_ab 150 60 60
    boxed 60 serving-varlen env ATTN_BACKEND=torch-varlen python3 benchmarks/serving_bench.py \
        --out "$out/serving-varlen" --models bge-m3 --workloads "queries 1,queries 8" \
        --paths st-padded-sdpa,st-packed --repeats 5 --host-time
    ;;
10)
    # 16/8 heads x 128, bf16: the JIT module the GPU test uses too (built once, first step)
    contract=(benchmarks/contract_host.py --backend flashinfer --heads 16 --kv-heads 8
        --head-dim 128 --dtype bfloat16 --lengths 32,32,32,32 --calls 1000 --rounds 5)
    boxed 200 contract-new-1 python3 "${contract[@]}"
    if [ -d .old/attn_backends ]; then
        boxed 45 contract-old env PYTHONPATH="$PWD/.old:$PWD/.old/plugins:$PYTHONPATH" \
            python3 "${contract[@]}"
    fi
    boxed 45 contract-new-2 python3 "${contract[@]}"
    # torch-varlen on the same shapes (no JIT build): its kernel call's host time
    boxed 45 contract-varlen python3 "${contract[@]/flashinfer/torch-varlen}"
    boxed 60 gpu-direct python3 -m pytest -q -p no:cacheprovider -rfE \
        "tests/gpu/test_nvidia_gpu.py::test_flashinfer_calls_its_kernel_directly_once_proved[flashinfer]"
    ;;
11)
    # the first step builds flashinfer's head-dim-64 module (50-100 s on a fresh machine)
    bge_rows 320 45 30
    boxed 190 serving-gemma env ATTN_BACKEND=torch-varlen python3 benchmarks/serving_bench.py \
        --out "$out/serving-gemma" --models embeddinggemma \
        --workloads "queries 8,queries 1,documents" --paths st-padded-sdpa,st-packed \
        --repeats 5 --host-time
    ;;
12)
    # part 11's JIT cache (build/gpu-cache) is still there on the same warm machine; the
    # head-dim-128 modules (fa3, and fa2 with fused RoPE) are built in the first step
    nv=tests/gpu/test_nvidia_gpu.py
    boxed 250 gpu-tests python3 -m pytest -q -p no:cacheprovider -rfE \
        "$nv::test_flashinfer_calls_its_kernel_directly_once_proved" \
        "$nv::test_forward_does_not_sync_the_host[flashinfer]" \
        "$nv::test_forward_allocates_only_the_output[flashinfer]" \
        tests/gpu/test_hot_path_gpu.py tests/gpu/test_graph_runner_gpu.py
    # where the graph runner's time per batch goes, beside the eager paths'
    boxed 90 profile-runner python3 benchmarks/serving_profile.py --out "$out/profile-runner" \
        --model bge-m3 --workloads "queries 8,queries 1" --paths runner,packed,padded \
        --encodes 40 --rows 80
    boxed 200 serving-qwen3 python3 benchmarks/serving_bench.py --out "$out/serving-qwen3" \
        --models qwen3 --workloads "queries 1,queries 8,documents" \
        --paths st-padded-sdpa,st-packed,st-packed-graphs --repeats 5 --host-time
    ;;
*)
    echo "part must be 1 to 12, got $part" >&2
    exit 2
    ;;
esac
step "part $part done"
