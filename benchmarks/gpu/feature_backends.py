#!/usr/bin/env python3
"""Which backend should serve the specs flashinfer refuses: ``torch-sdpa`` against ``flex`` on
the attention of real embedding models, through the public API, on one GPU.

    python3 benchmarks/gpu/feature_backends.py OUT.json
    python3 benchmarks/gpu/feature_backends.py OUT.json cpu     # smoke test: 4 short texts

Specs (bf16, random inputs, lengths seeded): ModernBERT-base local layers (12 x 64, window
64 on both sides), EmbeddingGemma local layers (3 q / 1 kv x 256, window 256 on both sides),
jina-embeddings-v2-base (12 x 64, bidirectional ALiBi). Each backend is first checked against
the float64 reference on the whole batch, then its ``forward`` is timed on one plan:
throughput (CUDA events around each of back-to-back calls) and latency (a sync before and after
each call), medians in ms, and host µs per call (calls in a row without a sync). ``prepare``
(once per batch) is not timed. The first call's wall time
is reported apart: it includes flex's compilation.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import attn_backends as ab
from attn_backends import reference_attention
from attn_backends.reference import relative_error

# The benchmark is not installed: import it from this checkout's benchmarks/ folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn_backends_bench.timing import (
    event_block,
    latency_block,
    synchronize,
    time_host_calls,
)

BACKENDS = ("torch-sdpa", "flex")
TOLERANCE = 2e-2


def lengths(texts: int, low: int, high: int) -> list[int]:
    draw = random.Random(0)
    return [draw.randint(low, high) for _ in range(texts)]


WORKLOADS: dict[str, tuple[ab.AttentionSpec, list[int]]] = {
    "modernbert-local 64 x 16..1024": (
        ab.AttentionSpec(
            12, 12, 64, torch.bfloat16, causal=False, window=ab.SlidingWindow.modernbert(128)
        ),
        lengths(64, 16, 1024),
    ),
    "embeddinggemma-local 64 x 16..2048": (
        ab.AttentionSpec(
            3,
            1,
            256,
            torch.bfloat16,
            causal=False,
            window=ab.SlidingWindow.gemma3_bidirectional(512),
        ),
        lengths(64, 16, 2048),
    ),
    "jina-v2-alibi 64 x 16..512": (
        ab.AttentionSpec(12, 12, 64, torch.bfloat16, causal=False, alibi=ab.AlibiSpec()),
        lengths(64, 16, 512),
    ),
}


def measure(
    name: str, spec: ab.AttentionSpec, lens: list[int], device: torch.device
) -> dict[str, object]:
    if device.type != "cuda":
        lens = [min(n, 32) for n in lens[:4]]
    params = ab.FMHAParams.from_lengths(lens, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(params.rows, spec.qkv_width, device=device, generator=gen).to(spec.dtype)
    ref = reference_attention(qkv, spec, params)
    row: dict[str, object] = {"tokens": params.token_q_num, "texts": len(lens)}
    for backend_name in BACKENDS:
        backend = ab.select(spec, device=device, backend=backend_name).backend
        plan = backend.prepare(params)
        synchronize(device)
        t0 = time.perf_counter()
        out = backend.forward(qkv, plan)
        synchronize(device)
        first_s = time.perf_counter() - t0
        error = relative_error(out, ref)
        result: dict[str, object] = {"first_call_s": round(first_s, 2), "rel_error": error}
        if error > TOLERANCE:
            result["status"] = f"WRONG (relative error {error:.3g} > {TOLERANCE})"
        else:

            def step(i: int) -> torch.Tensor:
                return backend.forward(qkv, plan)  # noqa: B023  (timed right here)

            for _ in range(3):
                step(0)
            result["throughput_ms"] = statistics.median(
                event_block(step, first=0, count=20, device=device)
            )
            result["latency_ms"] = statistics.median(
                latency_block(step, first=0, count=20, device=device)
            )
            result["host_us"] = time_host_calls(step, calls=20, warmup=0, device=device).median_us
            result["status"] = "ok"
        row[backend_name] = result
        print(f"{name}: {backend_name}: {result}", flush=True)
    return row


def main(out: Path, device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    report: dict[str, object] = {
        "device": name,
        "torch": torch.__version__,
        "workloads": {w: measure(w, *work, device) for w, work in WORKLOADS.items()},
    }
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda"))
