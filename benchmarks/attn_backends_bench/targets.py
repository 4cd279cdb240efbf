"""The project's targets, each a comparison of two paths in one mode, judged PASS/FAIL/N/A.

The public API failing (wrong, or not timed in a mode that ran) is a FAIL, never N/A: that is
the failure a target exists to catch. A baseline that could not run makes the target N/A with
the reason; a mode the run did not measure makes it N/A and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .results import Mode, PathResult, TargetStatus, Unit, WorkloadResult


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
    unit: Unit = "x"

    def to_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "target": self.target,
            "description": self.description,
            "value": self.value,
            "threshold": self.threshold,
            "op": self.op,
            "unit": self.unit,
            "status": self.status,
            "note": self.note,
        }


def _judge(value: float, threshold: float, op: Literal["<=", ">="]) -> TargetStatus:
    ok = value <= threshold if op == "<=" else value >= threshold
    return "PASS" if ok else "FAIL"


def _why_unusable(p: PathResult | None, what: str, mode: Mode) -> str:
    if p is None:
        return f"{what} was not run"
    if p.status == "ok":
        return f"{what} has no {mode} timing"
    return f"{what} is {p.status.upper()}" + (f": {p.note}" if p.note else "")


Metric = Callable[[PathResult], "float | None"]

METRICS: dict[Mode, Metric] = {
    "throughput": lambda p: p.ms,
    "latency": lambda p: p.latency_ms,
    "host": lambda p: p.host_us,
}


@dataclass(frozen=True)
class Comparison:
    """One target: ``numerator`` against ``denominator`` in one mode, as a ratio or a
    difference (``unit``), judged against ``threshold``."""

    name: str
    description: str
    threshold: float
    op: Literal["<=", ">="]
    mode: Mode
    numerator: PathResult | None
    denominator: PathResult | None
    num_what: str
    den_what: str
    unit: Unit = "x"


def _compare(work: WorkloadResult, c: Comparison) -> TargetResult:
    def result(value: float | None, status: TargetStatus, note: str = "") -> TargetResult:
        return TargetResult(
            work.name, c.name, c.description, value, c.threshold, c.op, status, note, c.unit
        )

    if c.mode not in work.modes:
        return result(None, "N/A", f"the {c.mode} mode was not run")
    metric = METRICS[c.mode]
    api = work.get("api")
    if api is None or api.status != "ok" or metric(api) is None:
        # The public API failing is the failure the target exists to catch, never "N/A".
        return result(None, "FAIL", _why_unusable(api, "the public API path", c.mode))
    values: list[float] = []
    for p, what in ((c.numerator, c.num_what), (c.denominator, c.den_what)):
        value = metric(p) if p is not None and p.status == "ok" else None
        if value is None:
            return result(None, "N/A", _why_unusable(p, what, c.mode))
        values.append(value)
    a, b = values
    value = a - b if c.unit == "us" else a / b
    return result(value, _judge(value, c.threshold, c.op))


def evaluate_targets(work: WorkloadResult) -> list[TargetResult]:
    """Every target that applies to ``work``, judged from its paths."""
    t = work.targets
    api = work.get("api")
    raw = work.get("raw")
    comparisons = [
        Comparison(
            "api-vs-fastest",
            "public API / fastest correct backend",
            t.api_within,
            "<=",
            "throughput",
            api,
            work.fastest("backend"),
            "the public API path",
            "every backend path",
        )
    ]
    if t.host_overhead_us is not None:
        comparisons.append(
            Comparison(
                "host-overhead",
                "public API host µs - raw kernel host µs",
                t.host_overhead_us,
                "<=",
                "host",
                api,
                raw,
                "the public API path",
                "the raw kernel path",
                unit="us",
            )
        )
    if t.latency_within is not None:
        comparisons.append(
            Comparison(
                "latency-vs-raw",
                "public API latency / raw kernel latency",
                t.latency_within,
                "<=",
                "latency",
                api,
                raw,
                "the public API path",
                "the raw kernel path",
            )
        )
    if t.legacy_speedup is not None:
        comparisons.append(
            Comparison(
                "legacy-speedup",
                "fastest legacy / public API",
                t.legacy_speedup,
                ">=",
                "throughput",
                work.fastest("legacy") or work.get("legacy"),
                api,
                "the legacy path",
                "the public API path",
            )
        )
    if t.padded_speedup is not None:
        comparisons.append(
            Comparison(
                "padded-speedup",
                "padded SDPA / public API",
                t.padded_speedup,
                ">=",
                "throughput",
                work.get("padded-sdpa"),
                api,
                "the padded SDPA path",
                "the public API path",
            )
        )
    if t.rope_overhead is not None:
        comparisons.append(
            Comparison(
                "rope-overhead",
                "public API (RoPE + attention) / attention alone",
                t.rope_overhead,
                "<=",
                "throughput",
                api,
                work.fastest("attention-alone"),
                "the public API path",
                "every attention-alone path",
            )
        )
    return [_compare(work, c) for c in comparisons]
