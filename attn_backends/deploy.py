"""What an engine does around selection when it starts and runs: load and manage plugins,
build kernels ahead of traffic, prove the winner with a canary, agree across ranks, and reset
the process-wide caches.
"""

from __future__ import annotations

from ._path._preprocess import clear_preprocess_cache
from ._select._canary import CanaryResult, run_canary
from ._select._distributed import (
    RankDecision,
    RankMismatchError,
    check_consistent_across_ranks,
    select_across_ranks,
)
from ._select._policy import PluginPolicy
from ._select._registry import BackendEntry, PluginRecord, Registry, get_registry, reset_registry
from ._select._selector import clear_selection_cache
from ._select._warmup import WarmupReport, WarmupStep, warmup

__all__ = [
    "BackendEntry",
    "CanaryResult",
    "PluginPolicy",
    "PluginRecord",
    "RankDecision",
    "RankMismatchError",
    "Registry",
    "WarmupReport",
    "WarmupStep",
    "check_consistent_across_ranks",
    "clear_preprocess_cache",
    "clear_selection_cache",
    "get_registry",
    "reset_registry",
    "run_canary",
    "select_across_ranks",
    "warmup",
]
