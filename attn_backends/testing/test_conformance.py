"""Collected by the pytest plugin when ``--attn-backend`` is given."""

from __future__ import annotations

from attn_backends.testing.suite import NoCachePrefillConformance


class TestNoCachePrefillConformance(NoCachePrefillConformance):
    """Backends come from ``--attn-backend``."""
