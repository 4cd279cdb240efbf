"""The packed-QKV contract: accepted forms, named rejections that leave the input untouched,
in-place RoPE on valid rows only, zero-copy views, and output shaping."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends._path._contract import split_views, unpack_packed
from attn_backends.errors import BackendFailure, PackedQKVError, ParamsError

SPEC = ab.AttentionSpec(4, 2, 16, torch.float32, causal=True, rope=ab.RopeSpec(1e4))
PARAMS = ab.FMHAParams.from_lengths([3, 1, 5], device="cpu", padded_rows=12)


def qkv(rows=12, width=SPEC.qkv_width, dtype=torch.float32, seed=0):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def backend():
    return ab.select(SPEC, platform="cpu", backend="torch-sdpa").backend


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: qkv().reshape(12, 2, -1), r"3-D tensor"),
        (
            lambda: qkv(width=SPEC.qkv_width - 16),
            r"last dim 112; expected \[rows, \(Hq \+ 2\*Hkv\) \* D\] = \[rows, 128\]",
        ),
        (lambda: qkv(dtype=torch.float16), "dtype float16; expected the spec's float32"),
        (lambda: qkv(rows=8), "8 rows; expected at least token_q_num = 9"),
        (lambda: qkv(width=2 * SPEC.qkv_width)[:, ::2], "column stride 2"),
        (lambda: (qkv(), qkv(), None), "a real K but no V"),
        (lambda: (qkv(), None, qkv()), "a real V but no K"),
        (lambda: (qkv(),), "a tuple of 1 items"),
        (lambda: [qkv()], "a list"),
        (lambda: qkv().to("meta"), "QKV on meta but FMHAParams on cpu"),
    ],
)
def test_rejections_are_named_and_leave_input_untouched(make, match):
    be = backend()
    plan = be.prepare(PARAMS)
    bad = make()
    tensors = [t for t in (bad if isinstance(bad, (tuple, list)) else (bad,)) if t is not None]
    before = [t.clone() for t in tensors if t.device.type != "meta"]
    with pytest.raises(PackedQKVError, match=match):
        be.forward(bad, plan)
    after = [t for t in tensors if t.device.type != "meta"]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_rope_is_in_place_on_valid_q_k_rows_only():
    be = backend()
    x = qkv()
    original = x.clone()
    be.forward(x, be.prepare(PARAMS))
    valid, qk = PARAMS.token_q_num, SPEC.q_width + SPEC.kv_width
    assert not torch.equal(x[:valid, :qk], original[:valid, :qk])
    # position 0 of every sequence is a rotation by zero: unchanged
    starts = [0, 3, 4]
    assert torch.allclose(x[starts, :qk], original[starts, :qk])
    assert torch.equal(x[:, qk:], original[:, qk:])
    assert torch.equal(x[valid:], original[valid:])


def test_views_share_storage_and_trim_padding():
    x = qkv()
    packed = unpack_packed(x, SPEC, PARAMS)
    q, k, v = split_views(packed, SPEC, PARAMS.token_q_num)
    assert q.shape == (9, 4, 16) and k.shape == (9, 2, 16) and v.shape == (9, 2, 16)
    for t in (q, k, v):
        assert t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(v[2, 1], x[2, 96 + 16 : 96 + 32])


def test_empty_tuple_forms_are_accepted():
    empty = torch.empty(0)
    for form in ((qkv(), None, None), (qkv(), empty, empty), (qkv(), None, empty)):
        assert unpack_packed(form, SPEC, PARAMS) is form[0]


def test_plan_from_another_spec_is_refused():
    other = ab.AttentionSpec(4, 2, 16, torch.float32, causal=False)
    plan = ab.select(other, platform="cpu").backend.prepare(PARAMS)
    with pytest.raises(ParamsError, match="prepare"):
        backend().forward(qkv(), plan)


def test_prepare_rejects_non_params():
    with pytest.raises(ParamsError, match="takes FMHAParams"):
        backend().prepare([3, 1, 5])


def test_fp8_scales_accept_floats_or_device_scalars():
    from attn_backends._path._contract import check_fp8_scales

    fp8 = ab.AttentionSpec(4, 2, 16, torch.float8_e4m3fn, causal=True)
    one = torch.ones(())
    check_fp8_scales(fp8, ab.Fp8Scales(0.5, 2.0, 1.0), torch.device("cpu"))
    check_fp8_scales(fp8, ab.Fp8Scales(one, one, one), torch.device("cpu"))
    with pytest.raises(PackedQKVError, match=r"fp8_scales\.q on cpu for QKV on meta"):
        check_fp8_scales(fp8, ab.Fp8Scales(one, one, one), torch.device("meta"))
    with pytest.raises(PackedQKVError, match="without fp8_scales"):
        check_fp8_scales(fp8, None, torch.device("cpu"))


@pytest.mark.parametrize(
    ("scales", "match"),
    [
        ((1.0, -1.0, 1.0), r"fp8_scales\.k is -1\.0"),
        ((0.0, 1.0, 1.0), r"fp8_scales\.q is 0\.0"),
        ((1.0, 1.0, float("nan")), r"fp8_scales\.v is nan"),
        ((1.0, float("inf"), 1.0), r"fp8_scales\.k is inf"),
        ((True, 1.0, 1.0), r"fp8_scales\.q is a bool"),
        (("1", 1.0, 1.0), r"fp8_scales\.q is a str"),
        ((1.0, 1.0, torch.ones(2)), r"fp8_scales\.v has 2 elements"),
        (
            (torch.ones((), dtype=torch.float64), 1.0, 1.0),
            r"fp8_scales\.q has 1 elements of float64",
        ),
        ((torch.tensor(float("nan")), 1.0, 1.0), r"fp8_scales\.q is nan"),
        ((1.0, torch.tensor(-2.0), 1.0), r"fp8_scales\.k is -2\.0"),
        ((1.0, 1.0, torch.zeros(())), r"fp8_scales\.v is 0\.0"),
    ],
)
def test_fp8_scales_are_value_checked_when_built(scales, match):
    with pytest.raises(PackedQKVError, match=match):
        ab.Fp8Scales(*scales)


def test_fp8_scales_rules():
    be = backend()
    one = torch.ones(())
    with pytest.raises(PackedQKVError, match="fp8_scales=None"):
        be.forward(qkv(), be.prepare(PARAMS), fp8_scales=ab.Fp8Scales(one, one, one))


class _DenseBackend(abp.PrefillBackend):
    """Declares needs_contiguous and records what it was handed."""

    name = "dense-probe"
    capabilities = abp.Capabilities(
        platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), needs_contiguous=True
    )
    seen: ClassVar[list[tuple[bool, bool, bool]]] = []

    def plan_kernel(self, spec, params, *, fused_rope):
        return None

    def attend(self, views, plan):
        self.seen.append(
            (views.q.is_contiguous(), views.k.is_contiguous(), views.v.is_contiguous())
        )
        return torch.zeros(views.q.shape, dtype=plan.spec.output_dtype)


def test_contract_copies_only_for_needs_contiguous():
    be = _DenseBackend.bind(SPEC)
    out = be.forward(qkv(), be.prepare(PARAMS))
    assert _DenseBackend.seen[-1] == (True, True, True)
    assert out.shape == (PARAMS.token_q_num, SPEC.q_width)


class _WrongShapeBackend(_DenseBackend):
    name = "wrong-shape"

    def attend(self, views, plan):
        return torch.zeros(views.q.shape[0] + 1, *views.q.shape[1:])


def test_backend_returning_wrong_shape_is_a_named_failure():
    be = _WrongShapeBackend.bind(SPEC)
    with pytest.raises(BackendFailure, match="wrong-shape returned"):
        be.forward(qkv(), be.prepare(PARAMS))
