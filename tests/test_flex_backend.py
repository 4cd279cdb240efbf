"""``flex``: where the selector picks it (windows and ALiBi that flashinfer refuses on CUDA,
soft-capping that the others refuse everywhere), and
its output against the float64 reference for every feature alone and together, causal and
bidirectional, GQA and MHA, on a varlen batch with single-token sequences, padding rows and
strided rows."""

from __future__ import annotations

import zlib
from typing import cast

import pytest
import torch
from attn_backends_builtin import flashinfer, flex, headwise, torch_sdpa

import attn_backends as ab
from attn_backends.deploy import Registry
from attn_backends.reference import TOLERANCE, relative_error
from tests.backend_support import registry_of

CPU = ab.detect_platform("cpu")
SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "assumed"),))
LENGTHS = (7, 1, 20, 1, 12)
"""Varlen, with single-token sequences first and last in the middle of the packed rows."""
PADDING_ROWS = 3
STRIDE_EXTRA = 24
"""Extra columns on each side of the packed rows: the QKV view is not contiguous."""


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The built-in backends that serve these features, flex included."""
    return registry_of(
        {"torch-sdpa": torch_sdpa, "flashinfer": flashinfer, "headwise": headwise, "flex": flex}
    )


def spec_of(causal: bool, *, kv_heads: int = 2, dtype: torch.dtype = torch.float32, **kw):
    return ab.AttentionSpec(8, kv_heads, 64, dtype, causal, **kw)


# Selection: flex only where the faster backends refuse.


def test_selector_picks_flex_for_softcap_on_cpu(registry):
    for causal in (True, False):
        sel = ab.select(spec_of(causal, logit_softcap=30.0), platform=CPU, registry=registry)
        assert sel.name == "flex"
        sdpa = next(c for c in sel.candidates if c.name == "torch-sdpa")
        assert [r.code for r in sdpa.reasons] == [ab.ReasonCode.SOFTCAP]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"window": ab.SlidingWindow.causal(8)},
        {"alibi": ab.AlibiSpec()},
        {"window": ab.SlidingWindow.causal(8), "alibi": ab.AlibiSpec((0.5,) * 8)},
    ],
    ids=["plain", "window", "alibi", "window-alibi-slopes"],
)
def test_selector_keeps_torch_sdpa_where_it_serves_the_spec_on_cpu(registry, kw):
    sel = ab.select(spec_of(True, **kw), platform=CPU, registry=registry)
    assert sel.name == "torch-sdpa"
    ranked = {c.name: c.place for c in sel.candidates}
    flex_rank, sdpa_rank = ranked["flex"], ranked["torch-sdpa"]
    # ranks are places in line (1: tried first): flex stands after torch-sdpa on CPU
    assert flex_rank is not None and sdpa_rank is not None and sdpa_rank < flex_rank


@pytest.mark.parametrize(
    ("spec", "winner"),
    [
        (spec_of(True, dtype=torch.bfloat16, logit_softcap=30.0), "flashinfer"),
        (spec_of(True, dtype=torch.bfloat16, window=ab.SlidingWindow.causal(8)), "flashinfer"),
        (spec_of(True, dtype=torch.bfloat16, alibi=ab.AlibiSpec()), "flashinfer"),
        (spec_of(False, dtype=torch.bfloat16, window=ab.SlidingWindow(4, 4)), "flex"),
        (spec_of(False, dtype=torch.bfloat16, alibi=ab.AlibiSpec()), "flex"),
        (spec_of(True, dtype=torch.float32, window=ab.SlidingWindow.causal(8)), "flex"),
        (
            spec_of(False, dtype=torch.bfloat16, window=ab.SlidingWindow(4, 4), logit_softcap=9.0),
            "flex",
        ),
        (spec_of(True, dtype=torch.float32, logit_softcap=30.0), "flex"),
        (spec_of(True, dtype=torch.bfloat16, alibi=ab.AlibiSpec(), logit_softcap=9.0), "flex"),
        (spec_of(True, dtype=torch.bfloat16), "flashinfer"),
        (spec_of(True, dtype=torch.float32), "torch-sdpa"),
    ],
    ids=[
        "softcap-flashinfer",
        "causal-window-flashinfer",
        "causal-alibi-flashinfer",
        "window-right-flex",
        "alibi-bidir-flex",
        "fp32-window-flex",
        "window-right-softcap",
        "fp32-softcap",
        "alibi-softcap",
        "plain-flashinfer",
        "fp32-plain-sdpa",
    ],
)
def test_selector_on_cuda_dry_run(registry, spec, winner):
    """flashinfer wherever it serves; among the others, flex for windows and ALiBi (measured:
    it evaluates them per block, torch-sdpa materialises a mask per length), torch-sdpa for
    plain specs."""
    assert ab.select(spec, platform=SM90, registry=registry).name == winner


HW = ab.HeadwiseConfig(frozenset({0}), sink_token_num=2, swa_token_num=4, seqlen_threshold=8)


@pytest.mark.parametrize("platform", [CPU, SM90], ids=["cpu", "sm90"])
def test_flex_serves_headwise_masks_under_its_own_name(registry, platform):
    """Headwise masks are one more term of flex's mask: the selector picks flex, and the
    former name ``headwise`` (flex with no row in the ranking table) runs only when asked for."""
    spec = spec_of(True, dtype=torch.bfloat16, headwise=HW)
    sel = ab.select(spec, platform=platform, registry=registry)
    assert sel.name == "flex"
    former = next(c for c in sel.candidates if c.name == "headwise")
    assert former.verdict == "not ranked"
    assert [r.code for r in former.reasons] == [ab.ReasonCode.NOT_RANKED]
    assert ab.select(spec, backend="headwise", platform=platform, registry=registry).name == (
        "headwise"
    )


# Numbers against the float64 reference.


def strided_batch(spec: ab.AttentionSpec, seed: int):
    """Seeded N(0, 1) packed rows as a column slice of a wider buffer, padding rows holding a
    large value that shows up in the output if a kernel reads them."""
    tokens = sum(LENGTHS)
    rows = tokens + PADDING_ROWS
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu", padded_rows=rows)
    gen = torch.Generator().manual_seed(seed)
    backing = torch.randn(rows, spec.qkv_width + 2 * STRIDE_EXTRA, generator=gen)
    backing[tokens:] = 1.0e4
    qkv = backing.to(spec.dtype)[:, STRIDE_EXTRA : STRIDE_EXTRA + spec.qkv_width]
    assert not qkv.is_contiguous()
    return params, qkv


FEATURES: dict[str, dict[str, object]] = {
    "window": {"window": (5, 3)},
    "softcap": {"logit_softcap": 2.0},
    "softcap-scale": {"logit_softcap": 1.5, "softmax_scale": 0.6},
    "alibi": {"alibi": ab.AlibiSpec()},
    "alibi-slopes": {"alibi": ab.AlibiSpec(tuple(0.9 / (h + 1) for h in range(8)))},
    "all": {"window": (4, 2), "logit_softcap": 3.0, "alibi": ab.AlibiSpec()},
    "headwise": {"headwise": HW},
    "headwise-all": {
        "headwise": HW,
        "window": (6, 0),
        "logit_softcap": 3.0,
        "alibi": ab.AlibiSpec(),
    },
    "all-rope-logn": {
        "window": (6, 1),
        "logit_softcap": 4.0,
        "alibi": ab.AlibiSpec(),
        "rope": ab.RopeSpec(1e4),
        "use_logn_attn": True,
        "logn_base": 4,
    },
}
"""A ``window`` of ``(left, right)`` keeps ``right`` on bidirectional specs only; headwise
specs run causal only."""


def feature_spec(name: str, causal: bool, kv_heads: int, dtype: torch.dtype):
    kw = dict(FEATURES[name])
    if "headwise" in kw and not causal:
        pytest.skip("headwise masks are causal")
    if "window" in kw:
        left, right = cast(tuple[int, int], kw["window"])
        kw["window"] = ab.SlidingWindow(left, 0 if causal else right)
    return spec_of(causal, kv_heads=kv_heads, dtype=dtype, **kw)


@pytest.mark.parametrize("kv_heads", [2, 8], ids=["gqa", "mha"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_flex_matches_the_reference(registry, feature, causal, kv_heads):
    dtype = torch.float32
    spec = feature_spec(feature, causal, kv_heads, dtype)
    params, qkv = strided_batch(spec, seed=zlib.crc32(f"{feature}-{causal}-{kv_heads}".encode()))
    sel = ab.select(spec, backend="flex", platform=CPU, registry=registry)
    expected = ab.reference_attention(qkv, spec, params)
    out = sel.backend.forward(qkv.clone(), sel.backend.prepare(params))
    assert out.shape == (sum(LENGTHS), spec.q_width)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flex_matches_the_reference_in_16_bit(registry, dtype):
    spec = feature_spec("all", False, 2, dtype)
    params, qkv = strided_batch(spec, seed=7)
    sel = ab.select(spec, backend="flex", platform=CPU, registry=registry)
    out = sel.backend.forward(qkv.clone(), sel.backend.prepare(params))
    assert out.dtype == dtype
    assert relative_error(out, ab.reference_attention(qkv, spec, params)) < TOLERANCE[dtype]


def test_softcap_acts_on_the_scaled_score(registry):
    """flex matches scale-then-cap, and is far from cap-then-scale (the same as capping the
    scaled score at ``cap * scale``), so the order is checked, not assumed."""
    cap, scale = 1.5, 0.6
    spec = spec_of(True, logit_softcap=cap, softmax_scale=scale)
    params, qkv = strided_batch(spec, seed=3)
    sel = ab.select(spec, backend="flex", platform=CPU, registry=registry)
    out = sel.backend.forward(qkv.clone(), sel.backend.prepare(params))
    swapped = ab.reference_attention(
        qkv, spec_of(True, logit_softcap=cap * scale, softmax_scale=scale), params
    )
    tolerance = TOLERANCE[torch.float32]
    assert relative_error(out, ab.reference_attention(qkv, spec, params)) < tolerance
    assert relative_error(out, swapped) > 100 * tolerance
