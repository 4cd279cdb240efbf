"""The float64 oracle every backend is held to, and how its distance is measured.

`reference_attention` computes the spec's attention from its definition, independently of any
plugin's code; `relative_error` against it below `TOLERANCE` is what the conformance suite and
the strict canary accept.
"""

from __future__ import annotations

from ._backend._reference import TOLERANCE, reference_attention, relative_error

__all__ = ["TOLERANCE", "reference_attention", "relative_error"]
