"""The module the pytest plugin hands pytest when ``--attn-backend`` is given.

It is not named ``test_*``, so no discovery of an installed package collects it: pytest collects
it only when the plugin names it.
"""

from __future__ import annotations

from attn_backends.testing.suite import NoCachePrefillConformance


class TestNoCachePrefillConformance(NoCachePrefillConformance):
    """Backends come from ``--attn-backend``."""
