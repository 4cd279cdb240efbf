#!/usr/bin/env bash
# The engine plugins' tests on a CPU machine, against the engines' own classes.
#
#   scripts/engines/test-cpu.sh            # vllm and sglang
#   scripts/engines/test-cpu.sh vllm       # one engine
#
# Each engine goes into its own virtual environment (.venv-engines/<engine>, which sees this
# machine's torch, transformers and attn-backends): the engine's wheel without its declared
# dependencies (they pin a CUDA build of torch and CUDA kernels, several GB), then the
# pure-Python packages its attention classes import (scripts/engines/<engine>-cpu.txt), then
# this checkout, so the engine finds the plugin's entry point. Then its test file runs.
set -euo pipefail
cd "$(dirname "$0")/../.."

declare -A wheel=([vllm]="vllm==0.34.0" [sglang]="sglang==0.5.23")
engines=("$@")
[ ${#engines[@]} -eq 0 ] && engines=(vllm sglang)

for engine in "${engines[@]}"; do
    if [ -z "${wheel[$engine]:-}" ]; then
        echo "unknown engine '$engine' (known: ${!wheel[*]})" >&2
        exit 2
    fi
    venv=".venv-engines/$engine"
    echo "== $engine (${wheel[$engine]}) in $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q --no-deps "${wheel[$engine]}"
    "$venv/bin/python" -m pip install -q -r "scripts/engines/$engine-cpu.txt"
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
    path="${PYTHONPATH:-}"
    # SGLang's modules import torchvision, which has no CPU build here: a placeholder stands in
    [ "$engine" = sglang ] && path="scripts/engines/placeholders${path:+:$path}"
    PYTHONPATH="$path" "$venv/bin/python" -m pytest -q -p no:cacheprovider "tests/test_engine_$engine.py"
done
