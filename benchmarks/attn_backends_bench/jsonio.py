"""``bench.json``: the whole run, written after each workload and readable back (`from_json`),
so the Markdown and the chart can be made again on any machine from a GPU run's JSON.

Format ``attn-backends-bench/2`` adds the engine-view modes (per path ``latency``, ``host`` and
``matches_eager``; per workload ``modes``; the kinds ``raw`` and ``graph``; the status
``unsupported``; the targets ``host_overhead_us`` and ``latency_within``). Files of format 1
still load: they hold throughput timings only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TypeVar

from .results import (
    MODES,
    PATH_KINDS,
    PATH_STATUSES,
    BenchResult,
    Ceilings,
    HostTiming,
    Mode,
    PathResult,
    Timing,
    WorkloadResult,
    engine_view,
    floor_ms,
    path_metrics,
)
from .targets import evaluate_targets
from .workloads import Targets

T = TypeVar("T")

FORMAT = "attn-backends-bench/2"
READABLE_FORMATS = ("attn-backends-bench/1", FORMAT)
V1_MODES: tuple[Mode, ...] = ("throughput",)
"""What a format-1 file measured."""


def to_dict(result: BenchResult) -> dict[str, object]:
    workloads = []
    for work in result.workloads:
        entry = work.to_dict()
        entry["derived"] = {
            "floor_ms": (
                floor_ms(work.flops, work.bytes, result.ceilings)
                if result.ceilings is not None
                else None
            ),
            "paths": {p.path: path_metrics(work, p, result.ceilings).to_dict() for p in work.paths},
            "targets": [t.to_dict() for t in evaluate_targets(work)],
            "engine": engine_view(work).to_dict(),
        }
        workloads.append(entry)
    return {
        "format": FORMAT,
        "complete": result.complete,
        "meta": dict(result.meta),
        "ceilings": result.ceilings.to_dict() if result.ceilings is not None else None,
        "workloads": workloads,
        "skipped_workloads": [
            {"workload": name, "reason": reason} for name, reason in result.skipped_workloads
        ],
    }


def _json_safe(value: object) -> object:
    """JSON has no NaN or infinity: such floats are written as text (``"inf"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(result: BenchResult) -> str:
    return json.dumps(_json_safe(to_dict(result)), indent=2, allow_nan=False) + "\n"


def _map(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _list(value: object, where: str) -> list[object]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _num(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    try:
        return float(value)  # text holds inf/nan, which JSON cannot
    except ValueError:
        raise ValueError(f"{where}: expected a number, got {value!r}") from None


def _opt_num(value: object, where: str) -> float | None:
    return None if value is None else _num(value, where)


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected text, got {value!r}")
    return value


def _opt_str(value: object, where: str) -> str | None:
    return None if value is None else _str(value, where)


def _member(value: object, allowed: tuple[T, ...], what: str, where: str) -> T:
    """``value`` as the member of ``allowed`` (a ``Literal`` type's values) it equals."""
    for member in allowed:
        if value == member:
            return member
    raise ValueError(f"{where}: unknown {what} {value!r}")


def _opt_bool(value: object, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{where}: expected true, false or null, got {value!r}")


def _timing(value: object, where: str) -> Timing | None:
    if value is None:
        return None
    d = _map(value, where)
    return Timing(
        median_ms=_num(d.get("median_ms"), f"{where}.median_ms"),
        p10_ms=_num(d.get("p10_ms"), f"{where}.p10_ms"),
        p90_ms=_num(d.get("p90_ms"), f"{where}.p90_ms"),
        min_ms=_num(d.get("min_ms"), f"{where}.min_ms"),
        iters=_int(d.get("iters"), f"{where}.iters"),
        warmup=_int(d.get("warmup"), f"{where}.warmup"),
        input_sets=_int(d.get("input_sets"), f"{where}.input_sets"),
    )


def _host(value: object, where: str) -> HostTiming | None:
    if value is None:
        return None
    d = _map(value, where)
    return HostTiming(
        median_us=_num(d.get("median_us"), f"{where}.median_us"),
        min_us=_num(d.get("min_us"), f"{where}.min_us"),
        max_us=_num(d.get("max_us"), f"{where}.max_us"),
        calls=_int(d.get("calls"), f"{where}.calls"),
        repeats=_int(d.get("repeats"), f"{where}.repeats"),
    )


def _path(value: object, where: str) -> PathResult:
    d = _map(value, where)
    details = _map(d.get("details", {}), f"{where}.details")
    return PathResult(
        path=_str(d.get("path"), f"{where}.path"),
        kind=_member(d.get("kind"), PATH_KINDS, "path kind", f"{where}.kind"),
        label=_str(d.get("label"), f"{where}.label"),
        status=_member(d.get("status"), PATH_STATUSES, "status", f"{where}.status"),
        backend=_opt_str(d.get("backend"), f"{where}.backend"),
        details={k: _str(v, f"{where}.details.{k}") for k, v in details.items()},
        rel_error=_opt_num(d.get("rel_error"), f"{where}.rel_error"),
        tolerance=_opt_num(d.get("tolerance"), f"{where}.tolerance"),
        timing=_timing(d.get("timing"), f"{where}.timing"),
        latency=_timing(d.get("latency"), f"{where}.latency"),
        host=_host(d.get("host"), f"{where}.host"),
        matches_eager=_opt_bool(d.get("matches_eager"), f"{where}.matches_eager"),
        prepare_ms=_opt_num(d.get("prepare_ms"), f"{where}.prepare_ms"),
        select_ms=_opt_num(d.get("select_ms"), f"{where}.select_ms"),
        note=_opt_str(d.get("note"), f"{where}.note"),
        traceback=_opt_str(d.get("traceback"), f"{where}.traceback"),
    )


def _targets(value: object, where: str) -> Targets:
    d = _map(value, where)
    return Targets(
        api_within=_num(d.get("api_within"), f"{where}.api_within"),
        legacy_speedup=_opt_num(d.get("legacy_speedup"), f"{where}.legacy_speedup"),
        padded_speedup=_opt_num(d.get("padded_speedup"), f"{where}.padded_speedup"),
        rope_overhead=_opt_num(d.get("rope_overhead"), f"{where}.rope_overhead"),
        host_overhead_us=_opt_num(d.get("host_overhead_us"), f"{where}.host_overhead_us"),
        latency_within=_opt_num(d.get("latency_within"), f"{where}.latency_within"),
    )


def _workload(value: object, where: str) -> WorkloadResult:
    d = _map(value, where)
    modes_raw = d.get("modes")
    modes = (
        V1_MODES
        if modes_raw is None
        else tuple(
            _member(m, MODES, "mode", f"{where}.modes") for m in _list(modes_raw, f"{where}.modes")
        )
    )
    return WorkloadResult(
        name=_str(d.get("name"), f"{where}.name"),
        title=_str(d.get("title"), f"{where}.title"),
        shape=_str(d.get("shape"), f"{where}.shape"),
        spec=dict(_map(d.get("spec"), f"{where}.spec")),
        lengths=tuple(_int(n, f"{where}.lengths") for n in _list(d.get("lengths"), where)),
        flops=_num(d.get("flops"), f"{where}.flops"),
        bytes=_int(d.get("bytes"), f"{where}.bytes"),
        rope_bytes=_int(d.get("rope_bytes"), f"{where}.rope_bytes"),
        targets=_targets(d.get("targets"), f"{where}.targets"),
        paths=tuple(
            _path(p, f"{where}.paths[{i}]")
            for i, p in enumerate(_list(d.get("paths"), f"{where}.paths"))
        ),
        elapsed_s=_num(d.get("elapsed_s", 0.0), f"{where}.elapsed_s"),
        note=_opt_str(d.get("note"), f"{where}.note"),
        modes=modes,
    )


def from_dict(data: object) -> BenchResult:
    d = _map(data, "result")
    if d.get("format") not in READABLE_FORMATS:
        raise ValueError(
            f"not a benchmark result of format {' or '.join(READABLE_FORMATS)}: {d.get('format')!r}"
        )
    ceilings_raw = d.get("ceilings")
    ceilings = None
    if ceilings_raw is not None:
        c = _map(ceilings_raw, "ceilings")
        ceilings = Ceilings(
            copy_bytes_per_s=_num(c.get("copy_bytes_per_s"), "ceilings.copy_bytes_per_s"),
            matmul_flops_per_s=_num(c.get("matmul_flops_per_s"), "ceilings.matmul_flops_per_s"),
            copy_buffer_bytes=_int(c.get("copy_buffer_bytes"), "ceilings.copy_buffer_bytes"),
            matmul_n=_int(c.get("matmul_n"), "ceilings.matmul_n"),
        )
    skipped = []
    for i, item in enumerate(_list(d.get("skipped_workloads", []), "skipped_workloads")):
        s = _map(item, f"skipped_workloads[{i}]")
        skipped.append((_str(s.get("workload"), "workload"), _str(s.get("reason"), "reason")))
    complete = d.get("complete", True)
    return BenchResult(
        meta=dict(_map(d.get("meta", {}), "meta")),
        ceilings=ceilings,
        workloads=tuple(
            _workload(w, f"workloads[{i}]")
            for i, w in enumerate(_list(d.get("workloads"), "workloads"))
        ),
        skipped_workloads=tuple(skipped),
        complete=complete if isinstance(complete, bool) else True,
    )


def from_json(text: str) -> BenchResult:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    return from_dict(data)
