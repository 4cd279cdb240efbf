"""Attention sinks on an NVIDIA GPU, through each CUDA backend that declares them, against
GPT-OSS's own eager attention on the same device (tests/test_hf_sinks.py's model, with heads
of 64, a size every CUDA kernel serves). The conformance suite checks the same backends against
the float64 reference; this checks the whole path from transformers' ``s_aux``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn_backends as ab  # noqa: E402
from attn_backends.integrations import transformers as abt  # noqa: E402
from tests import hf_support as hf  # noqa: E402
from tests import test_hf_sinks as cpu  # noqa: E402

pytestmark = pytest.mark.gpu

BACKENDS = {
    "torch-varlen": "attn_backends_varlen",
    "fa4": "attn_backends_fa4",
    "torch-sdpa": "attn_backends_reference",
}
"""Backend -> the attention implementation name it is pinned under. No name holds "sdpa":
transformers reads any name containing it as its own sdpa path (and GPT-OSS refuses that)."""
LIBRARY_CODES = {ab.ReasonCode.LIBRARY_MISSING}


def _served_by(backend: str) -> str:
    spec = ab.AttentionSpec(4, 2, 64, torch.bfloat16, causal=True, attention_sinks=True)
    try:
        ab.select(spec, device="cuda", backend=backend)
    except ab.NoBackendError as exc:
        codes = {r.code for _, rs in exc.reasons for r in rs}
        if codes <= LIBRARY_CODES:
            pytest.skip(f"{backend} is not installed here: {exc}")
        raise
    return abt.register(BACKENDS[backend], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_oss_sinks_on_cuda_match_eager(backend, monkeypatch):
    name = _served_by(backend)
    monkeypatch.setattr(cpu, "NAME", name)
    model, _ = cpu._model(torch.bfloat16, head_dim=64)
    model = model.cuda()
    anchor_model, _ = cpu._model(torch.float32, head_dim=64)
    anchor_model = anchor_model.cuda()
    _, ids, mask = cpu._batch()
    ids, mask = ids.cuda(), mask.cuda()
    eager = cpu._valid(hf.run(model, "eager", input_ids=ids, attention_mask=mask), mask)
    anchor = cpu._valid(hf.run(anchor_model, "eager", input_ids=ids, attention_mask=mask), mask)
    got = cpu._served(model, ids, mask)
    own = hf.relative_error(eager, anchor)
    err = hf.relative_error(got, anchor)
    print(f"{backend}: {err:.4g} against fp32 eager (bf16 eager: {own:.4g})")
    assert err <= cpu.BF16_FACTOR * own, (err, own)
    served = {s.name for s in abt.decisions() if s.spec.attention_sinks and s.spec.head_dim == 64}
    assert backend in served
