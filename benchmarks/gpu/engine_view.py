"""The public API against the raw flashinfer call it wraps, as an engine sees them, on one GPU.

    python3 benchmarks/gpu/engine_view.py OUT.json [WORKLOAD...]

For each workload (d64 bf16 shapes by default, so one flashinfer module serves them all):
host µs per call (perf_counter around N calls with no sync, median of repeats, the queue drained
between repeats), latency (sync around every call, median ms), throughput (CUDA events around N
back-to-back calls) and CUDA-graph replay (one captured forward of a bucket's plan, replayed).
The raw path is what an engine would write by hand: one planned
``BatchPrefillWithRaggedKVCacheWrapper`` and ``run(q, k, v)`` on views of the packed QKV. Both
are checked against the float64 reference first, and the replay against the same plan's eager
forward, bit for bit.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import attn_backends as ab
from attn_backends.testing.graphs import capture_graph

# The benchmark is not installed: import it from this checkout's benchmarks/ folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn_backends_bench.paths import qkv_views

BGE = ab.AttentionSpec(16, 16, 64, torch.bfloat16, causal=False)
WORKLOADS: dict[str, tuple[ab.AttentionSpec, tuple[int, ...]]] = {
    "q1x16": (BGE, (16,)),
    "q4x32": (BGE, (9, 40, 23, 32)),
    "q16x64": (BGE, (64, 12, 50, 64, 33, 64, 7, 64, 64, 20, 64, 41, 64, 64, 5, 60)),
    "bge-m3 64x16..512": (BGE, tuple(16 + (i * 97) % 497 for i in range(64))),
    "bert-base 32x512": (ab.AttentionSpec(12, 12, 64, torch.bfloat16, causal=False), (512,) * 32),
}
ITERS = 200
REPEATS = 7


def host_us(step: Callable[[], object]) -> float:
    samples = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(ITERS):
            step()
        samples.append((time.perf_counter() - start) / ITERS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def latency_ms(step: Callable[[], object]) -> float:
    samples = []
    for _ in range(ITERS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def throughput_ms(step: Callable[[], object]) -> float:
    begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    begin.record()
    for _ in range(ITERS):
        step()
    end.record()
    torch.cuda.synchronize()
    return float(begin.elapsed_time(end)) / ITERS


def measure(name: str, spec: ab.AttentionSpec, lengths: tuple[int, ...]) -> dict[str, object]:
    import flashinfer

    device = torch.device("cuda")
    tokens = sum(lengths)
    params = ab.FMHAParams.from_lengths(lengths, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(tokens, spec.qkv_width, device=device, generator=gen).to(spec.dtype)
    sel = ab.select(spec, device=device)
    plan = sel.backend.prepare(params)

    def api() -> torch.Tensor:
        return sel.backend.forward(qkv, plan)

    q, k, v = qkv_views(qkv, spec, tokens)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD", backend="fa3"
    )
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    wrapper.plan(
        indptr,
        indptr,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        causal=spec.causal,
        q_data_type=spec.dtype,
    )

    def raw() -> torch.Tensor:
        out: torch.Tensor = wrapper.run(q, k, v)
        return out

    ref = ab.reference_attention(qkv, spec, params)
    errors = {
        "api": ab.reference.relative_error(api(), ref),
        "raw": ab.reference.relative_error(raw().reshape(tokens, spec.q_width), ref),
    }
    for step in (api, raw):
        for _ in range(20):
            step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")  # a host sync inside forward raises here
    try:
        api()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    row: dict[str, object] = {"workload": name, "tokens": tokens, "backend": sel.name}
    row["api_allocations_per_call"] = allocations
    row["relative_error"] = errors
    row["host_us"] = {"api": host_us(api), "raw": host_us(raw)}
    row["latency_ms"] = {"api": latency_ms(api), "raw": latency_ms(raw)}
    row["throughput_ms"] = {"api": throughput_ms(api), "raw": throughput_ms(raw)}
    row["graph"] = graph_replay(spec, lengths, qkv, ref)
    return row


def graph_replay(
    spec: ab.AttentionSpec, lengths: tuple[int, ...], qkv: torch.Tensor, ref: torch.Tensor
) -> dict[str, object]:
    device = qkv.device
    tokens = sum(lengths)
    rows = max(64, -(-tokens // 64) * 64)
    sel = ab.select(spec, device=device, cuda_graph=True)
    backend = sel.backend
    assert isinstance(backend, ab.CudaGraphPrefill)
    plan = backend.prepare_graph(
        ab.GraphBucket(max_tokens=rows, max_batch=len(lengths)), device=device
    )
    plan.update(ab.FMHAParams.from_lengths(lengths, device=device, padded_rows=rows))
    static = torch.zeros(rows, spec.qkv_width, device=device, dtype=spec.dtype)
    static[:tokens] = qkv
    captured = capture_graph(lambda: backend.forward(static, plan), device, warmup=3)
    graph, out = captured.graph, captured.output
    graph.replay()
    torch.cuda.synchronize()
    eager = backend.forward(static, plan)
    return {
        "bucket_rows": rows,
        "replay_equals_eager": bool(torch.equal(out[:tokens], eager[:tokens])),
        "relative_error": ab.reference.relative_error(out[:tokens], ref),
        "host_us": host_us(graph.replay),
        "latency_ms": latency_ms(graph.replay),
        "throughput_ms": throughput_ms(graph.replay),
    }


def main(out: Path, names: list[str]) -> None:
    rows = []
    for name in names or list(WORKLOADS):
        spec, lengths = WORKLOADS[name]
        row = measure(name, spec, lengths)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
