"""Graph mode on CPU: the bucket's fixed sequence list, re-planning in place on a fake
flashinfer, numbers against the reference, and every refusal named.

Capture and replay need a GPU; the conformance suite runs them there (``test_graph_mode``)."""

from __future__ import annotations

import pytest
import torch
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin.flashinfer import GraphRagged

import attn_backends as ab
import attn_backends.errors
import attn_backends.plugin as abp
import attn_backends.reference
from attn_backends._path._graph import PAD_CHUNK, slot_lengths
from tests.fakes.fake_flashinfer import FakeFlashinfer, install

SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))
INIT = "BatchPrefillWithRaggedKVCacheWrapper.__init__"
PLAN = "BatchPrefillWithRaggedKVCacheWrapper.plan"
SPEC = ab.AttentionSpec(8, 2, 64, torch.bfloat16, causal=True)
BUCKET = ab.GraphBucket(max_tokens=160, max_batch=5)


@pytest.fixture
def fake(monkeypatch) -> FakeFlashinfer:
    monkeypatch.setattr(flashinfer_plugin, "device_sm", lambda device: 90)
    return install(monkeypatch)


def graph_plan(
    spec=SPEC, bucket=BUCKET, name="flashinfer"
) -> tuple[ab.CudaGraphPrefill, ab.GraphPlan]:
    backend = ab.select(spec, backend=name, platform=SM90, cuda_graph=True).backend
    assert isinstance(backend, ab.CudaGraphPrefill)
    return backend, backend.prepare_graph(bucket, device="cpu")


def batch(lengths, seed, spec=SPEC, rows=BUCKET.max_tokens):
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=rows)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, spec.qkv_width, generator=gen)
    qkv[params.token_q_num :] = 1.0e4  # padding a leaking kernel would show
    return params, qkv.to(spec.dtype)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0, "max_batch": 1}, "max_tokens must be a positive int"),
        ({"max_tokens": 8, "max_batch": True}, "max_batch must be a positive int"),
        ({"max_tokens": 8.0, "max_batch": 1}, "max_tokens must be a positive int"),
        ({"max_tokens": 8, "max_batch": 9}, r"max_batch \(9\) exceeds max_tokens \(8\)"),
        ({"max_tokens": 8, "max_batch": 2, "max_seqlen": 0}, "max_seqlen must be a positive"),
    ],
)
def test_bucket_fields_are_checked(kwargs, match):
    with pytest.raises(ab.errors.ParamsError, match=match):
        ab.GraphBucket(**kwargs)


def test_slot_lengths_cover_the_bucket_in_a_fixed_number_of_sequences():
    bucket = ab.GraphBucket(max_tokens=300, max_batch=4)
    for lengths in [(5, 17, 1), (300,), (1, 2, 3, 4), (0, 7), ()]:
        slots = slot_lengths(bucket, lengths)
        assert len(slots) == bucket.slots == 4 + 5
        assert sum(slots) == bucket.max_tokens
        assert slots[: len(lengths)] == lengths
        assert all(n == 0 for n in slots[len(lengths) : bucket.max_batch])
        assert all(0 <= n <= PAD_CHUNK for n in slots[bucket.max_batch :])


def test_one_wrapper_replanned_in_place_serves_every_batch(fake):
    backend, plan = graph_plan()
    kernel = plan.kernel
    assert isinstance(kernel, GraphRagged)
    indptr = kernel.indptr
    init = fake.named(INIT)
    assert len(init) == 1 and init[0].args["use_cuda_graph"] is True
    assert init[0].args["qo_indptr_buf"] is indptr
    for seed, lengths in enumerate([(5, 17, 1, 32), (40,), (3, 0, 9, 2, 11), (160,), (1,)]):
        params, qkv = batch(lengths, seed)
        plan.update(params)
        pristine = qkv.clone()
        out = backend.forward(qkv, plan)
        assert out.shape == (BUCKET.max_tokens, SPEC.q_width)
        tokens = params.token_q_num
        assert plan.token_q_num == tokens and plan.valid(out).shape == (tokens, SPEC.q_width)
        ref = ab.reference_attention(pristine, SPEC, params)
        assert (
            ab.reference.relative_error(plan.valid(out), ref) < ab.reference.TOLERANCE[SPEC.dtype]
        )
        assert torch.equal(qkv, pristine), "no RoPE: the buffer is not written"
        assert kernel.indptr is indptr, "the captured offsets stay where they were"
        assert indptr.tolist()[-1] == BUCKET.max_tokens
        assert plan.rope_cu.tolist()[-1] == tokens
    assert len(fake.named(INIT)) == 1, "no new wrapper, so no re-capture"
    assert len(fake.named(PLAN)) == 1 + 5
    assert all(call.args["disable_split_kv"] is True for call in fake.named(PLAN)), (
        "graph plans keep split-KV off: its buffers are sized for the bucket's worst case"
    )
    eager = ab.select(SPEC, backend="flashinfer", platform=SM90).backend
    eager.prepare(ab.FMHAParams.from_lengths((9, 40), device="cpu"))
    assert fake.named(PLAN)[-1].args["disable_split_kv"] is False


def test_fused_rope_is_decided_once_per_bucket(fake):
    spec = ab.AttentionSpec(8, 2, 64, torch.bfloat16, causal=True, rope=ab.RopeSpec(1e6))
    short = ab.GraphBucket(max_tokens=128, max_batch=4, max_seqlen=64)
    backend, plan = graph_plan(spec, short, name="flashinfer-rope")
    assert plan.preprocess == "fused"
    params, qkv = batch((64, 30, 1), 3, spec, rows=128)
    plan.update(params)
    pristine = qkv.clone()
    out = backend.forward(qkv, plan)
    ref = ab.reference_attention(pristine, spec, params)
    assert ab.reference.relative_error(plan.valid(out), ref) < ab.reference.TOLERANCE[spec.dtype]
    assert torch.equal(qkv, pristine), "fused RoPE leaves the buffer as it was"
    with pytest.raises(ab.errors.ParamsError, match="a sequence of 65 tokens > 64"):
        plan.update(ab.FMHAParams.from_lengths((65,), device="cpu", padded_rows=128))


@pytest.mark.parametrize(
    ("lengths", "rows", "match"),
    [
        ((5, 5), 150, r"rows 150 != max_tokens 160"),
        ((1,) * 6, 160, "6 sequences > max_batch 5"),
        ((161,), 161, "rows 161 != max_tokens 160"),
    ],
)
def test_a_batch_that_does_not_fit_changes_nothing(fake, lengths, rows, match):
    backend, plan = graph_plan()
    params, qkv = batch((7, 9), 0)
    plan.update(params)
    planned = len(fake.named(PLAN))
    with pytest.raises(ab.errors.ParamsError, match=match):
        plan.update(ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=rows))
    assert plan.params is params and len(fake.named(PLAN)) == planned
    out = backend.forward(qkv.clone(), plan)
    ref = ab.reference_attention(qkv, SPEC, plan.current())
    assert ab.reference.relative_error(plan.valid(out), ref) < ab.reference.TOLERANCE[SPEC.dtype]


def test_forward_before_update_and_wrong_buffers_are_refused(fake):
    backend, plan = graph_plan()
    _, qkv = batch((4,), 0)
    with pytest.raises(ab.errors.ParamsError, match=r"call plan.update\(params\) before forward"):
        backend.forward(qkv, plan)
    plan.update(ab.FMHAParams.from_lengths((4,), device="cpu", padded_rows=160))
    with pytest.raises(ab.errors.PackedQKVError, match="120 rows for a plan of 160 rows"):
        backend.forward(qkv[:120], plan)
    other = ab.select(SPEC, backend="flashinfer", platform=SM90).backend
    eager = other.prepare(ab.FMHAParams.from_lengths((4,), device="cpu", padded_rows=160))
    assert backend.forward(qkv.clone(), eager).shape == (4, SPEC.q_width)


@pytest.mark.parametrize("name", ["torch-sdpa", "trt", "headwise", "flex"])
def test_backends_without_graph_mode_are_refused_with_a_reason(fake, name):
    spec = ab.AttentionSpec(4, 4, 64, torch.float16, causal=True)
    if name == "headwise":
        hw = ab.HeadwiseConfig(frozenset({0}), sink_token_num=2, swa_token_num=4)
        spec = ab.AttentionSpec(4, 4, 64, torch.float16, causal=True, headwise=hw)
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(spec, backend=name, platform=SM90, cuda_graph=True)
    codes = {r.code for _, rs in info.value.reasons for r in rs}
    assert ab.ReasonCode.CUDA_GRAPH in codes
    bound = ab.select(spec, backend=name, platform=SM90).backend
    assert isinstance(bound, abp.PrefillBackend)
    with pytest.raises(ab.errors.GraphModeError, match="does not declare graph mode") as refused:
        bound.prepare_graph(BUCKET, device="cpu")
    assert refused.value.reasons[0][1][0].code is ab.ReasonCode.CUDA_GRAPH


def test_graph_selection_prefers_a_graph_capable_backend(fake):
    spec = ab.AttentionSpec(4, 4, 64, torch.float16, causal=True)
    sel = ab.select(spec, platform=SM90, cuda_graph=True)
    assert sel.name == "flashinfer"
    trt = next(c for c in sel.candidates if c.name == "trt")
    assert any(r.code is ab.ReasonCode.CUDA_GRAPH for r in trt.reasons)


def test_a_rope_pass_that_cannot_be_replayed_is_refused(fake):
    """On CPU tensors the separate pass is torch ops, sized by the host: no graph mode."""
    spec = ab.AttentionSpec(8, 2, 64, torch.bfloat16, causal=True, rope=ab.RopeSpec(1e4))
    backend = ab.select(spec, backend="flashinfer", platform=SM90, cuda_graph=True).backend
    assert isinstance(backend, ab.CudaGraphPrefill)
    with pytest.raises(ab.errors.GraphModeError, match="the torch RoPE/logn pass") as info:
        backend.prepare_graph(BUCKET, device="cpu")
    reason = info.value.reasons[0][1][0]
    assert reason.field == "preprocess" and reason.got == "torch"
    assert len(fake.named(INIT)) == 0, "refused before any wrapper was built"
