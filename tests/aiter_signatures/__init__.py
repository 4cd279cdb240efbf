"""aiter's varlen entry-point parameter lists, one module per generation, oldest first.

A generation is a run of releases whose three parameter lists are identical; every tag from
v0.1.7 to v0.1.20.post1 falls in one of these. The fake `aiter` takes one of them and binds every
call to it, so the backend tests run against each generation on CPU.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

from . import v0_1_7, v0_1_7_post3, v0_1_8, v0_1_10, v0_1_11

ENTRY_POINTS = ("mha_varlen_fwd", "fmha_v3_varlen_fwd", "flash_attn_varlen_fp8_pertensor_func")
"""The functions each module declares: what the aiter backends call."""


@dataclass(frozen=True)
class Release:
    """One generation: the version the fake reports, the releases it covers, the stubs."""

    version: str
    covers: str
    stubs: types.ModuleType

    def __str__(self) -> str:
        return self.version


def _release(module: types.ModuleType) -> Release:
    version, covers = module.VERSION, module.RELEASES
    assert isinstance(version, str) and isinstance(covers, str)
    return Release(version, covers, module)


RELEASES = tuple(_release(m) for m in (v0_1_7, v0_1_7_post3, v0_1_8, v0_1_10, v0_1_11))
OLDEST = RELEASES[0]
NEWEST = RELEASES[-1]
