"""AttentionSpec / RopeSpec / HeadwiseConfig validation and FMHAParams construction."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attn_backends as ab
import attn_backends.errors


def spec(**kw):
    fields: dict[str, Any] = {
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 64,
        "dtype": torch.bfloat16,
        "causal": True,
    }
    fields.update(kw)
    return ab.AttentionSpec(**fields)


def test_spec_derived_sizes():
    s = spec(rope=ab.RopeSpec(theta=1e4))
    assert s.qkv_width == (8 + 2 * 2) * 64
    assert s.group_size == 4 and s.is_gqa
    assert s.scale == pytest.approx(64**-0.5)
    assert s.rotary_dim == 64
    assert spec(rope=ab.RopeSpec(1e4, rotary_dim=32)).rotary_dim == 32
    assert spec().rotary_dim == 0
    assert spec(dtype=torch.float8_e4m3fn).output_dtype == torch.bfloat16
    assert spec(softmax_scale=0.5).scale == 0.5


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_heads": 0}, "num_heads must be a positive int"),
        ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
        ({"head_dim": -1}, "head_dim must be a positive int"),
        ({"num_kv_heads": True}, "num_kv_heads must be a positive int"),
        ({"dtype": torch.int8}, "dtype must be one of"),
        ({"use_logn_attn": True}, "needs logn_base"),
        ({"logn_base": 8}, "use_logn_attn is False"),
        ({"softmax_scale": 0.0}, "positive finite"),
        ({"softmax_scale": float("nan")}, "positive finite"),
        ({"rope": ab.RopeSpec(1e4, rotary_dim=128)}, "exceeds head_dim"),
        ({"headwise": ab.HeadwiseConfig(frozenset({9}))}, "out of range"),
        (
            {"causal": False, "headwise": ab.HeadwiseConfig(frozenset())},
            "headwise masks are causal",
        ),
    ],
)
def test_spec_rejects(kw, match):
    with pytest.raises(ab.SpecError, match=match):
        spec(**kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"theta": 0.5}, "must be > 1"),
        ({"theta": float("inf")}, "finite"),
        ({"theta": 1e4, "rotary_dim": 3}, "even int >= 0"),
        ({"theta": 1e4, "rotary_dim": -2}, "even int >= 0"),
    ],
)
def test_rope_spec_rejects(kw, match):
    with pytest.raises(ab.SpecError, match=match):
        ab.RopeSpec(**kw)


def test_headwise_config_rejects_negative():
    with pytest.raises(ab.SpecError, match="sink_token_num"):
        ab.HeadwiseConfig(frozenset({0}), sink_token_num=-1)
    with pytest.raises(ab.SpecError, match="retrieval_heads"):
        ab.HeadwiseConfig(frozenset({-1}))


def test_spec_is_hashable_and_frozen():
    assert hash(spec()) == hash(spec())
    with pytest.raises(AttributeError):
        spec().num_heads = 3


def test_params_from_lengths():
    p = ab.FMHAParams.from_lengths([5, 17, 1], device="cpu", padded_rows=30)
    assert p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == [0, 5, 22, 23]
    assert p.cu_seqlens_k.tolist() == [0, 5, 22, 23]
    assert (p.token_q_num, p.token_kv_num, p.rows, p.batch_size) == (23, 23, 30, 3)
    assert (p.max_seqlen_q, p.max_seqlen_k) == (17, 17)
    assert p.positions.dtype == torch.int32
    assert p.positions.tolist() == [*range(5), *range(17), 0]
    assert p.cu_seqlens_host == (0, 5, 22, 23)


def test_params_accept_tensor_lengths_and_zero_prefix():
    p = ab.FMHAParams.from_lengths(torch.tensor([3, 0, 4]), device="cpu", prefix_lengths=[0, 0, 0])
    assert p.cu_seqlens_q.tolist() == [0, 3, 3, 7]
    assert p.positions.tolist() == [0, 1, 2, 0, 1, 2, 3]


@pytest.mark.parametrize(
    ("lengths", "kw", "match"),
    [
        ([], {}, "empty"),
        ([3, -1], {}, "negative"),
        ([0, 0], {}, "all zero"),
        ([3, 4], {"prefix_lengths": [0, 2]}, "cached prefix"),
        ([3, 4], {"prefix_lengths": [0]}, "entries for 2 sequences"),
        ([3, 4], {"padded_rows": 6}, "padded_rows must be"),
        ([3, 2.5], {}, "must hold ints"),
        (torch.tensor([1.0, 2.0]), {}, "integer tensor"),
        ([3], {"device": "nonsense"}, "not a torch device"),
    ],
)
def test_params_reject(lengths, kw, match):
    kw.setdefault("device", "cpu")
    with pytest.raises(ab.errors.ParamsError, match=match):
        ab.FMHAParams.from_lengths(lengths, **kw)
