"""The run's outputs: ``bench.json`` (everything), ``bench.md`` (the tables), ``bench.png``.

The JSON can be read back (`from_json`), so the Markdown and the chart can be made again on
any machine from a GPU run's JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .results import (
    PATH_KINDS,
    PATH_STATUSES,
    BenchResult,
    Ceilings,
    PathKind,
    PathResult,
    PathStatus,
    TargetResult,
    Timing,
    WorkloadResult,
    evaluate_targets,
    floor_ms,
    path_metrics,
    rope_cost,
)
from .workloads import Targets

FORMAT = "attn-backends-bench/1"
JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
CHART_NAME = "bench.png"


# --- JSON ------------------------------------------------------------------------------------


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


def _kind(value: object, where: str) -> PathKind:
    for kind in PATH_KINDS:
        if value == kind:
            return kind
    raise ValueError(f"{where}: unknown path kind {value!r}")


def _status(value: object, where: str) -> PathStatus:
    for status in PATH_STATUSES:
        if value == status:
            return status
    raise ValueError(f"{where}: unknown status {value!r}")


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


def _path(value: object, where: str) -> PathResult:
    d = _map(value, where)
    details = _map(d.get("details", {}), f"{where}.details")
    return PathResult(
        path=_str(d.get("path"), f"{where}.path"),
        kind=_kind(d.get("kind"), f"{where}.kind"),
        label=_str(d.get("label"), f"{where}.label"),
        status=_status(d.get("status"), f"{where}.status"),
        backend=_opt_str(d.get("backend"), f"{where}.backend"),
        details={k: _str(v, f"{where}.details.{k}") for k, v in details.items()},
        rel_error=_opt_num(d.get("rel_error"), f"{where}.rel_error"),
        tolerance=_opt_num(d.get("tolerance"), f"{where}.tolerance"),
        timing=_timing(d.get("timing"), f"{where}.timing"),
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
    )


def _workload(value: object, where: str) -> WorkloadResult:
    d = _map(value, where)
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
    )


def from_dict(data: object) -> BenchResult:
    d = _map(data, "result")
    if d.get("format") != FORMAT:
        raise ValueError(f"not a benchmark result of format {FORMAT}: {d.get('format')!r}")
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


# --- Markdown --------------------------------------------------------------------------------


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms >= 0.1 else f"{ms:.4f}"


def _fmt_x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _fmt_num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _clip(text: str, limit: int = 400) -> str:
    """One line, at most ``limit`` characters: the JSON keeps the full text."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


SHOWN_DETAILS: tuple[str, ...] = (
    "preprocess",
    "flashinfer_backend",
    "pos_encoding_mode",
    "input_layout",
    "trt_input_layout",
    "cache_block",
    "mask",
    "window_size",
)
"""Decision-record details short enough for the table, in this order; the JSON has them all."""


def _details(p: PathResult) -> str:
    shown = [f"{k}={_clip(p.details[k], 40)}" for k in SHOWN_DETAILS if k in p.details]
    return ", ".join(shown)


def _backend(p: PathResult) -> str:
    if p.backend is None:
        return "-"
    if p.kind == "api":
        return f"{p.backend} (by {p.details.get('selected_by', '?')})"
    return p.backend


class _Notes:
    """Numbered footnotes for reasons and errors too long for a table cell."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, text: str) -> int:
        self.items.append(text)
        return len(self.items)


def _check(p: PathResult, notes: _Notes, workload: str) -> str:
    err = "" if p.rel_error is None else f" {p.rel_error:.1e}"
    if p.status == "ok":
        return f"ok{err}"
    text = {"wrong": "WRONG", "error": "error", "skipped": "skipped"}[p.status] + err
    if p.note:
        n = notes.add(f"{workload} / {p.path}: {p.status}: {p.note}")
        text += f" [{n}]"
    return text


def _header_lines(result: BenchResult) -> list[str]:
    meta = result.meta
    device = meta.get("device_name", meta.get("device", "?"))
    versions = [f"torch {meta.get('torch', '?')}"]
    if meta.get("cuda"):
        versions.append(f"CUDA {meta.get('cuda')}")
    versions.append(f"flashinfer {meta.get('flashinfer') or 'not installed'}")
    lines = [
        "## attn-backends benchmark" + ("" if result.complete else " (partial: run not finished)"),
        "",
        f"{device}; {', '.join(versions)}; {meta.get('dtype', '?')}; {meta.get('date', '?')}.",
        f"Median of {meta.get('iters', '?')} calls after {meta.get('warmup', '?')} warm-up "
        "calls, CUDA events around each call, inputs rotated among several buffers so no call "
        "starts with a warm L2. Every path is checked against a float64 reference on fresh "
        "random inputs before it is timed. Public-API paths apply RoPE in place, so each timed "
        "call rotates its buffer again: the values change, the work does not. Every path "
        "computes the same attention, RoPE included.",
    ]
    command = meta.get("command")
    if command:
        lines.append(f"Command: `{command}`")
    if result.ceilings is not None:
        c = result.ceilings
        lines.append(
            f"Ceilings measured in this run: copy {c.copy_bytes_per_s / 1e12:.2f} TB/s "
            f"(bytes read + written, {c.copy_buffer_bytes / 2**30:.0f} GiB buffer), bf16 matmul "
            f"{c.matmul_n}^3 {c.matmul_flops_per_s / 1e12:.0f} TFLOP/s. Floor = max(FLOPs / "
            "matmul rate, bytes / copy bandwidth); FLOPs = 4 * sum(L^2) * Hq * D, halved for "
            "causal; bytes = read Q, K, V + write O."
        )
    else:
        lines.append(f"Ceilings not measured: {meta.get('ceilings_error', 'disabled')}.")
    return lines


def render_markdown(result: BenchResult) -> str:
    notes = _Notes()
    lines = _header_lines(result)
    lines += ["", "### Workloads", ""]
    for w in result.workloads:
        floor = (
            f"; floor {_fmt_ms(floor_ms(w.flops, w.bytes, result.ceilings))} ms"
            if result.ceilings is not None
            else ""
        )
        lines.append(f"- `{w.name}`: {w.title}, {w.shape}; {w.tokens} tokens{floor}.")
    lines += [
        "",
        "### Results (ms per layer)",
        "",
        "ms: the per-layer step (`forward` for the public API). prepare ms: the once-per-batch "
        "`prepare`, host work and its device copies. x floor: ms over the floor. vs legacy and "
        "vs padded SDPA: how many times faster than those paths.",
        "",
        "| workload | path | backend | details | check | ms | TFLOP/s | x floor | vs legacy "
        "| vs padded SDPA | prepare ms |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    not_run: list[str] = []
    for w in result.workloads:
        for p in w.paths:
            if p.kind == "backend" and p.status == "skipped":
                not_run.append(f"{w.name} / {p.backend}: {p.note or 'skipped'}")
                continue
            m = path_metrics(w, p, result.ceilings)
            cells = [
                w.name,
                p.label,
                _backend(p),
                _details(p),
                _check(p, notes, w.name),
                _fmt_ms(p.ms),
                _fmt_num(m.tflops),
                _fmt_x(m.floor_ratio),
                _fmt_x(m.vs_legacy),
                _fmt_x(m.vs_padded, 1),
                _fmt_ms(p.prepare_ms),
            ]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += _targets_table(result)
    lines += _rope_table(result)
    if result.skipped_workloads:
        lines += ["", "### Workloads not run", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in result.skipped_workloads]
    stopped = [w for w in result.workloads if w.note]
    if notes.items or stopped:
        lines += ["", "### Notes", ""]
        lines += [f"{i}. {_clip(text)}" for i, text in enumerate(notes.items, 1)]
        lines += [f"- `{w.name}`: {_clip(w.note or '')}" for w in stopped]
    if not_run:
        lines += ["", "### Backends that refused a workload (not timed)", ""]
        lines += [f"- {_clip(text)}" for text in not_run]
    return "\n".join(lines) + "\n"


def all_targets(result: BenchResult) -> list[TargetResult]:
    return [t for w in result.workloads for t in evaluate_targets(w)]


def _targets_table(result: BenchResult) -> list[str]:
    targets = all_targets(result)
    if not targets:
        return []
    lines = [
        "",
        "### Targets",
        "",
        "| workload | target | value | required | result |",
        "|---|---|---:|---|---|",
    ]
    for t in targets:
        value = _fmt_x(t.value) if t.value is not None else "-"
        status = t.status + (f" ({t.note})" if t.note else "")
        lines.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    t.workload,
                    t.description,
                    value,
                    f"{t.op} {t.threshold:g}x",
                    status,
                )
            )
            + " |"
        )
    passed = sum(t.status == "PASS" for t in targets)
    failed = sum(t.status == "FAIL" for t in targets)
    lines += ["", f"{passed} PASS, {failed} FAIL, {len(targets) - passed - failed} N/A."]
    return lines


def _rope_table(result: BenchResult) -> list[str]:
    rows = []
    copy_bw = result.ceilings.copy_bytes_per_s if result.ceilings is not None else None
    for w in result.workloads:
        if not w.rope_bytes:
            continue
        cost = rope_cost(w)
        if cost is None:
            rows.append(f"| {w.name} | - | - | - | - | - | - |")
            continue
        derived = "-"
        if cost.pass_ms is not None:
            derived = f"{_fmt_ms(cost.pass_ms)} ms"
            if cost.pass_bytes_per_s is not None:
                derived += f", {cost.pass_bytes_per_s / 1e12:.2f} TB/s"
                if copy_bw:
                    derived += f" ({100 * cost.pass_bytes_per_s / copy_bw:.0f}% of copy)"
        target = f" (target <= {w.targets.rope_overhead:g}x)" if w.targets.rope_overhead else ""
        rows.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    w.name,
                    _fmt_ms(cost.api_ms),
                    cost.preprocess,
                    _fmt_ms(cost.alone_ms),
                    cost.alone_backend or "-",
                    _fmt_x(cost.ratio) + target,
                    derived,
                )
            )
            + " |"
        )
    if not rows:
        return []
    return [
        "",
        "### RoPE + attention vs attention alone",
        "",
        "Public API with RoPE against the fastest correct path without RoPE. The RoPE pass is "
        "derived as (public API) - (same backend without RoPE) when RoPE runs as a separate pass; "
        "its bytes are the read + write of the Q and K columns.",
        "",
        "| workload | public API ms | pre-processing | attention alone ms | by | ratio "
        "| derived RoPE pass |",
        "|---|---:|---|---:|---|---:|---|",
        *rows,
    ]


# --- chart -----------------------------------------------------------------------------------


def _chart_label(p: PathResult) -> str:
    if p.kind == "api":
        return "public API"
    if p.kind == "backend":
        return f"{p.backend} alone"
    if p.kind == "attention-alone":
        return f"{p.backend}, no RoPE"
    return {"legacy": "legacy", "padded-sdpa": "padded SDPA", "varlen-attn": "varlen_attn"}[p.kind]


def chart_series(result: BenchResult) -> tuple[list[str], dict[str, list[float | None]]]:
    """Workload names and, per path label, the median ms on each (None where not usable)."""
    names = [w.name for w in result.workloads]
    series: dict[str, list[float | None]] = {}
    for i, w in enumerate(result.workloads):
        for p in w.paths:
            if not p.usable:
                continue
            values = series.setdefault(_chart_label(p), [None] * len(names))
            values[i] = p.ms
    return names, series


def render_chart(result: BenchResult, path: Path) -> str | None:
    """Write the chart to ``path``; returns why it was not written, or None."""
    names, series = chart_series(result)
    if not series:
        return "no path was both correct and timed; nothing to plot"
    try:
        import matplotlib
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); install the 'bench' extra for the chart"
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(9.0, 2.2 * len(names) + 4), 5.5))
    for j, (label, values) in enumerate(series.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("ms per layer (median, log scale)")
    device = result.meta.get("device_name", result.meta.get("device", ""))
    ax.set_title(f"No-cache prefill attention, {result.meta.get('dtype', '')}, {device}")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return None


def write_report(
    result: BenchResult, out_dir: Path, log: Callable[[str], None] = lambda line: None
) -> list[Path]:
    """Write the JSON, the Markdown and (when matplotlib is there) the chart."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_json(result, out_dir)]
    md = out_dir / MARKDOWN_NAME
    md.write_text(render_markdown(result))
    written.append(md)
    chart = out_dir / CHART_NAME
    try:
        reason = render_chart(result, chart)
    except Exception as exc:  # a plotting failure must not lose the measurements
        reason = f"chart failed: {type(exc).__name__}: {exc}"
    if reason is None:
        written.append(chart)
    else:
        log(f"no {CHART_NAME}: {reason}")
    return written


def write_json(result: BenchResult, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / JSON_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(to_json(result))
    tmp.replace(path)
    return path


def summary_lines(targets: Sequence[TargetResult]) -> list[str]:
    """One line per target, for the log."""
    out = []
    for t in targets:
        value = "-" if t.value is None or math.isnan(t.value) else f"{t.value:.2f}x"
        out.append(
            f"{t.status:<4} {t.workload}: {t.description} = {value} "
            f"(required {t.op} {t.threshold:g}x){' - ' + t.note if t.note else ''}"
        )
    return out
