"""The feature table: one descriptor per feature, what the core derives from it, the bounds
every constructor states (each value it accepts is computed by every backend declaring the
feature, without overflow or NaN), the one mask definition both built-in mask paths run, and
one stored form for ALiBi slopes that mean the same."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from attn_backends_builtin import _masks, flex, torch_sdpa

import attn_backends as ab
import attn_backends.plugin as abp
import attn_backends.reference
from attn_backends._backend import _reference
from attn_backends._select._selector import _spec_line
from attn_backends._values import _feature_table, _features
from attn_backends.testing.cases import conformance_cases, refusal_cases

CPU = ab.detect_platform("cpu")
LENGTHS = (9, 1, 20, 4)


def spec_of(causal: bool = True, dtype: torch.dtype = torch.float32, heads: int = 8, **kw):
    return ab.AttentionSpec(heads, 2, 32, dtype, causal, **kw)


def run(backend: type[abp.PrefillBackend], spec: ab.AttentionSpec, seed: int) -> float:
    """Relative error of ``backend`` against the float64 reference on a seeded varlen batch."""
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(params.token_q_num, spec.qkv_width, generator=gen).to(spec.dtype)
    bound = backend.bind(spec)
    out = bound.forward(qkv.clone(), bound.prepare(params))
    assert torch.isfinite(out).all()
    return ab.reference.relative_error(out, ab.reference_attention(qkv, spec, params))


# ---- the table ------------------------------------------------------------------------------


def test_every_feature_has_one_name_and_one_support_type():
    names = [f.name for f in _feature_table.FEATURES]
    supports = [f.support for f in _feature_table.FEATURES if f.support is not None]
    assert len(set(names)) == len(names) and len(set(supports)) == len(supports)
    assert all(s.feature == _feature_table.feature_named(s.feature).name for s in supports)


def test_capabilities_to_dict_lists_every_field_and_each_feature_with_its_limits():
    caps = flex.FlexBackend.capabilities
    record = caps.to_dict()
    assert set(record) == {f.name for f in dataclasses.fields(caps)} | {"fp8"}
    assert record["features"] == {
        "window": {"right": True},
        "logit_softcap": {},
        "alibi": {"bidirectional": True, "custom_slopes": True, "with_softcap": True},
        "headwise": {},
        "chunk": {},
    }
    assert record["head_dims"] == "any" and record["dtypes"] == ["bfloat16", "float16", "float32"]


def test_explain_names_each_feature_used():
    spec = spec_of(
        window=ab.SlidingWindow.causal(4),
        logit_softcap=30.0,
        alibi=ab.AlibiSpec(),
        headwise=ab.HeadwiseConfig(frozenset({0})),
        rope=ab.RopeSpec(1e4, scaling=ab.RopeScaling("linear", factor=2.0)),
    )
    line = _spec_line(spec)
    assert line.endswith(", headwise, window 3/0, softcap 30, alibi, rope scaling linear"), line


def test_a_backend_declaring_nothing_refuses_each_feature_with_its_code():
    caps = abp.Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))
    base = spec_of()
    for feature in _feature_table.FEATURES:
        fields = feature.refusal_fields(base)
        if feature.support is None or fields is None:
            continue
        reasons = abp.check_capabilities(caps, dataclasses.replace(base, **fields), CPU)
        assert [r.code for r in reasons] == [feature.code], feature.name


def test_each_feature_is_checked_whatever_else_the_spec_asks():
    """A right-reaching window was not checked against a left-only declaration when the spec
    also asked for an undeclared soft-cap (the two checks were one if/elif chain)."""
    caps = abp.Capabilities(
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        features=(abp.WindowSupport(right=False),),
    )
    spec = spec_of(False, window=ab.SlidingWindow(2, 2), logit_softcap=30.0)
    codes = [r.code for r in abp.check_capabilities(caps, spec, CPU)]
    assert codes == [ab.ReasonCode.SLIDING_WINDOW, ab.ReasonCode.SOFTCAP]


def test_generated_cases_follow_the_declared_limits():
    """flashinfer-like limits: no right-reaching windows, causal BLOOM ALiBi without the
    soft-cap. Combined cases leave out what the limits refuse; refusals cover each limit."""
    caps = abp.Capabilities(
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        features=(
            abp.WindowSupport(right=False),
            abp.SoftcapSupport(),
            abp.AlibiSupport(bidirectional=False, custom_slopes=False, with_softcap=False),
        ),
    )
    cases = conformance_cases(caps)
    for case in cases:
        assert not abp.check_capabilities(caps, case.spec, CPU), case.id
    ids = {c.id for c in cases}
    assert {"float32-causal-window-softcap", "float32-causal-window-alibi"} <= ids
    assert not any("softcap-alibi" in i or "bidir-alibi" in i for i in ids)
    refused = {r.id: r.code for r in refusal_cases(caps, CPU)}
    assert {"window-right", "alibi-bidirectional", "alibi-custom-slopes", "alibi-with-softcap"} <= (
        set(refused)
    )


# ---- bounds: what a constructor accepts, every declaring backend computes -------------------


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (
            lambda: ab.SlidingWindow(1, sys.maxsize),
            "SlidingWindow.right must be at most 2147483647",
        ),
        (lambda: ab.SlidingWindow(2**31, 0), "SlidingWindow.left must be at most 2147483647"),
        (lambda: ab.SlidingWindow(10**400, 0), "at most 2147483647"),
        (lambda: ab.SlidingWindow.causal(2**40), "sliding_window must be at most"),
        (lambda: spec_of(logit_softcap=1e39), "from 1e-6 to 1e6"),
        (lambda: spec_of(logit_softcap=10**400), "from 1e-6 to 1e6"),
        (lambda: spec_of(logit_softcap=1e-300), "from 1e-6 to 1e6"),
        (lambda: spec_of(logit_softcap=float("nan")), "from 1e-6 to 1e6"),
        (lambda: ab.AlibiSpec((1e39,) * 8), "slopes[0] must be a number from 0 to 1e6"),
        (lambda: ab.AlibiSpec((0.5, 10**400)), "slopes[1] must be a number from 0 to 1e6"),
        (lambda: ab.AlibiSpec((0.5, -0.25)), "from 0 to 1e6"),
        (lambda: ab.AlibiSpec((float("inf"),)), "from 0 to 1e6"),
        (lambda: ab.HeadwiseConfig(frozenset(), swa_token_num=10**400), "at most 2147483647"),
        (lambda: abp.bloom_alibi_slopes(0), "positive int of heads"),
    ],
    ids=[
        "window-maxsize",
        "window-2**31",
        "window-10**400",
        "hf-window-2**40",
        "softcap-1e39",
        "softcap-10**400",
        "softcap-1e-300",
        "softcap-nan",
        "slope-1e39",
        "slope-10**400",
        "slope-negative",
        "slope-inf",
        "headwise-10**400",
        "bloom-0-heads",
    ],
)
def test_values_past_the_stated_bounds_are_spec_errors(make, words):
    with pytest.raises(ab.SpecError, match=words.replace("*", r"\*").replace("[", r"\[")):
        make()


def test_the_largest_values_stay_short_in_the_message():
    with pytest.raises(ab.SpecError) as caught:
        spec_of(logit_softcap=10**400)
    assert len(str(caught.value)) < 200


WIDEST = _features.MAX_WINDOW
LOW_CAP, HIGH_CAP = _features.SOFTCAP_RANGE
EXTREME_SLOPES = ab.AlibiSpec(tuple((0.0, _features.MAX_ALIBI_SLOPE)[h % 2] for h in range(8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("backend", "causal", "kw"),
    [
        (torch_sdpa.TorchSdpaBackend, False, {"window": ab.SlidingWindow(WIDEST, WIDEST)}),
        (torch_sdpa.TorchSdpaBackend, True, {"window": ab.SlidingWindow(WIDEST, 0)}),
        (torch_sdpa.TorchSdpaBackend, False, {"alibi": EXTREME_SLOPES}),
        (torch_sdpa.TorchSdpaBackend, True, {"alibi": EXTREME_SLOPES}),
        (flex.FlexBackend, False, {"window": ab.SlidingWindow(WIDEST, WIDEST)}),
        (flex.FlexBackend, True, {"logit_softcap": HIGH_CAP, "alibi": EXTREME_SLOPES}),
        (flex.FlexBackend, False, {"logit_softcap": LOW_CAP}),
        (
            flex.FlexBackend,
            True,
            {"headwise": ab.HeadwiseConfig(frozenset({1}), WIDEST, WIDEST, 8)},
        ),
    ],
    ids=[
        "sdpa-widest-window",
        "sdpa-widest-causal-window",
        "sdpa-extreme-slopes-bidir",
        "sdpa-extreme-slopes-causal",
        "flex-widest-window",
        "flex-largest-cap-extreme-slopes",
        "flex-smallest-cap",
        "flex-widest-headwise",
    ],
)
def test_the_bounds_themselves_compute_like_the_reference(backend, causal, kw, dtype):
    spec = spec_of(causal, dtype, **kw)
    assert run(backend, spec, seed=11) < ab.reference.TOLERANCE[dtype]


def test_the_widest_window_is_no_window():
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu")
    qkv = torch.randn(
        params.token_q_num, spec_of().qkv_width, generator=torch.Generator().manual_seed(2)
    )
    wide = spec_of(False, window=ab.SlidingWindow(WIDEST, WIDEST))
    for backend in (torch_sdpa.TorchSdpaBackend, flex.FlexBackend):
        bound = backend.bind(wide)
        out = bound.forward(qkv.clone(), bound.prepare(params))
        plain = ab.reference_attention(qkv, spec_of(False), params)
        assert ab.reference.relative_error(out, plain) < ab.reference.TOLERANCE[torch.float32]


# ---- one stored form for ALiBi slopes that mean the same ------------------------------------


def test_blooms_slopes_written_out_are_alibispec():
    default = spec_of(alibi=ab.AlibiSpec())
    written = spec_of(alibi=ab.AlibiSpec(abp.bloom_alibi_slopes(8)))
    assert written == default and hash(written) == hash(default)
    assert written.alibi is not None and written.alibi.slopes is None
    assert written.to_dict() == default.to_dict()
    fingerprints = {ab.select(s, platform=CPU).fingerprint() for s in (default, written)}
    assert len(fingerprints) == 1


@pytest.mark.parametrize("heads", [8, 12])
def test_blooms_slopes_as_transformers_computes_them_in_float32_are_alibispec(heads):
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)  # slope_h * j, j = 0, 1
    slopes = tuple(float(s) for s in bias[:, 0, 1])
    spec = spec_of(heads=heads, alibi=ab.AlibiSpec(slopes))
    assert spec == spec_of(heads=heads, alibi=ab.AlibiSpec())


def test_other_slopes_stay_as_given():
    slopes = tuple(0.5 / (h + 1) for h in range(8))
    spec = spec_of(alibi=ab.AlibiSpec(slopes))
    assert spec.alibi is not None and spec.alibi.slopes == slopes
    assert spec != spec_of(alibi=ab.AlibiSpec())


# ---- one mask definition, two paths, and an independent reference ----------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": False, "window": ab.SlidingWindow(3, 2)},
        {"causal": True, "window": ab.SlidingWindow(5, 0), "alibi": ab.AlibiSpec()},
        {"causal": False, "alibi": ab.AlibiSpec(tuple(0.1 * h for h in range(8)))},
        {"causal": True, "headwise": ab.HeadwiseConfig(frozenset({2}), 2, 3, 8)},
    ],
    ids=["window", "window-alibi", "alibi-bidir", "headwise"],
)
def test_dense_mask_and_flex_mask_are_one_definition_and_match_the_reference(kw):
    """The dense mask (torch-sdpa) is `visible`/`score` on broadcast aranges; flex's own
    ``create_mask`` over `visible` gives the same keys, and so does the float64 reference."""
    from torch.nn.attention.flex_attention import create_mask

    spec = spec_of(**kw)
    length = 13
    dense = _masks.dense_mask(spec, length, torch.device("cpu"))
    terms = _masks.mask_terms(spec, (length,), torch.device("cpu"))
    by_flex = create_mask(_masks.visible(spec, terms), 1, spec.num_heads, length, length, "cpu")[0]
    seen = dense if dense.dtype == torch.bool else torch.isfinite(dense)
    assert torch.equal(seen.expand(spec.num_heads, length, length), by_flex)
    reference = _reference._mask(spec, length, range(spec.num_heads), torch.device("cpu"))
    assert torch.equal(by_flex, reference)
