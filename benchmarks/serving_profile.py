"""Where the host time of one model's encodes goes: cProfile of padded sdpa and of the
library's packed path, the same workload, written side by side.

For each path in ``--paths`` (``padded``, ``packed``, ``runner``: sentence-transformers'
tokenisation and pooling around `GraphRunner`, as `serving_bench.py`'s ``st-packed-graphs``):
``--encodes`` encodes under the profiler after two unprofiled warm-ups, the packed path dropping
its shared layouts before each encode (as `serving_bench.py` times it). Writes
``OUT/<workload>.<path>.txt`` (top functions by own time and by cumulative time, per encode)
and prints each path's wall time per encode under the profiler.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_bench as bench

PATHS = ("padded", "packed", "runner")
"""The encodes of a workload this tool can profile (`serving_bench.OneWorkload`'s fields)."""


def _report(profile: cProfile.Profile, encodes: int, rows: int) -> str:
    """The top ``rows`` functions by own time and by cumulative time, in µs per encode."""
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    table: list[tuple[str, float, float, float]] = [
        (f"{path.split('site-packages/')[-1]}:{line}({name})", calls / encodes, own, total)
        for (path, line, name), (_, calls, own, total, _) in raw.items()
    ]
    lines = []
    for title, column in (("own time", 2), ("cumulative time", 3)):
        lines += [f"by {title}, µs per encode", f"{'calls':>8} {'own':>9} {'cumul':>9}  function"]
        for where, calls, own, total in sorted(table, key=lambda r: -float(r[column]))[:rows]:
            own_us, total_us = own / encodes * 1e6, total / encodes * 1e6
            lines.append(f"{calls:8.1f} {own_us:9.1f} {total_us:9.1f}  {where}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--encodes", type=int, default=20)
    parser.add_argument("--rows", type=int, default=60, help="functions listed per order")
    parser.add_argument(
        "--paths",
        default="padded,packed",
        help=f"comma-separated, profiled in this order, from: {', '.join(PATHS)}",
    )
    bench.add_one_model_arguments(parser)
    args = parser.parse_args(argv)
    if args.encodes < 1:
        parser.error("--encodes must be at least 1")
    paths = [name.strip() for name in args.paths.split(",") if name.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        parser.error(f"--paths takes {', '.join(PATHS)}; got {args.paths!r}")
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    for workload in bench.one_model_workloads(parser, args):
        for name in paths:
            encode = getattr(workload, name)
            encode()
            encode()
            bench._sync(device)
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            for _ in range(args.encodes):
                encode()
            bench._sync(device)
            profile.disable()
            per = (time.perf_counter() - start) / args.encodes * 1e3
            stem = workload.name.split(" x ")[0].replace(" ", "-")
            (args.out / f"{stem}.{name}.txt").write_text(_report(profile, args.encodes, args.rows))
            print(f"{workload.name} {name}: {per:.2f} ms per encode under the profiler", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
