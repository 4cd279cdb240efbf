"""The no-cache prefill benchmark (``python3 benchmarks/bench.py``), GPU only, never a timed
test.

Embedding-model workloads (document batches and query batches), each computed by several paths
in one run: the public API and the raw kernel it wraps, every backend alone, attention without
RoPE, the legacy copy-split + paged-cache path with each RoPE it could use, padded SDPA and
torch's ``varlen_attn``, and the public API replayed from a CUDA graph. The engine's view is
timed in four modes (host µs, latency, throughput, graph replay). Each path is checked against
the float64 reference before it is timed, and judged against the machine's floor and the
project's targets.

It lives outside the ``attn_backends`` package and uses its two public faces only
(``attn_backends``, ``attn_backends.plugin``); what it knows about a backend's kernel (fa2 or
fa3, the workspace, where flashinfer's RoPE serves) it asks the built-in plugins. It is not
installed with ``attn-backends``: it runs from a checkout, with ``benchmarks/`` on ``sys.path``
(``benchmarks/bench.py`` does that by being run as a file).

Importing this package needs only torch; matplotlib and the GPU libraries load on use.
"""

from __future__ import annotations

from .cli import add_arguments, main, run
from .results import (
    MODES,
    BenchResult,
    Ceilings,
    HostTiming,
    Mode,
    PathResult,
    WorkloadResult,
)
from .runner import BenchConfig, run_benchmark
from .targets import TargetResult
from .workloads import WORKLOADS, Targets, Workload, get_workload

__all__ = [
    "MODES",
    "WORKLOADS",
    "BenchConfig",
    "BenchResult",
    "Ceilings",
    "HostTiming",
    "Mode",
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
