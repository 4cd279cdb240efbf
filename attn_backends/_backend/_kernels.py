"""`KernelModule`: one compiled kernel library a backend loads, as warm-up reports it.

Backends whose library compiles kernels on first use (flashinfer's JIT) list the modules a spec
needs, so warm-up can say before it starts how many are already built, roughly how long the
rest will take and where the cache lives, instead of going quiet for minutes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelModule:
    name: str
    """What the library calls it, e.g. ``flashinfer fa3 bfloat16 d128 posenc=NONE``."""
    cached: bool | None
    """Built already (a load, not a compile); None when the library cannot tell."""
    build_cpu_seconds: float | None
    """Rough CPU-seconds to compile it; divide by the build's parallel jobs for wall time."""
    longest_object_seconds: float | None
    """Rough seconds of its slowest object file: no number of jobs builds it faster."""
    cache_dir: str | None
    """Where the library keeps it once built."""
