"""``bench.md``: one table per mode (host, latency, throughput, graph replay), the targets, the
legacy baselines and what RoPE each path ran, rendered from a `BenchResult` alone."""

from __future__ import annotations

from .results import (
    BenchResult,
    PathResult,
    WorkloadResult,
    engine_view,
    floor_ms,
    path_metrics,
    rope_cost,
)
from .targets import TargetResult, evaluate_targets


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms >= 0.1 else f"{ms:.4f}"


def _fmt_x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _fmt_num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _fmt_us(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _clip(text: str, limit: int = 400) -> str:
    """One line, at most ``limit`` characters: the JSON keeps the full text."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


SHOWN_DETAILS: tuple[str, ...] = (
    "preprocess",
    "rope",
    "flashinfer_backend",
    "pos_encoding_mode",
    "input_layout",
    "trt_input_layout",
    "cache_block",
    "mask",
    "window_size",
    "bucket",
)
"""Decision-record details short enough for the table, in this order; the JSON has them all."""


def _details(p: PathResult) -> str:
    shown = [f"{k}={_clip(p.details[k], 64)}" for k in SHOWN_DETAILS if k in p.details]
    return ", ".join(shown)


def _backend(p: PathResult) -> str:
    if p.backend is None:
        return "-"
    if p.kind in ("api", "graph") and "selected_by" in p.details:
        return f"{p.backend} (by {p.details['selected_by']})"
    return p.backend


class _Notes:
    """Numbered footnotes for reasons and errors too long for a table cell."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, text: str) -> int:
        self.items.append(text)
        return len(self.items)


STATUS_TEXT = {
    "ok": "ok",
    "wrong": "WRONG",
    "error": "error",
    "skipped": "skipped",
    "unsupported": "not supported",
}


def _status_text(p: PathResult) -> str:
    err = "" if p.rel_error is None else f" {p.rel_error:.1e}"
    return STATUS_TEXT[p.status] + err


def _check(p: PathResult, notes: _Notes, workload: str) -> str:
    text = _status_text(p)
    if p.matches_eager is not None:
        text += ", = eager" if p.matches_eager else ", != eager"
    if p.status != "ok" and p.note:
        n = notes.add(f"{workload} / {p.path}: {STATUS_TEXT[p.status]}: {p.note}")
        text += f" [{n}]"
    return text


def _header_lines(result: BenchResult) -> list[str]:
    meta = result.meta
    device = meta.get("device_name", meta.get("device", "?"))
    versions = [f"torch {meta.get('torch', '?')}"]
    if meta.get("cuda"):
        versions.append(f"CUDA {meta.get('cuda')}")
    versions.append(f"flashinfer {meta.get('flashinfer') or 'not installed'}")
    modes = meta.get("modes")
    lines = [
        "## attn-backends benchmark" + ("" if result.complete else " (partial: run not finished)"),
        "",
        f"{device}; {', '.join(versions)}; {meta.get('dtype', '?')}; {meta.get('date', '?')}.",
        f"Modes: {', '.join(map(str, modes)) if isinstance(modes, list) else 'throughput'}. "
        f"Median of {meta.get('iters', '?')} calls after {meta.get('warmup', '?')} warm-up "
        "calls, inputs rotated among several buffers so no call starts with a warm L2"
        + (
            f"; the paths of a workload are timed interleaved, {meta.get('rounds')} rounds per "
            "mode in alternating order, so that clock drift favours none"
            if meta.get("rounds")
            else ""
        )
        + ". Every "
        "path is checked against a float64 reference on fresh random inputs before it is "
        "timed. Public-API and raw-kernel paths apply RoPE in place, so each timed call "
        "rotates its buffer again: the values change, the work does not. Every path computes "
        "the same attention, RoPE included.",
    ]
    if isinstance(modes, list):
        lines.append(
            "Throughput: CUDA events around each of many back-to-back calls (the GPU queue "
            "hides host time). Latency: wall clock from a synchronised device to the end of "
            "one call's work (what one small request waits). Host: wall clock of "
            f"{meta.get('host_calls', '?')} calls in a row without a sync, per call, median of "
            f"{meta.get('host_repeats', '?')} repeats with a sync between them (what the "
            "engine's CPU pays per layer). Graph: the public API's `forward` captured once in "
            "a CUDA graph and replayed; checked bit for bit against the eager `forward` of the "
            "same graph plan. The raw kernel is the API plan's own kernels called by hand: the "
            "same RoPE kernel, then flashinfer's `run` on views of the packed rows."
        )
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


def _target_cell(targets: list[TargetResult], name: str) -> str:
    t = next((t for t in targets if t.target == name), None)
    if t is None:
        return "-"
    return f"{t.status} ({t.op} {format_threshold(t)})"


def format_threshold(t: TargetResult) -> str:
    return f"{t.threshold:g} µs" if t.unit == "us" else f"{t.threshold:g}x"


def _api_text(work: WorkloadResult) -> str:
    api = work.get("api")
    if api is None or api.backend is None:
        return "-"
    return f"{api.backend}, {api.details.get('preprocess', '?')}"


def _measured(result: BenchResult, mode: str) -> list[WorkloadResult]:
    return [w for w in result.workloads if mode in w.modes]


def _host_table(result: BenchResult) -> list[str]:
    works = _measured(result, "host")
    if not works:
        return []
    lines = [
        "",
        "### Host: µs of CPU per `forward` call",
        "",
        "API - raw: what the contract adds to the raw kernel call. Graph replay: the host cost "
        "of `g.replay()` for the whole captured call.",
        "",
        "| workload | public API (RoPE pass) | API µs | raw µs | API - raw µs | target "
        "| graph replay µs |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for w in works:
        api, raw, view = w.get("api"), w.get("raw"), engine_view(w)
        lines.append(
            _row(
                [
                    w.name,
                    _api_text(w),
                    _fmt_us(api.host_us if api is not None else None),
                    _fmt_us(raw.host_us if raw is not None else None),
                    _fmt_us(view.host_overhead_us, signed=True),
                    _target_cell(evaluate_targets(w), "host-overhead"),
                    _fmt_us(view.graph_host_us),
                ]
            )
        )
    return lines


def _latency_table(result: BenchResult) -> list[str]:
    works = _measured(result, "latency")
    if not works:
        return []
    lines = [
        "",
        "### Latency: ms per synchronised call",
        "",
        "| workload | public API (RoPE pass) | API ms | raw ms | API / raw | target "
        "| graph replay ms | graph / raw |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for w in works:
        api, raw, graph, view = w.get("api"), w.get("raw"), w.get("graph"), engine_view(w)
        lines.append(
            _row(
                [
                    w.name,
                    _api_text(w),
                    _fmt_ms(api.latency_ms if api is not None else None),
                    _fmt_ms(raw.latency_ms if raw is not None else None),
                    _fmt_x(view.latency_ratio),
                    _target_cell(evaluate_targets(w), "latency-vs-raw"),
                    _fmt_ms(graph.latency_ms if graph is not None else None),
                    _fmt_x(view.graph_latency_ratio),
                ]
            )
        )
    return lines


def _engine_throughput_table(works: list[WorkloadResult]) -> list[str]:
    lines = [
        "",
        "| workload | public API ms | raw ms | API / raw | graph replay ms "
        "| fastest backend alone |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for w in works:
        api, raw, graph = w.get("api"), w.get("raw"), w.get("graph")
        fastest = w.fastest("backend")
        lines.append(
            _row(
                [
                    w.name,
                    _fmt_ms(api.ms if api is not None else None),
                    _fmt_ms(raw.ms if raw is not None else None),
                    _fmt_x(engine_view(w).throughput_ratio),
                    _fmt_ms(graph.ms if graph is not None else None),
                    f"{_fmt_ms(fastest.ms)} {fastest.backend}" if fastest is not None else "-",
                ]
            )
        )
    return lines


def _throughput_tables(result: BenchResult, notes: _Notes, not_run: list[str]) -> list[str]:
    works = _measured(result, "throughput")
    if not works:
        return []
    lines = [
        "",
        "### Throughput: ms per layer, back-to-back",
        *_engine_throughput_table(works),
        "",
        "Every path. ms: the per-layer step (`forward` for the public API). prepare ms: the "
        "once-per-batch `prepare`, host work and its device copies. x floor: ms over the "
        "floor. vs legacy (the fastest correct legacy variant) and vs padded SDPA: how many "
        "times faster than those paths.",
        "",
        "| workload | path | backend | details | check | ms | TFLOP/s | x floor | vs legacy "
        "| vs padded SDPA | prepare ms |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w in works:
        for p in w.paths:
            if p.kind == "graph":
                continue  # their own table
            if p.kind == "backend" and p.status == "skipped":
                not_run.append(f"{w.name} / {p.backend}: {p.note or 'skipped'}")
                continue
            m = path_metrics(w, p, result.ceilings)
            lines.append(
                _row(
                    [
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
                )
            )
    return lines


def _legacy_table(result: BenchResult) -> list[str]:
    rows = []
    for w in result.workloads:
        api = w.get("api")
        api_ms = api.ms if api is not None and api.usable else None
        for p in w.paths:
            if p.kind != "legacy":
                continue
            faster = p.ms / api_ms if p.ms is not None and p.usable and api_ms else None
            rows.append(
                _row(
                    [
                        w.name,
                        p.path,
                        p.details.get("rope", "-"),
                        _status_text(p),
                        _fmt_ms(p.ms),
                        _fmt_x(faster),
                    ]
                )
            )
    if not rows:
        return []
    return [
        "",
        "### Legacy baselines: which RoPE each variant ran",
        "",
        "`legacy` rotates its Q/K copies with the fastest in-place RoPE available to it; "
        "`legacy:fused-copy-rope` writes the rotated copies in one pass; `legacy:torch-rope` "
        "is the torch-ops RoPE of the first measurements. The legacy targets use the fastest.",
        "",
        "| workload | legacy path | RoPE | check | ms | public API faster by |",
        "|---|---|---|---|---:|---:|",
        *rows,
    ]


def _graph_table(result: BenchResult, notes: _Notes) -> list[str]:
    rows = []
    for w in _measured(result, "graph"):
        api = w.get("api")
        for p in w.paths:
            if p.kind != "graph":
                continue
            if p.status == "unsupported":
                reason = _clip(p.note or "no reason given", 240)
                cells = [w.name, p.path, _backend(p), "-", f"not supported: {reason}"]
                rows.append(_row(cells + ["-"] * 4))
                continue
            rows.append(
                _row(
                    [
                        w.name,
                        p.path,
                        _backend(p),
                        _details(p),
                        _check(p, notes, w.name),
                        _fmt_ms(p.ms),
                        _fmt_ms(p.latency_ms),
                        _fmt_us(p.host_us),
                        _fmt_ms(api.latency_ms if api is not None else None),
                    ]
                )
            )
    if not rows:
        return []
    return [
        "",
        "### Graph replay",
        "",
        "The bucket holds exactly the batch (no padding rows). check: against the float64 "
        "reference, and `= eager` when the replay equals the eager `forward` of the same graph "
        "plan bit for bit. Replay ms: back-to-back; latency ms: one synchronised replay.",
        "",
        "| workload | path | backend | details | check | replay ms | replay latency ms "
        "| replay host µs | eager API latency ms |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
        *rows,
    ]


def all_targets(result: BenchResult) -> list[TargetResult]:
    return [t for w in result.workloads for t in evaluate_targets(w)]


def format_target_value(t: TargetResult) -> str:
    if t.value is None:
        return "-"
    return f"{t.value:+.1f} µs" if t.unit == "us" else f"{t.value:.2f}x"


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
        status = t.status + (f" ({t.note})" if t.note else "")
        lines.append(
            _row(
                [
                    t.workload,
                    t.description,
                    format_target_value(t),
                    f"{t.op} {format_threshold(t)}",
                    status,
                ]
            )
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
            _row(
                [
                    w.name,
                    _fmt_ms(cost.api_ms),
                    cost.preprocess,
                    _fmt_ms(cost.alone_ms),
                    cost.alone_backend or "-",
                    _fmt_x(cost.ratio) + target,
                    derived,
                ]
            )
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


def _workload_lines(result: BenchResult) -> list[str]:
    lines = ["", "### Workloads", ""]
    for w in result.workloads:
        floor = (
            f"; floor {_fmt_ms(floor_ms(w.flops, w.bytes, result.ceilings))} ms"
            if result.ceilings is not None
            else ""
        )
        lines.append(f"- `{w.name}`: {w.title}, {w.shape}; {w.tokens} tokens{floor}.")
    return lines


def render_markdown(result: BenchResult) -> str:
    notes = _Notes()
    not_run: list[str] = []
    lines = _header_lines(result) + _workload_lines(result)
    lines += _host_table(result)
    lines += _latency_table(result)
    lines += _throughput_tables(result, notes, not_run)
    lines += _graph_table(result, notes)
    lines += _targets_table(result)
    lines += _legacy_table(result)
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
