"""What one benchmark run measures: workloads, modes, iteration counts, budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .results import MODES, Mode
from .timing import HOST_REPEATS
from .workloads import Workload

DEFAULT_ITERS = 50
DEFAULT_WARMUP = 10
DEFAULT_TIME_BUDGET_S = 420.0
"""Start no workload after 7 minutes: with the last one finishing, a run stays near 8."""
GRAPH_TIMINGS: tuple[Mode, ...] = ("throughput", "latency", "host")
"""A graph row is timed in all three: replays are cheap, and the comparison needs each."""


@dataclass(frozen=True)
class BenchConfig:
    """One run's choices; `run_benchmark` records them in the result's ``meta``."""

    workloads: tuple[Workload, ...]
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    """No workload starts once this many seconds have passed since the run began."""
    backends: frozenset[str] | None = None
    """Backends to time alone; ``None``: every registered one."""
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    measure_ceilings: bool = True
    command: str = ""
    modes: tuple[Mode, ...] = MODES
    """Throughput times every path; latency and host time the public API and the raw kernel;
    graph adds the graph-replay rows."""
    host_repeats: int = HOST_REPEATS
