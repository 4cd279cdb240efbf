"""The shipped conformance suite, bound to ``torch-varlen`` on this machine's device (fp16 and
bf16, GQA and MHA, every window case its capabilities generate); off CUDA every case skips,
naming the platform."""

from __future__ import annotations

from attn_backends.testing import NoCachePrefillConformance


class TestTorchVarlenConformance(NoCachePrefillConformance):
    backend_names = ("torch-varlen",)
