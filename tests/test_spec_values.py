"""The values a spec accepts: every RoPE, scale and scaling value a constructor takes computes
finite tables and finite attention, and everything else is a `SpecError` that says the bound.

Covers extremes that used to pass (an attention factor of 1e300 written into Q/K, a share of
zero rotating the whole head), specs that mean the same comparing unequal, rules that failed
only in ``prepare``, raw Python errors where a `SpecError` is promised, the command line's
``--rope-scaling`` mistakes, and a derandomised fuzz over the numbers.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attn_backends as ab
import attn_backends.integrations as abi
from attn_backends._backend import _reference
from attn_backends._backend._reference import TOLERANCE, reference_attention, relative_error
from attn_backends._path import _rope
from attn_backends._path._preprocess import apply_torch_pass
from attn_backends._select._distributed import rank_fingerprint
from attn_backends._values._records import canonical_json
from attn_backends.cli import main

CPU = ab.parse_platform("cpu")
INT32_MAX = 2**31 - 1
"""Largest position a batch can hold (`FMHAParams` counts tokens in int32)."""


def spec_of(rope: ab.RopeSpec | None, head_dim: int = 64, **kw: Any) -> ab.AttentionSpec:
    fields: dict[str, Any] = {"dtype": torch.float32, "causal": True, **kw}
    return ab.AttentionSpec(4, 2, head_dim, rope=rope, **fields)


def yarn(**kw: Any) -> ab.RopeScaling:
    return ab.RopeScaling("yarn", **{"factor": 4.0, "original_max_position_embeddings": 16, **kw})


def longrope(pairs: int, **kw: Any) -> ab.RopeScaling:
    fields: dict[str, Any] = {
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "short_factor": (1.0,) * pairs,
        "long_factor": (2.0,) * pairs,
        **kw,
    }
    return ab.RopeScaling("longrope", **fields)


def packed_batch(spec: ab.AttentionSpec, lengths: tuple[int, ...], seed: int):
    params = ab.FMHAParams.from_lengths(lengths, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(params.rows, spec.qkv_width, generator=gen).to(spec.dtype), params


# ---------------------------------------------------------------- accepted extremes (4)


@pytest.mark.parametrize(
    "scaling",
    [
        lambda: yarn(attention_factor=1e300),
        lambda: yarn(attention_factor=16.5),
        lambda: yarn(mscale=1e300, mscale_all_dim=1.0),
        lambda: yarn(mscale=-100.0, mscale_all_dim=1.0),  # a negative derived factor
        lambda: longrope(32, attention_factor=1e300),
    ],
    ids=["given-1e300", "given-past-16", "derived-huge", "derived-negative", "longrope-given"],
)
def test_an_attention_factor_past_its_bound_is_refused_with_the_bound(scaling):
    with pytest.raises(ab.SpecError, match=r"must be in \(0, 16\]"):
        scaling()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_largest_accepted_attention_factor_computes_finite_numbers(dtype):
    """At the bound, torch-sdpa's output is finite in every dtype and follows the reference
    (scores 256 times larger magnify the rounding of rotated Q/K in 16-bit types); V is not
    touched."""
    spec = spec_of(ab.RopeSpec(1e4, scaling=yarn(attention_factor=16.0)), dtype=dtype)
    qkv, params = packed_batch(spec, (5, 1, 9), seed=4)
    ref = reference_attention(qkv, spec, params)
    backend = ab.select(spec, backend="torch-sdpa", platform=CPU).backend
    work = qkv.clone()
    out = backend.forward(work, backend.prepare(params))
    assert torch.isfinite(out).all() and torch.isfinite(work).all()
    assert relative_error(out, ref) <= (TOLERANCE[dtype] if dtype == torch.float32 else 0.05)
    v = spec.q_width + spec.kv_width
    assert torch.equal(work[:, v:], qkv[:, v:])


def test_a_share_of_zero_rotates_nothing_as_in_transformers():
    transformers = pytest.importorskip("transformers")
    phi = pytest.importorskip("transformers.models.phi.modeling_phi")
    config = transformers.PhiConfig(
        hidden_size=4 * 64, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.0
    )
    # transformers: no inverse frequency, and the attention layer rotates the first 0 dims.
    inv_freq, _ = phi.PhiRotaryEmbedding.compute_default_rope_parameters(config)
    assert inv_freq.numel() == 0
    assert phi.PhiAttention(config, layer_idx=0).rotary_ndims == 0
    rope = abi.rope_spec_from_hf_config(config)
    assert rope.rotary_dim == 0
    spec = spec_of(rope)
    assert spec.rope is None and spec == spec_of(None) and spec.rotary_dim == 0
    qkv, params = packed_batch(spec, (6, 3), seed=1)
    work = qkv.clone()
    apply_torch_pass(work, spec, params)
    assert torch.equal(work, qkv)  # nothing rotated: the pass has nothing to do


def test_a_proportional_share_of_zero_rotates_nothing_as_in_transformers():
    transformers = pytest.importorskip("transformers")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    params = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.0}
    config = transformers.LlamaConfig(
        hidden_size=4 * 64, num_attention_heads=4, rope_parameters=dict(params)
    )
    inv_freq, factor = rope_utils.ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
    assert factor == 1.0 and inv_freq.abs().max().item() == 0.0  # every pair stands still
    rope = abi.rope_spec_from_hf(params, head_dim=64)
    assert rope.scaling == ab.RopeScaling("proportional", partial_rotary_factor=0.0)
    assert spec_of(rope).rope is None
    # A share too small for one pair of this head turns nothing either (int(0.02 * 64 // 2)).
    assert (
        spec_of(
            ab.RopeSpec(1e4, scaling=ab.RopeScaling("proportional", partial_rotary_factor=0.02))
        ).rope
        is None
    )


# ---------------------------------------------------------------- the same meaning (7)


def test_plain_scaling_and_no_scaling_compare_hash_and_fingerprint_alike():
    with_rule = spec_of(ab.RopeSpec(1e4, scaling=ab.RopeScaling()))
    without = spec_of(ab.RopeSpec(1e4))
    assert with_rule.rope is not None and with_rule.rope.scaling is None
    assert with_rule == without and hash(with_rule) == hash(without)
    assert canonical_json(with_rule.to_dict()) == canonical_json(without.to_dict())
    first = ab.select(with_rule, backend="torch-sdpa", platform=CPU)
    second = ab.select(without, backend="torch-sdpa", platform=CPU)
    assert rank_fingerprint(first) == rank_fingerprint(second)
    # From a config: transformers' multimodal alias and an explicit default are plain too.
    for params in ({"rope_type": "default"}, {"rope_type": "mrope", "mrope_section": [8, 12, 12]}):
        assert abi.rope_spec_from_hf(params, head_dim=64) == ab.RopeSpec(1e4)


# ---------------------------------------------------------------- refused when built (8)


def test_longrope_factors_of_the_wrong_length_are_refused_when_the_spec_is_built():
    rope = ab.RopeSpec(1e4, scaling=longrope(3))  # rotary_dim None: the head decides
    with pytest.raises(ab.SpecError, match="3 short/long factors but rotary_dim 64 has 32 pairs"):
        spec_of(rope)
    assert spec_of(ab.RopeSpec(1e4, scaling=longrope(32))).rope is not None


def test_rules_that_divided_by_zero_in_prepare_are_refused_when_built():
    with pytest.raises(ab.SpecError, match=r"log.*0 for a context of 1"):
        longrope(32, original_max_position_embeddings=1)
    with pytest.raises(ab.SpecError, match=r"log.*0 for a context of 1"):
        ab.RopeScaling.from_hf(
            {
                "rope_type": "longrope",
                "factor": 4.0,
                "original_max_position_embeddings": 1,
                "short_factor": [1.0] * 32,
                "long_factor": [1.0] * 32,
            }
        )
    # ln(e) is exactly 1, so 0.1 * -10 * 1 + 1 is exactly 0.
    with pytest.raises(ab.SpecError, match=r"divides by .* which is 0"):
        yarn(factor=math.e, mscale=1.0, mscale_all_dim=-10.0)
    # With an explicit attention factor nothing is derived: both are fine.
    assert longrope(32, original_max_position_embeddings=1, attention_factor=1.0)
    assert yarn(factor=math.e, mscale=1.0, mscale_all_dim=-10.0, attention_factor=1.0)


# ---------------------------------------------------------------- named errors (9)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ab.RopeSpec(10**400), "RopeSpec.theta"),
        (lambda: ab.RopeSpec(2.0**126 * 1.001), r"at most 2\*\*126"),
        (lambda: spec_of(None, softmax_scale=10**400), "softmax_scale"),
        (lambda: spec_of(None, softmax_scale=1e300), "at most 256"),
        (lambda: ab.RopeScaling("linear", factor=10**400), "factor"),
        (lambda: ab.RopeScaling("linear", factor=1e-300), r"\[1e-06, 1e\+06\]"),
        (lambda: yarn(original_max_position_embeddings=10**400), r"at most 2\*\*53"),
        (lambda: yarn(beta_fast=10**400), "beta_fast"),
        (lambda: yarn(mscale=10**400), "mscale"),
        (lambda: longrope(2, short_factor=(10**400, 1.0)), "short_factor"),
        (lambda: ab.RopeScaling("proportional", partial_rotary_factor=10**400), "partial"),
    ],
    ids=[
        "theta-int",
        "theta-float32",
        "scale-int",
        "scale-huge",
        "factor-int",
        "factor-tiny",
        "original-int",
        "beta-int",
        "mscale-int",
        "longrope-int",
        "share-int",
    ],
)
def test_numbers_out_of_range_are_spec_errors(build, match):
    with pytest.raises(ab.SpecError, match=match) as caught:
        build()
    assert len(str(caught.value)) < 400  # a 400-digit value is shown cut short


@pytest.mark.parametrize(
    ("params", "extra", "match"),
    [
        ({"rope_type": ["linear"], "factor": 2.0}, {}, "rope_type must be a string"),
        ({"type": {"linear"}}, {}, "rope_type must be a string"),
        ({"rope_theta": "abc"}, {}, "RopeSpec.theta"),
        ({"partial_rotary_factor": "0.5"}, {}, "partial_rotary_factor must be a number"),
        ({}, {"partial_rotary_factor": 1.5}, "partial_rotary_factor must be a number"),
        ({"rope_type": "yarn", "original_max_position_embeddings": "4096"}, {}, "original_max"),
        ({}, {"head_dim": "64"}, "head_dim must be a positive int"),
    ],
    ids=[
        "list-type",
        "set-type",
        "string-theta",
        "string-share",
        "share-past-1",
        "string-orig",
        "string-head",
    ],
)
def test_from_hf_refuses_values_of_the_wrong_kind_with_spec_errors(params, extra, match):
    kw: dict[str, Any] = {"head_dim": 64, "max_position_embeddings": 32768, **extra}
    with pytest.raises(ab.SpecError, match=match):
        abi.rope_spec_from_hf(params, **kw)


def test_from_hf_reads_the_dicts_values_first_and_zero_is_a_value():
    """The dict's values win over the config's top-level ones, as transformers merges them; a
    0 in the dict is kept rather than replaced by the top-level value or the default."""
    rope = abi.rope_spec_from_hf(
        {"rope_theta": 5e5, "partial_rotary_factor": 0.5},
        head_dim=64,
        rope_theta=1e6,
        partial_rotary_factor=0.25,
    )
    assert rope == ab.RopeSpec(5e5, rotary_dim=32)
    top = abi.rope_spec_from_hf(
        {"rope_type": "proportional"}, head_dim=64, partial_rotary_factor=0.5
    )
    assert top.scaling == ab.RopeScaling("proportional", partial_rotary_factor=0.5)
    with pytest.raises(ab.SpecError, match=r"RopeSpec\.theta"):
        abi.rope_spec_from_hf({"rope_theta": 0}, head_dim=64, rope_theta=1e6)


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    ("scaling", "fragments"),
    [
        ('{"rope_type": ["yarn"], "factor": 4}', ["rope_type must be a string", "list"]),
        (_deep(100_000), ["nested too deeply"]),
        ('{"rope_type": "linear", "factor": ' + "9" * 400 + "}", ["factor", "[1e-06, 1e+06]"]),
        ('{"rope_type": "linear", "factor": ' + "9" * 5000 + "}", ["too long to read"]),
        ('{"rope_type": "linear", "factor": ' + _deep(900) + "}", ["factor", "[[[[...]]]]"]),
        (
            '{"rope_type": "yarn", "factor": 4, "attention_factor": 1e300}',
            ["attention_factor is 1e+300", "(0, 16]"],
        ),
        (
            '{"rope_type": "longrope", "short_factor": [1, 1], "long_factor": [1, 1]}',
            ["does not fit", "2 short/long factors"],
        ),
    ],
    ids=[
        "list-type",
        "deep",
        "400-digits",
        "5000-digits",
        "deep-factor",
        "attention-factor",
        "longrope-length",
    ],
)
def test_rope_scaling_flag_mistakes_are_one_line_naming_the_flag(capsys, scaling, fragments):
    argv = ["explain", "--preset", "short", "--platform", "cpu", "--rope-scaling", scaling]
    code = main([*argv, "--max-position-embeddings", "64"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("attn-backends: error: ") and err.count("\n") == 1, err[:500]
    assert "--rope-scaling" in err and len(err) < 600
    for fragment in fragments:
        assert fragment in err


def test_check_reports_a_rule_that_cannot_compute_as_a_usage_error(capsys):
    """Exit 1 means wrong numbers or no backend; a rule that divides by zero is the user's
    value, refused before any backend runs."""
    pairs = [1.0] * 64  # head dim 128 of preset short
    scaling = {
        "rope_type": "longrope",
        "factor": 4,
        "original_max_position_embeddings": 1,
        "short_factor": pairs,
        "long_factor": pairs,
    }
    argv = ["check", "--preset", "short", "--device", "cpu", "--rope-scaling", json.dumps(scaling)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--rope-scaling" in err and "context of 1" in err


def test_rope_theta_flag_has_the_specs_bound(capsys):
    code = main(["explain", "--preset", "short", "--platform", "cpu", "--rope-theta", "1e38"])
    _, err = capsys.readouterr()
    assert code == 2 and "--rope-theta" in err and "2**126" in err


# ---------------------------------------------------------------- one way from a config


def test_the_spec_module_imports_nothing_from_the_hf_reader():
    """``RopeSpec.from_hf_config`` made a loop (``_spec`` -> ``_rope_hf`` -> ``_spec``), broken
    only by a lazy import; `rope_spec_from_hf_config` is the one way from a config. Both
    modules are checked where they live: `AttentionSpec`'s and `RopeSpec`'s."""
    for spec_class in (ab.AttentionSpec, ab.RopeSpec):
        source = Path(inspect.getfile(spec_class)).read_text()
        imported = {
            node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
        }
        assert "_rope_hf" not in imported and "attn_backends._values._rope_hf" not in imported
    assert "from_hf_config" not in vars(ab.RopeSpec)
    assert "rope_spec_from_hf_config" in abi.__all__


# ---------------------------------------------------------------- fuzz over the numbers

ODD_NUMBERS: list[object] = [
    0,
    -1,
    1,
    1.0 + 2**-52,
    2,
    5e-324,
    1e-300,
    1e-7,
    1e-6,
    0.5,
    16.0,
    16.000001,
    256.0,
    256.00001,
    1e6,
    1.000001e6,
    2.0**53,
    2**53 + 1,
    2.0**126,
    2.0**126 * 1.0000001,
    1e300,
    1.7976931348623157e308,
    10**400,
    -(10**400),
    float("inf"),
    float("nan"),
    True,
    "4",
    None,
    [2.0],
]
"""Boundaries of every bound, and values of the wrong kind."""
WILD: st.SearchStrategy[object] = st.one_of(
    st.sampled_from(ODD_NUMBERS),
    st.floats(),  # hypothesis spreads these over the whole float range, subnormals included
    st.integers(-(2**1100), 2**1100),
)
"""Anything at all, for the one field a case corrupts."""


def spread(low: float, high: float) -> st.SearchStrategy[float]:
    """Numbers in ``[low, high]``, log-uniform, with the bounds themselves."""
    inside = st.floats(math.log10(low), math.log10(high)).map(
        lambda e: min(high, max(low, 10.0**e))
    )
    return st.one_of(inside, inside, inside, st.sampled_from([low, high]))


ACCEPTED: dict[str, st.SearchStrategy[Any]] = {
    "theta": spread(1.0 + 2**-52, 2.0**126),
    "softmax_scale": st.one_of(st.none(), spread(1e-30, 256.0)),
    "factor": spread(1e-6, 1e6),
    "attention_factor": st.one_of(st.none(), spread(1e-30, 16.0)),
    "beta_fast": spread(1e-6, 1e6),
    "beta_slow": spread(1e-6, 1e6),
    "mscale": st.one_of(st.none(), st.floats(-3.0, 3.0)),
    "mscale_all_dim": st.one_of(st.none(), st.floats(-3.0, 3.0)),
    "low_freq_factor": spread(1e-30, 1e30),
    "high_freq_factor": spread(1e-30, 1e30),
    "partial_rotary_factor": st.floats(0.0, 1.0),
    "original_max_position_embeddings": st.one_of(
        st.sampled_from([1, 2, 2**53]), st.integers(1, 2**53)
    ),
    "max_position_embeddings": st.one_of(st.sampled_from([1, 2, 2**53]), st.integers(1, 2**53)),
}
"""Each number field across the range its constructor accepts (derived attention factors of
yarn's mscale pairs can still fall outside theirs)."""
READS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    ),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "proportional": ("factor", "partial_rotary_factor"),
}


@st.composite
def rope_case(draw: st.DrawFn) -> dict[str, Any]:
    """Fields of a RopeScaling (or None), a RopeSpec and an AttentionSpec, each drawn from its
    accepted range; then, in about half the cases, one of them replaced by anything at all."""
    kind = draw(st.sampled_from([None, *abi.ROPE_TYPES]))
    rotary = draw(st.sampled_from([None, 2, 4, 8]))
    case: dict[str, Any] = {
        "theta": draw(ACCEPTED["theta"]),
        "softmax_scale": draw(ACCEPTED["softmax_scale"]),
        "rotary_dim": rotary,
        "interleaved": draw(st.booleans()),
        "scaling": None,
    }
    numbers = ["theta", "softmax_scale"]
    if kind is not None:
        scaling: dict[str, Any] = {"rope_type": kind}
        for name in READS[kind]:
            scaling[name] = draw(ACCEPTED[name])
        if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            low, high = scaling["high_freq_factor"], scaling["low_freq_factor"]
            scaling["low_freq_factor"], scaling["high_freq_factor"] = low, high * 2 + 1e-30
        if kind == "longrope":
            pairs = draw(st.sampled_from([(rotary or 8) // 2, (rotary or 8) // 2, 3]))
            for name in ("short_factor", "long_factor"):
                values = st.lists(spread(1e-6, 1e6), min_size=pairs, max_size=pairs)
                scaling[name] = draw(values)
        case["scaling"] = scaling
        numbers += [f"scaling.{name}" for name in READS[kind]]
        if kind == "longrope":
            numbers.append("scaling.short_factor")
    if draw(st.booleans()):
        corrupted = draw(st.sampled_from(numbers))
        wild = draw(WILD)
        if corrupted.startswith("scaling."):
            case["scaling"][corrupted.removeprefix("scaling.")] = wild
        else:
            case[corrupted] = wild
    return case


@pytest.fixture
def one_thread():
    """The tensors here are tiny: on a busy machine, intra-op thread hand-offs cost more than
    the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(case: dict[str, Any]) -> ab.AttentionSpec:
    scaling = ab.RopeScaling(**case["scaling"]) if case["scaling"] is not None else None
    rope = ab.RopeSpec(case["theta"], case["rotary_dim"], case["interleaved"], scaling)
    return ab.AttentionSpec(
        2, 1, 8, torch.float32, causal=True, rope=rope, softmax_scale=case["softmax_scale"]
    )


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=rope_case())
def test_fuzz_every_accepted_value_computes_finite_rope_and_attention(
    one_thread: None, case: dict[str, Any]
):
    """Built or refused with a SpecError (anything else fails the test); once built, the RoPE
    tables (the torch pass's and the reference's) are finite at both length decisions and at
    the largest position, and the reference on a tiny batch is finite."""
    try:
        spec = _build(case)
    except ab.SpecError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert len(message) < 1000  # one readable line, whatever the value
        return
    json.dumps(spec.to_dict())
    hash(spec)
    if spec.rope is not None:
        for seq_len in (1, 3, INT32_MAX):
            ours = torch.tensor(_rope.rope_frequencies(spec, seq_len), dtype=torch.float64)
            theirs = _reference._frequencies(spec, seq_len, torch.device("cpu"))
            for freqs in (ours, theirs):
                assert torch.isfinite(freqs).all() and (freqs >= 0).all(), (seq_len, freqs)
                assert math.isfinite(float(freqs.max()) * INT32_MAX)  # angles stay finite
        positions = torch.tensor([0, 1, 2, INT32_MAX], dtype=torch.int32)
        tables = _rope.build_position_tables(spec, positions, INT32_MAX)
        assert tables.cos is not None and tables.sin is not None
        assert torch.isfinite(tables.cos).all() and torch.isfinite(tables.sin).all()
        assert math.isfinite(_reference._attention_factor(spec))
    qkv, params = packed_batch(spec, (3, 2), seed=0)
    out = reference_attention(qkv, spec, params)
    assert torch.isfinite(out).all()
    work = qkv.clone()
    apply_torch_pass(work, spec, params)
    assert torch.isfinite(work).all()
