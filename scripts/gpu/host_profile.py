#!/usr/bin/env python3
"""Where the public ``forward``'s host time goes on a GPU, piece by piece, against the raw call.

    . scripts/gpu/setup.sh && python3 scripts/gpu/host_profile.py OUT.json

For two batches (BGE-M3-like 64 x 16..512 and a 4 x 32 query batch; bf16, 16/16 x 64, the
``flashinfer`` backend), host µs per call (perf_counter around 300 calls after a sync, median of
7 repeats) of: the raw call (views cut by hand + ``wrapper.run`` + output as rows), the public
``forward`` on one buffer and rotating through four, and each step of ``forward``'s steady
state alone; then the top functions of a cProfile of 2000 ``forward`` calls. Writes JSON and
prints a table.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import attn_backends as ab
from attn_backends._path._contract import (
    buffer_signature,  # the memo key: measured here, not public
)
from attn_backends.plugin import QKVViews

CALLS = 300
REPEATS = 7


def host_us(fn: Callable[[int], object]) -> float:
    per_call = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(CALLS):
            fn(i)
        per_call.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def profile(lengths: list[int]) -> dict[str, object]:
    spec = ab.AttentionSpec(16, 16, 64, torch.bfloat16, causal=False)
    backend = ab.select(spec, device="cuda", backend="flashinfer", strict=False).backend
    params = ab.FMHAParams.from_lengths(lengths, device="cuda")
    plan = backend.prepare(params)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [
        torch.randn(params.rows, spec.qkv_width, device="cuda", generator=gen).to(spec.dtype)
        for _ in range(4)
    ]
    qkv = sets[0]
    tokens = params.token_q_num
    wrapper = plan.kernel.wrapper  # type: ignore[attr-defined]
    split = (16, 16, 16)

    def raw(i: int) -> torch.Tensor:
        rows = qkv if qkv.shape[0] == tokens else qkv[:tokens]
        q, k, v = rows.view(tokens, 48, 64).split_with_sizes(split, 1)
        return wrapper.run(q, k, v).view(tokens, 1024)

    for _ in range(20):
        backend.forward(qkv, plan)
        raw(0)
    geo = plan.memo.get(buffer_signature(qkv))
    assert geo is not None
    q, k, v = qkv.view(tokens, 48, 64).split_with_sizes(split, 1)
    out = wrapper.run(q, k, v)
    rows = geo.output_rows
    pieces: dict[str, Callable[[int], object]] = {
        "raw: views + run + rows": raw,
        "forward, one buffer": lambda i: backend.forward(qkv, plan),
        "forward, four buffers in turn": lambda i: backend.forward(sets[i & 3], plan),
        "step: signature + memo lookup": lambda i: plan.memo.get(buffer_signature(qkv)),
        "step: as_strided + split": lambda i: qkv.as_strided(
            geo.heads_size, geo.heads_stride, geo.storage_offset
        ).split_with_sizes(geo.split, 1),
        "step: attend (QKVViews + run)": lambda i: backend.attend(
            QKVViews(qkv, q, k, v, None), plan
        ),
        "step: wrapper.run alone": lambda i: wrapper.run(q, k, v),
        "step: output as rows": lambda i: out.view(rows[0], rows[1]),
    }
    result: dict[str, object] = {"lengths": lengths, "tokens": tokens}
    result["host_us"] = {name: round(host_us(fn), 2) for name, fn in pieces.items()}
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(2000):
        backend.forward(qkv, plan)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    result["cprofile_top"] = text.getvalue().splitlines()[:45]
    return result


def main(out: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    bge = torch.randint(16, 513, (64,), generator=gen).tolist()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "batches": {"bge-m3 64x16..512": profile(bge), "query 4x32": profile([32] * 4)},
    }
    out.write_text(json.dumps(report, indent=1))
    for name, batch in report["batches"].items():
        print(f"## {name}")
        for piece, us in batch["host_us"].items():  # type: ignore[index]
            print(f"{us:8.2f} µs  {piece}")
        print("\n".join(batch["cprofile_top"][:30]))  # type: ignore[index]


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "host_profile.json"))
