"""The shipped conformance suite, bound to ``flex`` on this machine's device (fp32 and the
16-bit dtypes it declares, every window, soft-cap and ALiBi case its capabilities generate)."""

from __future__ import annotations

from attn_backends.testing import NoCachePrefillConformance


class TestFlexConformance(NoCachePrefillConformance):
    backend_names = ("flex",)
