#!/usr/bin/env bash
# Conformance of the CUDA backends on this GPU, with junit XML and a short summary.
#
#     . scripts/gpu/setup.sh && python3 benchmarks/gpu/prebuild.py   # once per machine
#     scripts/gpu/conformance.sh OUT_DIR [RUN...]
#
# RUN names default to every run: headwise flex torch-sdpa flashinfer flashinfer-rope trt
# torch-varlen fa4 gpu-tests. Runs `pytest --attn-backend NAME` on cuda for torch-sdpa,
# flashinfer, flashinfer-rope, trt, torch-varlen, fa4, headwise and flex, then the GPU tests of tests/gpu/test_nvidia_gpu.py and the check of the fake
# flashinfer's signatures against the installed one. Writes OUT_DIR/<run>.xml, <run>.log and
# OUT_DIR/summary.txt (passed / skipped with reasons / failed per run) and prints the summary.
# RUN_TIMEOUT=S stops any single run after S seconds (rc=124 in the summary; default: none).
# The flashinfer runs go one after another (they share flashinfer's JIT cache); headwise and flex,
# which spend their time compiling FlexAttention kernels, run beside them, one after the other.
set -u
out=${1:?usage: scripts/gpu/conformance.sh OUT_DIR [RUN...]}
shift
runs=" ${*:-headwise flex torch-sdpa flashinfer flashinfer-rope trt torch-varlen fa4 gpu-tests} "
wanted() { [[ $runs == *" $1 "* ]]; }
mkdir -p "$out"

run() {
    local name=$1
    shift
    local start=$SECONDS
    timeout "${RUN_TIMEOUT:-0}" python3 -m pytest -q -p no:cacheprovider \
        -o junit_family=xunit1 --junitxml="$out/$name.xml" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" >>"$out/times.txt"
}

touch "$out/times.txt"
flex_runs() {
    local name
    for name in headwise flex; do
        wanted "$name" && run "$name" --attn-backend "$name" --attn-device cuda
    done
}
flex_runs &
flex_pid=$!
for backend in torch-sdpa flashinfer flashinfer-rope trt torch-varlen fa4; do
    wanted "$backend" && run "$backend" --attn-backend "$backend" --attn-device cuda
done
if wanted gpu-tests; then
    run gpu-tests tests/gpu/test_nvidia_gpu.py tests/gpu/test_rope_kernel.py \
        "tests/test_nvidia_backends.py::test_fake_signatures_match_real_flashinfer"
fi
wait "$flex_pid"

python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import collections
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out = Path(sys.argv[1])
versions = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
try:
    import importlib.metadata as md

    versions.append(f"flashinfer {md.version('flashinfer-python')}")
except Exception as exc:  # reported, not fatal
    versions.append(f"flashinfer ? ({exc})")
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"device: {device}; {', '.join(versions)}")
times = dict(
    line.split(" ", 1) for line in (out / "times.txt").read_text().splitlines() if line
)
for xml in sorted(out.glob("*.xml")):
    name = xml.stem
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    failed, skipped, passed = [], collections.Counter(), 0
    for case in cases:
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            message = (problem.get("message") or "").strip().split("\n")[0][:200]
            failed.append(f"{case.get('name')}: {message}")
        elif skip is not None:
            reason = (skip.get("message") or "").split(": ", 1)[-1]
            skipped[reason[:160]] += 1
        else:
            passed += 1
    print(f"\n== {name}: {passed} passed, {sum(skipped.values())} skipped, "
          f"{len(failed)} failed ({times.get(name, '?')})")
    for reason, count in skipped.most_common():
        print(f"   skipped x{count}: {reason}")
    for line in failed:
        print(f"   FAILED {line}")
EOF
