"""The command-line face of the benchmark: ``python3 benchmarks/bench.py`` from a checkout.

`add_arguments` fills a parser (`main`'s own, or a parent's subcommand) and `run` executes it.
Option destinations are prefixed ``bench_`` so that they never collide with options of a parent
parser. From ``benchmarks/``, ``python3 -m attn_backends_bench`` runs the same command.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

import torch

from .config import DEFAULT_ITERS, DEFAULT_TIME_BUDGET_S, DEFAULT_WARMUP, BenchConfig
from .report import all_targets, from_json, render_markdown, summary_lines, write_json, write_report
from .results import MODES, BenchResult, Mode
from .runner import run_benchmark
from .timing import HOST_REPEATS, MAX_HOST_CALLS
from .workloads import WORKLOADS, Workload, get_workload, workload_names

MIN_ITERS = 30
EXIT_USAGE = 2

PROG = "python3 benchmarks/bench.py"
"""How the command is typed from the repository root (the package is not installed)."""

logger = logging.getLogger("attn_backends_bench")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _workloads(text: str) -> tuple[Workload, ...]:
    try:
        return tuple(get_workload(name) for name in _names(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_modes(text: str) -> tuple[Mode, ...]:
    """``host,latency`` -> the modes in their canonical order; unknown or no names refused."""
    names = _names(text)
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown) or '(none given)'}; known: {','.join(MODES)}"
        )
    return tuple(m for m in MODES if m in names)


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _iters(text: str) -> int:
    value = _non_negative(text)
    if value < MIN_ITERS:
        raise argparse.ArgumentTypeError(
            f"--iters must be at least {MIN_ITERS} (the median is taken of at least {MIN_ITERS} "
            f"calls), got {value}"
        )
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.description = (
        "Benchmark the no-KV-cache prefill paths on a CUDA GPU: the public API against the raw "
        "kernel it wraps (host µs, latency, throughput, CUDA-graph replay), each backend "
        "alone, attention without RoPE, the legacy copy-split + paged-cache path with each "
        "RoPE it could use, padded SDPA and torch varlen_attn; each checked against a float64 "
        "reference, then timed. Every workload in every mode takes about a minute on one "
        "H200 once flashinfer's kernels are compiled; --time-budget-s bounds it."
    )
    parser.add_argument(
        "--out",
        dest="bench_out",
        metavar="DIR",
        type=Path,
        default=None,
        help="write bench.json, bench.md and bench.png here (bench.json also after each "
        "workload, so an interrupted run keeps what it measured)",
    )
    parser.add_argument(
        "--workloads",
        dest="bench_workloads",
        metavar="NAMES",
        type=_workloads,
        default=WORKLOADS,
        help=f"comma-separated subset, in the order given (default: all: "
        f"{','.join(workload_names())})",
    )
    parser.add_argument(
        "--modes",
        dest="bench_modes",
        metavar="MODES",
        type=parse_modes,
        default=MODES,
        help="comma-separated timing modes (default: all: "
        f"{','.join(MODES)}). throughput times every path back-to-back; latency and host time "
        "the public API and the raw kernel; graph adds CUDA-graph replay rows",
    )
    parser.add_argument(
        "--host-repeats",
        dest="bench_host_repeats",
        metavar="N",
        type=_positive,
        default=HOST_REPEATS,
        help=f"host mode: repeats of the timed calls, median reported (default {HOST_REPEATS})",
    )
    parser.add_argument(
        "--backends",
        dest="bench_backends",
        metavar="NAMES",
        type=_names,
        default=None,
        help="comma-separated backends to time alone (default: every registered one); the "
        "public-API path always uses whatever the selector picks",
    )
    parser.add_argument(
        "--iters",
        dest="bench_iters",
        metavar="N",
        type=_iters,
        default=DEFAULT_ITERS,
        help=f"timed calls per path and mode, median reported (default {DEFAULT_ITERS}, at "
        f"least {MIN_ITERS}); host mode times this many calls in a row, at most "
        f"{MAX_HOST_CALLS}",
    )
    parser.add_argument(
        "--warmup",
        dest="bench_warmup",
        metavar="N",
        type=_non_negative,
        default=DEFAULT_WARMUP,
        help=f"untimed calls before timing each path (default {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--time-budget-s",
        dest="bench_time_budget_s",
        metavar="S",
        type=_seconds,
        default=DEFAULT_TIME_BUDGET_S,
        help="start no new workload after this many seconds; the ones left are recorded as "
        f"skipped (default {DEFAULT_TIME_BUDGET_S:g})",
    )
    parser.add_argument(
        "--seed",
        dest="bench_seed",
        metavar="N",
        type=_non_negative,
        default=0,
        help="seed of the lengths and the random inputs (default 0)",
    )
    parser.add_argument(
        "--render",
        dest="bench_render",
        metavar="JSON",
        type=Path,
        default=None,
        help="do not measure: rebuild bench.md (and bench.png) from an earlier bench.json; "
        "works without a GPU",
    )


def _log(line: str) -> None:
    logger.info(line)


def _setup_logging() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _finish(result: BenchResult, out: Path | None) -> None:
    if out is not None:
        for path in write_report(result, out, _log):
            _log(f"wrote {path}")
    for line in summary_lines(all_targets(result)):
        _log(line)
    print(render_markdown(result), end="", flush=True)


def _command_line(argv: list[str]) -> str:
    """The command as a person would retype it, for the record."""
    name = Path(argv[0]).name if argv else ""
    if name == "bench.py":
        return shlex.join(["python3", argv[0], *argv[1:]])
    if name == "__main__.py":
        return shlex.join(["python3", "-m", "attn_backends_bench", *argv[1:]])
    return shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or re-render a report); returns the process exit code."""
    _setup_logging()
    out: Path | None = args.bench_out
    render: Path | None = args.bench_render
    if render is not None:
        try:
            result = from_json(render.read_text())
        except (OSError, ValueError) as exc:
            print(f"bench: cannot read {render}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        _finish(result, out)
        return 0
    if not torch.cuda.is_available():
        print(
            "bench: no CUDA device here (torch.cuda.is_available() is False). "
            "The benchmark times GPU kernels and only runs on a machine with a CUDA GPU; use "
            "--render bench.json to rebuild a report from an earlier run.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    backends: list[str] | None = args.bench_backends
    config = BenchConfig(
        workloads=args.bench_workloads,
        iters=args.bench_iters,
        warmup=args.bench_warmup,
        time_budget_s=args.bench_time_budget_s,
        backends=frozenset(backends) if backends is not None else None,
        seed=args.bench_seed,
        command=_command_line(sys.argv),
        modes=args.bench_modes,
        host_repeats=args.bench_host_repeats,
    )

    def checkpoint(partial: BenchResult) -> None:
        if out is not None:
            write_json(partial, out)

    result = run_benchmark(config, log=_log, checkpoint=checkpoint)
    _finish(result, out)
    return 0


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Parse ``argv`` (default: the process's arguments) and run; returns the exit code."""
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    return run(parser.parse_args(argv))
