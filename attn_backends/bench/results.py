"""What a benchmark run produced, and the arithmetic on it: floors, ratios and targets.

Everything here is plain data and pure functions, so a report can be rebuilt from the JSON of an
earlier run on a machine without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .workloads import Targets

PathKind = Literal["api", "backend", "attention-alone", "legacy", "padded-sdpa", "varlen-attn"]
PathStatus = Literal["ok", "wrong", "error", "skipped"]
TargetStatus = Literal["PASS", "FAIL", "N/A"]

PATH_KINDS: tuple[PathKind, ...] = (
    "api",
    "backend",
    "attention-alone",
    "legacy",
    "padded-sdpa",
    "varlen-attn",
)
PATH_STATUSES: tuple[PathStatus, ...] = ("ok", "wrong", "error", "skipped")


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
    """Per-call times of one path, in milliseconds, from CUDA events."""

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
        """Correct and timed: the only results comparisons are made from."""
        return self.status == "ok" and self.timing is not None

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
    legacy = work.get("legacy")
    padded = work.get("padded-sdpa")
    legacy_ms = legacy.ms if legacy is not None and legacy.usable else None
    padded_ms = padded.ms if padded is not None and padded.usable else None
    return PathMetrics(
        tflops=tflops(work.flops, ms),
        floor_ratio=ms / floor if floor else None,
        vs_legacy=legacy_ms / ms if legacy_ms is not None else None,
        vs_padded=padded_ms / ms if padded_ms is not None else None,
    )


# --- targets -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetResult:
    workload: str
    target: str
    description: str
    value: float | None
    threshold: float
    op: Literal["<=", ">="]
    status: TargetStatus
    note: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "target": self.target,
            "description": self.description,
            "value": self.value,
            "threshold": self.threshold,
            "op": self.op,
            "status": self.status,
            "note": self.note,
        }


def _judge(value: float, threshold: float, op: Literal["<=", ">="]) -> TargetStatus:
    ok = value <= threshold if op == "<=" else value >= threshold
    return "PASS" if ok else "FAIL"


def _why_unusable(p: PathResult | None, what: str) -> str:
    if p is None:
        return f"{what} was not run"
    if p.status == "ok":
        return f"{what} has no timing"
    return f"{what} is {p.status.upper()}" + (f": {p.note}" if p.note else "")


def _ratio_target(
    work: WorkloadResult,
    name: str,
    description: str,
    threshold: float,
    op: Literal["<=", ">="],
    numerator: PathResult | None,
    denominator: PathResult | None,
    num_what: str,
    den_what: str,
) -> TargetResult:
    api = work.get("api")
    if api is None or not api.usable:
        # The public API failing is the failure the target exists to catch, never "N/A".
        return TargetResult(
            work.name,
            name,
            description,
            None,
            threshold,
            op,
            "FAIL",
            _why_unusable(api, "the public API path"),
        )
    for p, what in ((numerator, num_what), (denominator, den_what)):
        if p is None or not p.usable:
            return TargetResult(
                work.name, name, description, None, threshold, op, "N/A", _why_unusable(p, what)
            )
    assert numerator is not None and denominator is not None
    value = _ms(numerator) / _ms(denominator)
    return TargetResult(
        work.name, name, description, value, threshold, op, _judge(value, threshold, op)
    )


def evaluate_targets(work: WorkloadResult) -> list[TargetResult]:
    """Every target that applies to ``work``, judged from its paths."""
    t = work.targets
    api = work.get("api")
    out = [
        _ratio_target(
            work,
            "api-vs-fastest",
            "public API / fastest correct backend",
            t.api_within,
            "<=",
            api,
            work.fastest("backend"),
            "the public API path",
            "every backend path",
        )
    ]
    if t.legacy_speedup is not None:
        out.append(
            _ratio_target(
                work,
                "legacy-speedup",
                "legacy / public API",
                t.legacy_speedup,
                ">=",
                work.get("legacy"),
                api,
                "the legacy path",
                "the public API path",
            )
        )
    if t.padded_speedup is not None:
        out.append(
            _ratio_target(
                work,
                "padded-speedup",
                "padded SDPA / public API",
                t.padded_speedup,
                ">=",
                work.get("padded-sdpa"),
                api,
                "the padded SDPA path",
                "the public API path",
            )
        )
    if t.rope_overhead is not None:
        out.append(
            _ratio_target(
                work,
                "rope-overhead",
                "public API (RoPE + attention) / attention alone",
                t.rope_overhead,
                "<=",
                api,
                work.fastest("attention-alone"),
                "the public API path",
                "every attention-alone path",
            )
        )
    return out


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
