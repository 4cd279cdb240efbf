"""The no-cache prefill benchmark (``attn-backends bench``), GPU only, never a timed test.

Five embedding-model workloads, each computed by several paths in one run: the public API,
every backend alone, attention without RoPE, the legacy copy-split + paged-cache path, padded
SDPA and torch's ``varlen_attn``. Each path is checked against the float64 reference before it
is timed, and judged against the machine's floor and the project's targets.

Importing this package needs only torch; matplotlib and the GPU libraries load on use.
"""

from __future__ import annotations

from .cli import add_arguments, main, run
from .results import BenchResult, Ceilings, PathResult, TargetResult, WorkloadResult
from .runner import BenchConfig, run_benchmark
from .workloads import WORKLOADS, Targets, Workload, get_workload

__all__ = [
    "WORKLOADS",
    "BenchConfig",
    "BenchResult",
    "Ceilings",
    "PathResult",
    "TargetResult",
    "Targets",
    "Workload",
    "WorkloadResult",
    "add_arguments",
    "get_workload",
    "main",
    "run",
    "run_benchmark",
]
