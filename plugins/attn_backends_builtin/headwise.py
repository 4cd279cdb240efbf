"""``headwise``: the former name of rtp-llm's per-head prefill masks, kept so that
``backend="headwise"``, ``ATTN_BACKEND=headwise`` and installed entry points still resolve.

Headwise masks (`HeadwiseConfig`) are one more term of flex's mask (`_masks.visible`), and
``flex`` declares them: the selector picks ``flex`` for headwise specs. This module registers
the same backend under the old name; the ranking table has no row for it, so it runs only when
chosen by name; it computes exactly what ``flex`` computes.
"""

from __future__ import annotations

from attn_backends.plugin import PluginManifest, hookimpl
from attn_backends_builtin.flex import COMPILE_STATE, FlexBackend, FlexPlan

API_VERSION = "2.0"

HeadwisePlan = FlexPlan
"""The plan type of the former backend: flex's."""

__all__ = ["COMPILE_STATE", "HeadwiseBackend", "HeadwisePlan", "attn_backends_register"]


class HeadwiseBackend(FlexBackend):
    """``flex`` under its former name; never picked without an explicit choice."""

    name = "headwise"


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[HeadwiseBackend])
