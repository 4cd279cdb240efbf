"""Timing: CUDA events around each call, median after warm-up, inputs rotated past the L2.

Each timed call gets the next of several input buffers, so it never finds its input in the L2
cache the previous call left warm. Events are recorded around every call, so the median is of
per-call times (host launch gaps included, as an engine running layer after layer sees them).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from .results import Ceilings, Timing

MIN_INPUT_SETS = 3
MAX_INPUT_SETS = 16


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def summarize(samples_ms: list[float], *, warmup: int, input_sets: int) -> Timing:
    ordered = sorted(samples_ms)
    return Timing(
        median_ms=statistics.median(ordered),
        p10_ms=_percentile(ordered, 0.1),
        p90_ms=_percentile(ordered, 0.9),
        min_ms=ordered[0],
        iters=len(ordered),
        warmup=warmup,
        input_sets=input_sets,
    )


def input_set_count(set_bytes: int, device: torch.device) -> int:
    """Buffers to rotate through so that together they hold at least 3x the L2 cache."""
    if device.type != "cuda":
        return MIN_INPUT_SETS
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    needed = math.ceil(3 * l2 / max(1, set_bytes))
    return min(MAX_INPUT_SETS, max(MIN_INPUT_SETS, needed))


def time_steps(
    step: Callable[[int], object],
    *,
    iters: int,
    warmup: int,
    device: torch.device,
    input_sets: int,
) -> Timing:
    """Time ``step(i)`` for ``iters`` calls after ``warmup`` calls; ``i`` picks the input set.

    On a CPU device (only for smoke tests of the harness) wall-clock time is used instead.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if device.type != "cuda":
        for i in range(warmup):
            step(i)
        samples: list[float] = []
        for i in range(iters):
            t0 = time.perf_counter()
            step(warmup + i)
            samples.append((time.perf_counter() - t0) * 1e3)
        return summarize(samples, warmup=warmup, input_sets=input_sets)
    with torch.cuda.device(device):
        starts = [torch.Event(device, enable_timing=True) for _ in range(iters)]
        ends = [torch.Event(device, enable_timing=True) for _ in range(iters)]
        for i in range(warmup):
            step(i)
        torch.cuda.synchronize(device)
        for i in range(iters):
            starts[i].record()
            step(warmup + i)
            ends[i].record()
        torch.cuda.synchronize(device)
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return summarize(samples, warmup=warmup, input_sets=input_sets)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_host(fn: Callable[[], object], *, iters: int, device: torch.device) -> float:
    """Median wall-clock ms of ``fn`` including the device work it queued (``prepare``)."""
    samples = []
    for _ in range(iters):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int, *, iters: int, warmup: int) -> float:
    """Device-to-device copy of ``nbytes``: bytes read plus bytes written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 256)
    dst = torch.empty_like(src)
    timing = time_steps(
        lambda i: dst.copy_(src), iters=iters, warmup=warmup, device=device, input_sets=1
    )
    return 2 * nbytes / (timing.median_ms * 1e-3)


def matmul_rate(device: torch.device, n: int, *, iters: int, warmup: int) -> float:
    """FLOP/s of an ``n^3`` bf16 matmul on random data."""
    gen = torch.Generator(device=device).manual_seed(1234)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    c = torch.empty_like(a)
    timing = time_steps(
        lambda i: torch.mm(a, b, out=c), iters=iters, warmup=warmup, device=device, input_sets=1
    )
    return 2.0 * n**3 / (timing.median_ms * 1e-3)


def measure_ceilings(
    device: torch.device,
    *,
    copy_bytes: int = 2 << 30,
    matmul_n: int = 8192,
    iters: int = 30,
    warmup: int = 5,
) -> Ceilings:
    """The two limits the floor is made of, measured now on this device."""
    copy = copy_bandwidth(device, copy_bytes, iters=iters, warmup=warmup)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rate = matmul_rate(device, matmul_n, iters=iters, warmup=warmup)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Ceilings(
        copy_bytes_per_s=copy,
        matmul_flops_per_s=rate,
        copy_buffer_bytes=copy_bytes,
        matmul_n=matmul_n,
    )
