"""Timing in three modes, median after warm-up, inputs rotated past the L2.

Each timed call gets the next of several input buffers, so it never finds its input in the L2
cache the previous call left warm.

* throughput (`time_steps`): CUDA events around each of many back-to-back calls; the median is
  of per-call times (host launch gaps included, as an engine running layer after layer sees
  them, but hidden whenever the GPU queue runs ahead of the host).
* latency (`time_latency`): a sync before and after each call, wall clock in between: what one
  small request waits, host work and kernel together.
* host (`time_host_calls`): wall clock around ``calls`` calls with no sync, divided by
  ``calls``; the device is synchronised between repeats so the queue never fills.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .results import Ceilings, HostTiming, Timing

MIN_INPUT_SETS = 3
MAX_INPUT_SETS = 16
HOST_REPEATS = 7
MAX_HOST_CALLS = 100
"""Calls per host-mode repeat at most: each call queues a few launches, and a repeat must stay
well below the driver's launch queue (about a thousand entries), or a launch would wait for the
device and the host time would read as kernel time."""


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


Step = Callable[[int], object]
"""One timed call; its argument picks the input set (``i % sets``)."""


def warm(step: Step, *, first: int, count: int) -> None:
    """Untimed calls ``step(first)`` .. ``step(first + count - 1)``."""
    for i in range(first, first + count):
        step(i)


def event_block(step: Step, *, first: int, count: int, device: torch.device) -> list[float]:
    """ms of each of ``count`` back-to-back calls from ``step(first)``: CUDA events around each
    (wall clock off CUDA, only for smoke tests of the harness)."""
    if device.type != "cuda":
        samples: list[float] = []
        for i in range(first, first + count):
            t0 = time.perf_counter()
            step(i)
            samples.append((time.perf_counter() - t0) * 1e3)
        return samples
    with torch.cuda.device(device):
        starts = [torch.Event(device, enable_timing=True) for _ in range(count)]
        ends = [torch.Event(device, enable_timing=True) for _ in range(count)]
        torch.cuda.synchronize(device)
        for k in range(count):
            starts[k].record()
            step(first + k)
            ends[k].record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def latency_block(step: Step, *, first: int, count: int, device: torch.device) -> list[float]:
    """Wall-clock ms of each of ``count`` calls, each from a synchronised device to the end of
    its work."""
    samples: list[float] = []
    for i in range(first, first + count):
        synchronize(device)
        t0 = time.perf_counter()
        step(i)
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def host_block(step: Step, *, first: int, calls: int, device: torch.device) -> float:
    """Seconds of ``calls`` calls in a row with no sync, started on an empty device queue."""
    synchronize(device)  # an empty queue: no launch waits for the device
    t0 = time.perf_counter()
    for i in range(first, first + calls):
        step(i)
    elapsed = time.perf_counter() - t0
    synchronize(device)
    return elapsed


def time_steps(
    step: Step, *, iters: int, warmup: int, device: torch.device, input_sets: int
) -> Timing:
    """Throughput of one path: ``iters`` back-to-back calls after ``warmup`` (`event_block`)."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    warm(step, first=0, count=warmup)
    samples = event_block(step, first=warmup, count=iters, device=device)
    return summarize(samples, warmup=warmup, input_sets=input_sets)


def time_latency(
    step: Step, *, iters: int, warmup: int, device: torch.device, input_sets: int
) -> Timing:
    """Latency of one path: ``iters`` synchronised calls after ``warmup`` (`latency_block`)."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    warm(step, first=0, count=warmup)
    samples = latency_block(step, first=warmup, count=iters, device=device)
    return summarize(samples, warmup=warmup, input_sets=input_sets)


def host_calls(iters: int) -> int:
    """Calls per host-mode repeat: ``iters``, at most `MAX_HOST_CALLS`."""
    return max(1, min(iters, MAX_HOST_CALLS))


def host_timing(elapsed_s: Sequence[float], calls: int) -> HostTiming:
    """Per-call µs of repeats that each took ``elapsed_s[r]`` seconds for ``calls`` calls."""
    if calls < 1 or not elapsed_s:
        raise ValueError(f"need at least one repeat of at least one call, got {calls} calls")
    per_call = sorted(t / calls * 1e6 for t in elapsed_s)
    return HostTiming(
        median_us=statistics.median(per_call),
        min_us=per_call[0],
        max_us=per_call[-1],
        calls=calls,
        repeats=len(per_call),
    )


def time_host_calls(
    step: Step,
    *,
    calls: int,
    repeats: int = HOST_REPEATS,
    warmup: int,
    device: torch.device,
) -> HostTiming:
    """Host µs per ``step(i)``: ``calls`` calls in a row without a sync, ``repeats`` times."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    warm(step, first=0, count=warmup)
    elapsed = [
        host_block(step, first=warmup + r * calls, calls=calls, device=device)
        for r in range(repeats)
    ]
    return host_timing(elapsed, calls)


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index (``cuda`` becomes ``cuda:<current>``), as tensors report it, so
    that comparing it with a tensor's device means what it says."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


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
