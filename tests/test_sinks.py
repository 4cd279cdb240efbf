"""Attention sinks: the spec flag, the per-layer logits the contract checks, the float64
reference's softmax term, and the refusals of backends without them."""

from __future__ import annotations

import math

import pytest
import torch

import attn_backends as ab
import attn_backends.errors
import attn_backends.reference


def _spec(**kw: object) -> ab.AttentionSpec:
    fields: dict[str, object] = {
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "dtype": torch.float32,
        "causal": True,
        "attention_sinks": True,
    }
    fields.update(kw)
    return ab.AttentionSpec(**fields)  # type: ignore[arg-type]


def _batch(spec: ab.AttentionSpec, lengths: tuple[int, ...], seed: int = 0):
    params = ab.FMHAParams.from_lengths(list(lengths), device="cpu")
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(params.rows, spec.qkv_width, generator=g)
    sinks = torch.randn(spec.num_heads, generator=g) * 2 + 1
    return params, qkv, sinks


def test_the_flag_is_a_real_bool_and_only_recorded_when_on():
    with pytest.raises(ab.SpecError, match="attention_sinks"):
        _spec(attention_sinks="yes")
    assert _spec().to_dict()["attention_sinks"] is True
    assert "attention_sinks" not in _spec(attention_sinks=False).to_dict()


def test_reference_single_token_is_the_value_times_its_share_beside_the_sink():
    """One token sees only itself: ``out = v * e^s / (e^s + e^sink)``, ``s = q.k * scale``."""
    spec = _spec(num_kv_heads=4)
    params, qkv, sinks = _batch(spec, (1,))
    out = ab.reference_attention(qkv, spec, params, sinks=sinks).view(4, 16)
    x = qkv[0].double()
    q, k, v = x[:64].view(4, 16), x[64:128].view(4, 16), x[128:].view(4, 16)
    score = (q * k).sum(-1) * spec.scale
    share = torch.exp(score) / (torch.exp(score) + torch.exp(sinks.double()))
    torch.testing.assert_close(out, v * share[:, None], rtol=1e-12, atol=1e-12)


def test_reference_sinks_of_minus_infinity_are_no_sinks():
    spec = _spec()
    params, qkv, _ = _batch(spec, (5, 9, 1))
    none = torch.full((4,), -math.inf)
    with_inf = ab.reference_attention(qkv, spec, params, sinks=none)
    plain = ab.reference_attention(qkv, _spec(attention_sinks=False), params)
    torch.testing.assert_close(with_inf, plain, rtol=0, atol=1e-12)


def test_reference_takes_sinks_exactly_with_the_flag():
    spec = _spec()
    params, qkv, sinks = _batch(spec, (3,))
    with pytest.raises(ab.errors.InvalidArgumentError, match="attention_sinks"):
        ab.reference_attention(qkv, spec, params)
    with pytest.raises(ab.errors.InvalidArgumentError, match="attention_sinks"):
        ab.reference_attention(qkv, _spec(attention_sinks=False), params, sinks=sinks)


@pytest.mark.parametrize(
    ("sinks", "match"),
    [
        (None, "no sinks"),
        (torch.zeros(3), "shape"),
        (torch.zeros(4, dtype=torch.int64), "dtype"),
        (torch.zeros(1, 4), "shape"),
        ([0.0, 0.0, 0.0, 0.0], "type list"),
        (torch.zeros(4, device="meta"), "device"),
    ],
)
def test_forward_checks_the_logits_before_writing(sinks, match):
    """With RoPE on, a refused call must leave the buffer as it was."""
    spec = _spec(rope=ab.RopeSpec(1e4))
    params, qkv, _ = _batch(spec, (5, 3))
    sel = ab.select(spec, device="cpu")
    plan = sel.backend.prepare(params)
    before = qkv.clone()
    with pytest.raises(ab.errors.PackedQKVError, match=match):
        sel.backend.forward(qkv, plan, sinks=sinks)
    assert torch.equal(qkv, before)


def test_forward_refuses_sinks_for_a_spec_without_them():
    spec = _spec(attention_sinks=False)
    params, qkv, sinks = _batch(spec, (4,))
    sel = ab.select(spec, device="cpu")
    with pytest.raises(ab.errors.PackedQKVError, match="without attention sinks"):
        sel.backend.forward(qkv, sel.backend.prepare(params), sinks=sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_sdpa_serves_sinks_on_strided_input(dtype, causal):
    spec = _spec(dtype=dtype, causal=causal, window=ab.SlidingWindow(2, 0 if causal else 2))
    params, qkv, sinks = _batch(spec, (5, 1, 12))
    qkv = qkv.to(dtype)
    wide = torch.zeros(qkv.shape[0], qkv.shape[1] + 8, dtype=dtype)
    wide[:, 4:-4] = qkv
    view = wide[:, 4:-4]
    sel = ab.select(spec, device="cpu")
    assert sel.name == "torch-sdpa"
    sinks = sinks.to(dtype)
    out = sel.backend.forward(view, sel.backend.prepare(params), sinks=sinks)
    ref = ab.reference_attention(qkv, spec, params, sinks=sinks)
    assert ab.reference.relative_error(out, ref) < ab.reference.TOLERANCE[dtype] / 4


def test_a_backend_without_sinks_refuses_them_with_the_code():
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(_spec(), device="cpu", backend="flex")
    codes = {r.code for _, reasons in info.value.reasons for r in reasons}
    assert ab.ReasonCode.SINKS in codes
