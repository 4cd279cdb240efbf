#!/usr/bin/env python3
"""Where fused RoPE stops paying: flashinfer-rope's crossover length, measured on this GPU.

Run from the repository root after ``. scripts/gpu/setup.sh`` (and the prebuild):

    python3 benchmarks/gpu/rope_crossover.py OUT_DIR

For batches of equal-length sequences (about 16k tokens each, Qwen3-Embedding's attention:
16/8 heads x 128, causal, RoPE theta 1e6, bf16) it times three paths through the public
backends, each checked against the float64 reference first:

- ``fused``: fa2 with RoPE inside the kernel (``flashinfer-rope`` forced to fuse every batch);
- ``separate``: the in-place RoPE pass, then fa3 on the views (``flashinfer``);
- ``attention``: fa3 alone on the same shape without RoPE (the floor both are compared to).

``fused_rope_max_seqlen`` of ``flashinfer-rope`` should be the longest length at which
``fused`` is still no slower than ``separate``; the script prints that length and writes
OUT_DIR/rope_crossover.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
from attn_backends_builtin.flashinfer import FlashinferBackend, FlashinferRopeBackend

from attn_backends import AttentionSpec, FMHAParams, RopeSpec, reference_attention
from attn_backends.reference import relative_error

# The benchmark is not installed: import it from this checkout's benchmarks/ folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn_backends_bench.timing import input_set_count, time_steps

LENGTHS = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
TOKENS = 16384
TOLERANCE = 2e-2


class Measured(NamedTuple):
    ms: float
    """Median per forward."""
    rel_err: float
    preprocess: str
    """The pre-processing the plan ran (``fused`` or the separate pass)."""


def batch_size(length: int, tokens: int = TOKENS) -> int:
    return max(1, tokens // length)


class AlwaysFused(FlashinferRopeBackend):
    """flashinfer-rope without the per-batch limit: every batch fused."""

    capabilities = replace(FlashinferRopeBackend.capabilities, fused_rope_max_seqlen=None)


def measure(
    backend: FlashinferBackend,
    spec: AttentionSpec,
    length: int,
    iters: int,
    seed: int,
    device: torch.device,
    tokens: int = TOKENS,
) -> Measured:
    """Check one path against the reference, then time it."""
    lengths = [length] * batch_size(length, tokens)
    params = FMHAParams.from_lengths(lengths, device=device)
    bound = backend.bind(spec)
    plan = bound.prepare(params)
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = params.token_q_num
    check = torch.randn(rows, spec.qkv_width, device=device, dtype=spec.dtype, generator=gen)
    reference = reference_attention(check, spec, params)
    error = relative_error(bound.forward(check.clone(), plan), reference)
    if error > TOLERANCE:
        raise SystemExit(f"{type(backend).__name__} at length {length}: relative error {error}")
    sets = [
        torch.randn(rows, spec.qkv_width, device=device, dtype=spec.dtype, generator=gen)
        for _ in range(input_set_count(rows * spec.qkv_width * spec.dtype.itemsize, device))
    ]
    timing = time_steps(
        lambda i: bound.forward(sets[i % len(sets)], plan),
        iters=iters,
        warmup=10,
        device=device,
        input_sets=len(sets),
    )
    return Measured(timing.median_ms, error, plan.preprocess)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory for rope_crossover.json")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per path (median)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    spec = AttentionSpec(16, 8, 128, torch.bfloat16, causal=True, rope=RopeSpec(1e6))
    plain = replace(spec, rope=None)
    cuda = torch.device("cuda")
    rows: list[dict[str, object]] = []
    wins: list[int] = []
    print(
        f"{'length':>6} {'batch':>5} {'fused ms':>9} {'separate':>9} {'attention':>9} "
        f"{'fused/sep':>9} {'sep/attn':>8} {'fused/attn':>10}"
    )
    with torch.inference_mode():
        for length in LENGTHS:
            fused = measure(AlwaysFused(), spec, length, args.iters, length, cuda)
            separate = measure(FlashinferBackend, spec, length, args.iters, length, cuda)
            alone = measure(FlashinferBackend, plain, length, args.iters, length, cuda)
            ratios = (fused.ms / separate.ms, separate.ms / alone.ms, fused.ms / alone.ms)
            rows.append(
                {
                    "length": length,
                    "batch": batch_size(length),
                    "fused": fused._asdict(),
                    "separate": separate._asdict(),
                    "attention": alone._asdict(),
                    "fused_over_separate": ratios[0],
                    "separate_over_attention": ratios[1],
                    "fused_over_attention": ratios[2],
                }
            )
            if ratios[0] <= 1.0:
                wins.append(length)
            print(
                f"{length:6d} {batch_size(length):5d} {fused.ms:9.4f} {separate.ms:9.4f} "
                f"{alone.ms:9.4f} {ratios[0]:9.3f} {ratios[1]:8.3f} {ratios[2]:10.3f}"
            )
    crossover = max(wins) if wins else None
    print(f"longest length where fused is no slower than separate: {crossover}")
    print(
        f"flashinfer-rope fuses up to: {FlashinferRopeBackend.capabilities.fused_rope_max_seqlen}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens_per_batch": TOKENS,
        "spec": spec.to_dict(),
        "crossover": crossover,
    }
    (args.out / "rope_crossover.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
