"""The shipped conformance suite, bound to ``fa4`` on this machine's device: every case its
capabilities generate (float16 and bfloat16, both window sides, soft-capping) on a GPU with
flash-attn-4; elsewhere each case skips with the platform's reasons (CUDA only, not installed).
The same suite runs on CPU through a fake ``flash_attn.cute`` in tests/test_fa4_backend.py."""

from __future__ import annotations

from attn_backends.testing import NoCachePrefillConformance


class TestFa4Conformance(NoCachePrefillConformance):
    backend_names = ("fa4",)
