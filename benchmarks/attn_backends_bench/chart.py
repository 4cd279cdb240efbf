"""``bench.png``: ms per layer of every correct path (throughput), and beneath it the engine's
view (latency of the public API, the raw kernel and the graph replay), log scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .results import BenchResult, PathResult

Series = dict[str, list[float | None]]

LEGACY_LABELS = {
    "legacy": "legacy",
    "legacy:fused-copy-rope": "legacy, fused-copy RoPE",
    "legacy:torch-rope": "legacy, torch RoPE",
}


def _chart_label(p: PathResult) -> str:
    if p.kind == "api":
        return "public API"
    if p.kind == "raw":
        return "raw kernel"
    if p.kind == "graph":
        return "graph replay" if p.path == "graph" else f"{p.backend} graph replay"
    if p.kind == "backend":
        return f"{p.backend} alone"
    if p.kind == "attention-alone":
        return f"{p.backend}, no RoPE"
    if p.kind == "legacy":
        return LEGACY_LABELS.get(p.path, p.path)
    return {"padded-sdpa": "padded SDPA", "varlen-attn": "varlen_attn"}[p.kind]


def chart_series(result: BenchResult) -> tuple[list[str], Series]:
    """Workload names and, per path label, the back-to-back median ms on each (None where not
    usable)."""
    names = [w.name for w in result.workloads]
    series: Series = {}
    for i, w in enumerate(result.workloads):
        for p in w.paths:
            if not p.usable:
                continue
            values = series.setdefault(_chart_label(p), [None] * len(names))
            values[i] = p.ms
    return names, series


def latency_series(result: BenchResult) -> Series:
    """Per label (public API, raw kernel, graph replay), the latency ms on each workload."""
    names = [w.name for w in result.workloads]
    series: Series = {}
    for i, w in enumerate(result.workloads):
        for path in ("api", "raw", "graph"):
            p = w.get(path)
            if p is None or p.status != "ok" or p.latency_ms is None:
                continue
            series.setdefault(_chart_label(p), [None] * len(names))[i] = p.latency_ms
    return series


def _bars(ax: Any, names: list[str], series: Series, ylabel: str, colors: dict[str, Any]) -> None:
    # Any: matplotlib ships no type information.
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, ys, width=width, label=label, color=colors[label])
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def render_chart(result: BenchResult, path: Path) -> str | None:
    """Write the chart to ``path``; returns why it was not written, or None."""
    names, series = chart_series(result)
    latency = latency_series(result)
    if not series and not latency:
        return "no path was both correct and timed; nothing to plot"
    try:
        import matplotlib
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); install the 'bench' extra for the chart"
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    panels = [(s, label) for s, label in ((series, "throughput"), (latency, "latency")) if s]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(9.0, 1.6 * len(names) + 5), 5.0 * len(panels)), squeeze=False
    )
    ylabels = {
        "throughput": "ms per layer, back-to-back (median, log)",
        "latency": "ms per synchronised call (median, log)",
    }
    palette = plt.get_cmap("tab20")
    labels = list(dict.fromkeys([*series, *latency]))  # one colour per path in both panels
    colors = {label: palette(i % 20) for i, label in enumerate(labels)}
    for ax, (values, mode) in zip(axes[:, 0], panels, strict=True):
        _bars(ax, names, values, ylabels[mode], colors)
    device = result.meta.get("device_name", result.meta.get("device", ""))
    axes[0, 0].set_title(f"No-cache prefill attention, {result.meta.get('dtype', '')}, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
