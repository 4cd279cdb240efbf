"""The shipped conformance suite, bound to the reference backend on this machine's device."""

from __future__ import annotations

from attn_backends.testing import NoCachePrefillConformance


class TestTorchSdpaConformance(NoCachePrefillConformance):
    backend_names = ("torch-sdpa",)
