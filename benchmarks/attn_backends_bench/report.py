"""The run's outputs: ``bench.json`` (everything), ``bench.md`` (the tables), ``bench.png``.

The JSON can be read back (`from_json`), so the Markdown and the chart can be made again on
any machine from a GPU run's JSON. Each output has its own module (`jsonio`, `markdown`,
`chart`); this one writes them and is the face the command line uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from .chart import chart_series, latency_series, render_chart
from .jsonio import FORMAT, from_dict, from_json, to_dict, to_json
from .markdown import all_targets, format_target_value, format_threshold, render_markdown
from .results import BenchResult
from .targets import TargetResult

JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
CHART_NAME = "bench.png"

__all__ = [
    "CHART_NAME",
    "FORMAT",
    "JSON_NAME",
    "MARKDOWN_NAME",
    "all_targets",
    "chart_series",
    "from_dict",
    "from_json",
    "latency_series",
    "render_chart",
    "render_markdown",
    "summary_lines",
    "to_dict",
    "to_json",
    "write_json",
    "write_report",
]


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
        value = "-" if t.value is None or math.isnan(t.value) else format_target_value(t)
        out.append(
            f"{t.status:<4} {t.workload}: {t.description} = {value} "
            f"(required {t.op} {format_threshold(t)}){' - ' + t.note if t.note else ''}"
        )
    return out
