"""What a benchmark run produced, and the arithmetic on it: floors, ratios and targets.

Everything here is plain data and pure functions, so a report can be rebuilt from the JSON of an
earlier run on a machine without a GPU.

Four modes time the same calls differently, each telling another truth (`Mode`): throughput
(CUDA events around back-to-back calls: the GPU queue hides host time), latency (a sync before
and after each call: what one small request waits), host (wall-clock microseconds of the call
itself, no sync: what the engine's CPU pays per layer) and graph (the public API captured in a
CUDA graph, replayed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .workloads import Targets

PathKind = Literal[
    "api", "raw", "graph", "backend", "attention-alone", "legacy", "padded-sdpa", "varlen-attn"
]
PathStatus = Literal["ok", "wrong", "error", "skipped", "unsupported"]
"""``skipped``: the path cannot run here (a library is missing, a named backend refuses the
spec); ``unsupported``: graph mode is not served by that backend (the note says why)."""
TargetStatus = Literal["PASS", "FAIL", "N/A"]
Mode = Literal["throughput", "latency", "host", "graph"]
Unit = Literal["x", "us"]
"""How a target's value reads: a ratio, or a difference in microseconds."""

PATH_KINDS: tuple[PathKind, ...] = (
    "api",
    "raw",
    "graph",
    "backend",
    "attention-alone",
    "legacy",
    "padded-sdpa",
    "varlen-attn",
)
PATH_STATUSES: tuple[PathStatus, ...] = ("ok", "wrong", "error", "skipped", "unsupported")
MODES: tuple[Mode, ...] = ("throughput", "latency", "host", "graph")
ENGINE_KINDS: frozenset[PathKind] = frozenset({"api", "raw", "graph"})
"""Paths timed in every mode; the others are timed back-to-back only (throughput)."""


@dataclass(frozen=True)
class Ceilings:
    """Machine limits measured in the same run as the paths they judge."""

    copy_bytes_per_s: float
    """Device-to-device copy, bytes read plus bytes written per second."""
    matmul_flops_per_s: float
    """Dense bf16 matmul on random data."""
    copy_buffer_bytes: int
    matmul_n: int

    def to_dict(self) -> dict[str, object]:
        return {
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "matmul_flops_per_s": self.matmul_flops_per_s,
            "copy_buffer_bytes": self.copy_buffer_bytes,
            "matmul_n": self.matmul_n,
        }


@dataclass(frozen=True)
class Timing:
    """Per-call times of one path, in milliseconds: CUDA events around each back-to-back call
    (throughput), or the wall clock between a sync before and a sync after it (latency)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    iters: int
    warmup: int
    input_sets: int
    """Distinct input buffers the calls rotated through, so no call reads a warm L2."""

    def to_dict(self) -> dict[str, object]:
        return {
            "median_ms": self.median_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "min_ms": self.min_ms,
            "iters": self.iters,
            "warmup": self.warmup,
            "input_sets": self.input_sets,
        }


@dataclass(frozen=True)
class HostTiming:
    """Host wall-clock time of one call, no sync inside a repeat: the CPU's cost per layer.

    Each repeat times ``calls`` calls in a row and divides; the device is synchronised between
    repeats, so the queue of launched work never fills and never blocks a launch."""

    median_us: float
    """Median over the repeats of the mean per-call time."""
    min_us: float
    max_us: float
    calls: int
    """Calls per repeat."""
    repeats: int

    def to_dict(self) -> dict[str, object]:
        return {
            "median_us": self.median_us,
            "min_us": self.min_us,
            "max_us": self.max_us,
            "calls": self.calls,
            "repeats": self.repeats,
        }


@dataclass(frozen=True)
class PathResult:
    """One way of computing the workload's attention, checked and then timed."""

    path: str
    """Unique within the workload: ``api``, ``backend:flashinfer``, ``legacy``..."""
    kind: PathKind
    label: str
    status: PathStatus
    backend: str | None = None
    details: Mapping[str, str] = field(default_factory=dict)
    """The decision record's details (pre-processing mode, kernel variant...)."""
    rel_error: float | None = None
    tolerance: float | None = None
    timing: Timing | None = None
    """Throughput mode: back-to-back calls, CUDA events."""
    latency: Timing | None = None
    """Latency mode: each call between two syncs, wall clock (engine-view paths only)."""
    host: HostTiming | None = None
    """Host mode: the call's own CPU time, no sync (engine-view paths only)."""
    matches_eager: bool | None = None
    """Graph paths: whether the replayed output equals, bit for bit, the eager ``forward``
    output of the same graph plan on the same input (valid rows)."""
    prepare_ms: float | None = None
    """Host time of ``prepare`` (once per batch), device work included."""
    select_ms: float | None = None
    note: str | None = None
    """Why it was skipped, the error it raised, or a remark."""
    traceback: str | None = None
    """Last lines of the traceback of an error, for the JSON only."""

    @property
    def ms(self) -> float | None:
        return self.timing.median_ms if self.timing is not None else None

    @property
    def usable(self) -> bool:
        """Correct and timed back-to-back: the only results throughput comparisons use."""
        return self.status == "ok" and self.timing is not None

    @property
    def latency_ms(self) -> float | None:
        return self.latency.median_ms if self.latency is not None else None

    @property
    def host_us(self) -> float | None:
        return self.host.median_us if self.host is not None else None

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "kind": self.kind,
            "label": self.label,
            "status": self.status,
            "backend": self.backend,
            "details": dict(self.details),
            "rel_error": self.rel_error,
            "tolerance": self.tolerance,
            "timing": self.timing.to_dict() if self.timing is not None else None,
            "latency": self.latency.to_dict() if self.latency is not None else None,
            "host": self.host.to_dict() if self.host is not None else None,
            "matches_eager": self.matches_eager,
            "prepare_ms": self.prepare_ms,
            "select_ms": self.select_ms,
            "note": self.note,
            "traceback": self.traceback,
        }


@dataclass(frozen=True)
class WorkloadResult:
    name: str
    title: str
    shape: str
    spec: Mapping[str, object]
    lengths: tuple[int, ...]
    flops: float
    bytes: int
    rope_bytes: int
    targets: Targets
    paths: tuple[PathResult, ...]
    elapsed_s: float = 0.0
    note: str | None = None
    modes: tuple[Mode, ...] = MODES
    """The modes this workload was measured in; targets of the others are N/A."""

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def get(self, path: str) -> PathResult | None:
        return next((p for p in self.paths if p.path == path), None)

    def fastest(self, kind: PathKind) -> PathResult | None:
        """The fastest correct, timed path of ``kind``."""
        best: PathResult | None = None
        for p in self.paths:
            if p.kind == kind and p.usable and (best is None or _ms(p) < _ms(best)):
                best = p
        return best

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "title": self.title,
            "shape": self.shape,
            "spec": dict(self.spec),
            "lengths": list(self.lengths),
            "tokens": self.tokens,
            "flops": self.flops,
            "bytes": self.bytes,
            "rope_bytes": self.rope_bytes,
            "targets": self.targets.to_dict(),
            "paths": [p.to_dict() for p in self.paths],
            "elapsed_s": self.elapsed_s,
            "note": self.note,
            "modes": list(self.modes),
        }


@dataclass(frozen=True)
class BenchResult:
    meta: Mapping[str, object]
    ceilings: Ceilings | None
    workloads: tuple[WorkloadResult, ...]
    skipped_workloads: tuple[tuple[str, str], ...] = ()
    """(workload, reason) for workloads that never started."""
    complete: bool = True
    """False while a run is still going (the JSON is rewritten after each workload)."""


def _ms(p: PathResult) -> float:
    ms = p.ms
    return ms if ms is not None else math.inf


# --- floors and ratios ---------------------------------------------------------------------


def floor_ms(flops: float, nbytes: int, ceilings: Ceilings) -> float:
    """The least time the work can take: ``max(FLOPs / matmul rate, bytes / copy bandwidth)``."""
    compute = flops / ceilings.matmul_flops_per_s
    memory = nbytes / ceilings.copy_bytes_per_s
    return max(compute, memory) * 1e3


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


@dataclass(frozen=True)
class PathMetrics:
    tflops: float | None
    floor_ratio: float | None
    """``ms / floor ms``: 1.0 is the machine's limit."""
    vs_legacy: float | None
    """``legacy ms / ms``: above 1 is faster than the legacy path."""
    vs_padded: float | None

    def to_dict(self) -> dict[str, float | None]:
        return {
            "tflops": self.tflops,
            "floor_ratio": self.floor_ratio,
            "vs_legacy": self.vs_legacy,
            "vs_padded": self.vs_padded,
        }


def path_metrics(work: WorkloadResult, path: PathResult, ceilings: Ceilings | None) -> PathMetrics:
    ms = path.ms
    if ms is None or ms <= 0:
        return PathMetrics(None, None, None, None)
    floor = floor_ms(work.flops, work.bytes, ceilings) if ceilings is not None else None
    legacy = work.fastest("legacy")
    padded = work.get("padded-sdpa")
    padded_ms = padded.ms if padded is not None and padded.usable else None
    return PathMetrics(
        tflops=tflops(work.flops, ms),
        floor_ratio=ms / floor if floor else None,
        vs_legacy=_ms(legacy) / ms if legacy is not None else None,
        vs_padded=padded_ms / ms if padded_ms is not None else None,
    )


# --- the engine's view: the public API against the raw kernel it wraps ----------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def _difference(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _correct(p: PathResult | None) -> PathResult | None:
    return p if p is not None and p.status == "ok" else None


@dataclass(frozen=True)
class EngineView:
    """The public API against the raw kernel call it wraps, in each mode, and its graph replay.

    A value is None where either side is missing, wrong or was not timed in that mode."""

    host_overhead_us: float | None
    """API host µs - raw host µs per call."""
    latency_ratio: float | None
    """API latency / raw latency."""
    throughput_ratio: float | None
    """API ms / raw ms, back-to-back."""
    graph_latency_ratio: float | None
    """The API's graph replay latency / raw (eager) latency."""
    graph_host_us: float | None

    def to_dict(self) -> dict[str, float | None]:
        return {
            "host_overhead_us": self.host_overhead_us,
            "latency_ratio": self.latency_ratio,
            "throughput_ratio": self.throughput_ratio,
            "graph_latency_ratio": self.graph_latency_ratio,
            "graph_host_us": self.graph_host_us,
        }


def engine_view(work: WorkloadResult) -> EngineView:
    api = _correct(work.get("api"))
    raw = _correct(work.get("raw"))
    graph = _correct(work.get("graph"))
    api_ms = api.ms if api is not None else None
    raw_ms = raw.ms if raw is not None else None
    return EngineView(
        host_overhead_us=_difference(
            api.host_us if api is not None else None, raw.host_us if raw is not None else None
        ),
        latency_ratio=_ratio(
            api.latency_ms if api is not None else None,
            raw.latency_ms if raw is not None else None,
        ),
        throughput_ratio=_ratio(api_ms, raw_ms),
        graph_latency_ratio=_ratio(
            graph.latency_ms if graph is not None else None,
            raw.latency_ms if raw is not None else None,
        ),
        graph_host_us=graph.host_us if graph is not None else None,
    )


@dataclass(frozen=True)
class RopeCost:
    """What RoPE adds to attention on one workload (the pre-processing target)."""

    api_ms: float
    preprocess: str
    alone_ms: float
    alone_backend: str | None
    ratio: float
    pass_ms: float | None
    """API time minus the same backend without RoPE: the pre-processing pass, when separate."""
    pass_bytes_per_s: float | None


def rope_cost(work: WorkloadResult) -> RopeCost | None:
    api = work.get("api")
    alone = work.fastest("attention-alone")
    if api is None or alone is None or not api.usable:
        return None
    api_ms, alone_ms = _ms(api), _ms(alone)
    preprocess = api.details.get("preprocess", "?")
    pass_ms: float | None = None
    pass_bw: float | None = None
    same = work.get(f"attention-alone:{api.backend}") if api.backend is not None else None
    if same is not None and same.usable and preprocess != "fused":
        pass_ms = api_ms - _ms(same)
        pass_bw = work.rope_bytes / (pass_ms * 1e-3) if pass_ms > 0 else None
    return RopeCost(
        api_ms, preprocess, alone_ms, alone.backend, api_ms / alone_ms, pass_ms, pass_bw
    )
