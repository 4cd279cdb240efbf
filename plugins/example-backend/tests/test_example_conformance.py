"""What a vendor runs: the shared conformance suite, bound to this plugin's backend.

Install the plugin first (``pip install -e plugins/example-backend``) so that its entry point
is visible; then ``pytest plugins/example-backend/tests`` runs every case the backend's declared
capabilities imply. ``pytest --attn-backend example-matmul`` runs the same suite with no test
file at all.
"""

from __future__ import annotations

import torch

from attn_backends import AttentionSpec, select
from attn_backends.deploy import get_registry
from attn_backends.testing import NoCachePrefillConformance


class TestExampleMatmulConformance(NoCachePrefillConformance):
    backend_names = ("example-matmul",)


def test_registered_through_its_entry_point() -> None:
    record = next(r for r in get_registry().records() if r.name == "example-matmul")
    assert record.status == "loaded"
    assert record.backends == ("example-matmul",)
    assert record.source.startswith("entry point example-matmul = attn_backends_example.plugin")


def test_never_chosen_unless_named() -> None:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, causal=True)
    assert select(spec, platform="cpu").name != "example-matmul"
    assert select(spec, platform="cpu", backend="example-matmul").name == "example-matmul"
