"""RoPE scaling without transformers: validation, records, reading HF dicts, which passes serve
which rule (and say why not), flashinfer's linear mapping on the CPU fake, and the torch pass
against the float64 reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin._flashinfer_rope import (
    FLASHINFER_ROPE,
    apply_flashinfer_rope,
    flashinfer_rope_refusal,
)

import attn_backends as ab
import attn_backends.integrations as abi
import attn_backends.plugin as abp
from attn_backends._backend import _backend
from attn_backends._backend._capabilities import Capabilities
from attn_backends._backend._reference import TOLERANCE, reference_attention, relative_error
from attn_backends._path import _native, _preprocess
from attn_backends._path._preprocess import apply_torch_pass, choose_preprocess, native_refusal
from attn_backends._select._ranking import Row
from attn_backends._values._records import canonical_json
from attn_backends.errors import GraphModeError
from attn_backends.plugin import preprocess_mode
from tests.fakes import fake_flashinfer_rope
from tests.fakes.fake_flashinfer import install

FLASHINFER = (("aiter", None), ("flashinfer", "0.7.0.post1"), ("tensorrt_llm", None))
H200 = ab.Platform(kind="cuda", arch="sm90", device_name="H200", libraries=FLASHINFER)
PAIRS = 32  # head_dim 64

RULES: dict[str, ab.RopeScaling] = {
    "linear": ab.RopeScaling("linear", factor=4.0),
    "dynamic": ab.RopeScaling("dynamic", factor=2.0, max_position_embeddings=16),
    "yarn": ab.RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16),
    "longrope": ab.RopeScaling(
        "longrope",
        factor=4.0,
        original_max_position_embeddings=16,
        short_factor=tuple(1.0 + i / PAIRS for i in range(PAIRS)),
        long_factor=tuple(1.0 + 4.0 * i / PAIRS for i in range(PAIRS)),
    ),
    "llama3": ab.RopeScaling(
        "llama3",
        factor=8.0,
        original_max_position_embeddings=64,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    ),
    "proportional": ab.RopeScaling("proportional", factor=2.0, partial_rotary_factor=0.25),
}


def spec_with(scaling: ab.RopeScaling | None, **kw) -> ab.AttentionSpec:
    fields = {"dtype": torch.bfloat16, "causal": True, **kw}
    return ab.AttentionSpec(8, 2, 64, rope=ab.RopeSpec(1e4, scaling=scaling), **fields)


@pytest.fixture(autouse=True)
def _fresh_caches():
    abp.register_rope_pass(FLASHINFER_ROPE)
    _preprocess.clear_preprocess_cache()
    yield
    _preprocess.clear_preprocess_cache()


# ---------------------------------------------------------------- the value


def test_every_rule_is_frozen_hashable_and_equal_by_value():
    assert set(RULES) | {"default"} == set(abi.ROPE_TYPES)
    for name, rule in RULES.items():
        again = ab.RopeScaling(**{**rule.__dict__})
        assert again == rule and hash(again) == hash(rule), name
        with pytest.raises(AttributeError):
            rule.factor = 3.0  # type: ignore[misc]
    short = RULES["longrope"].short_factor
    assert short is not None
    as_lists = replace(RULES["longrope"], short_factor=list(short))  # type: ignore[arg-type]
    assert as_lists == RULES["longrope"] and isinstance(as_lists.short_factor, tuple)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rope_type": "ntk"}, "rope_type"),
        ({"rope_type": "linear", "factor": 0.0}, "factor"),
        ({"rope_type": "linear", "factor": float("nan")}, "factor"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 8.0}, "beta_fast"),
        ({"rope_type": "default", "factor": 2.0}, "factor"),
        ({"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings"),
        ({"rope_type": "yarn", "factor": 2.0}, "original_max_position_embeddings"),
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 8,
                "beta_slow": -1.0,
            },
            "beta_slow",
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 8,
                "truncate": "no",
            },
            "truncate",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
            },
            "high_freq_factor",
        ),
        (
            {
                "rope_type": "longrope",
                "original_max_position_embeddings": 8,
                "short_factor": (1.0, 2.0),
                "long_factor": (1.0,),
            },
            "short_factor",
        ),
        (
            {
                "rope_type": "longrope",
                "original_max_position_embeddings": 8,
                "short_factor": (1.0, -2.0),
                "long_factor": (1.0, 1.0),
            },
            "short_factor",
        ),
        ({"rope_type": "proportional", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        (
            {
                "rope_type": "yarn",
                "factor": 2,
                "original_max_position_embeddings": 0,
            },
            "original_max_position_embeddings",
        ),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ab.SpecError, match=field):
        ab.RopeScaling(**kwargs)


def test_rope_spec_checks_scaling_against_its_rotated_dims():
    with pytest.raises(ab.SpecError, match=r"RopeSpec\.scaling must be a RopeScaling"):
        ab.RopeSpec(1e4, scaling={"rope_type": "linear"})  # type: ignore[arg-type]
    with pytest.raises(ab.SpecError, match="one factor per pair"):
        ab.RopeSpec(1e4, rotary_dim=32, scaling=RULES["longrope"])
    with pytest.raises(ab.SpecError, match="rotary_dim > 2"):
        ab.RopeSpec(1e4, rotary_dim=2, scaling=RULES["dynamic"])
    # With rotary_dim None the head decides: checked when the spec is built, not in prepare.
    with pytest.raises(ab.SpecError, match="one factor per pair"):
        ab.AttentionSpec(
            2, 2, 32, torch.float32, True, rope=ab.RopeSpec(1e4, scaling=RULES["longrope"])
        )
    with pytest.raises(ab.SpecError, match="rotary_dim > 2"):
        ab.AttentionSpec(
            2, 2, 2, torch.float32, True, rope=ab.RopeSpec(1e4, scaling=RULES["dynamic"])
        )


def test_records_and_fingerprints_carry_the_rule():
    plain = spec_with(None)
    plain_record = plain.to_dict()["rope"]
    assert isinstance(plain_record, dict)
    assert "scaling" not in plain_record  # plain specs keep their fingerprint
    yarn = spec_with(RULES["yarn"])
    record = yarn.to_dict()["rope"]
    assert isinstance(record, dict)
    assert record["scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "attention_factor": None,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": None,
        "mscale_all_dim": None,
        "truncate": True,
    }
    other = spec_with(replace(RULES["yarn"], factor=8.0))
    assert canonical_json(yarn.to_dict()) != canonical_json(other.to_dict())
    assert canonical_json(spec_with(RULES["longrope"]).to_dict())  # tuples print as lists


# ---------------------------------------------------------------- HF dicts


def test_from_hf_reads_both_dict_shapes_and_fills_like_transformers():
    old = ab.RopeScaling.from_hf({"type": "linear", "factor": 2})
    assert old == ab.RopeScaling("linear", factor=2)
    assert ab.RopeScaling.from_hf(None).is_plain and ab.RopeScaling.from_hf({}).is_plain
    assert ab.RopeScaling.from_hf({"type": "mrope", "mrope_section": [8, 12, 12]}).is_plain
    derived = ab.RopeScaling.from_hf(
        {"rope_type": "yarn", "original_max_position_embeddings": 4096, "beta_fast": None},
        max_position_embeddings=32768,
    )
    assert derived.factor == 8.0 and derived.beta_fast == 32.0
    fallback = ab.RopeScaling.from_hf(
        {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4},
        max_position_embeddings=8192,
    )
    assert fallback.original_max_position_embeddings == 8192
    phi3 = ab.RopeScaling.from_hf(
        {
            "rope_type": "longrope",
            "short_factor": [1.0],
            "long_factor": [2.0],
            "original_max_position_embeddings": 2048,
        },
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
    )
    assert phi3.original_max_position_embeddings == 4096 and phi3.factor == 32.0
    no_truncate = ab.RopeScaling.from_hf(
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 8,
            "truncate": None,
        }
    )
    assert no_truncate.truncate is False


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"rope_type": "axial"}, "not supported"),
        ({"full_attention": {"rope_type": "default"}}, "nested by layer type"),
        ({"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings"),
        ({"rope_type": "linear"}, "needs 'factor'"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "factor"),
    ],
)
def test_from_hf_refusals_say_what_to_give(params, match):
    with pytest.raises(ab.SpecError, match=match):
        ab.RopeScaling.from_hf(params)


def test_rope_spec_from_hf_maps_theta_and_partial_rotary():
    rope = abi.rope_spec_from_hf(
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5, "partial_rotary_factor": 0.5},
        head_dim=128,
    )
    assert rope == ab.RopeSpec(5e5, rotary_dim=64, scaling=ab.RopeScaling("linear", factor=2.0))
    prop = abi.rope_spec_from_hf(
        {"rope_type": "proportional", "partial_rotary_factor": 0.25}, head_dim=128
    )
    assert prop.rotary_dim is None and prop.scaling == ab.RopeScaling(
        "proportional", partial_rotary_factor=0.25
    )
    assert abi.rope_spec_from_hf({"rope_type": "default"}, head_dim=64) == ab.RopeSpec(10000.0)


# ---------------------------------------------------------------- which pass serves what


@pytest.mark.parametrize("name", sorted(RULES))
def test_theta_only_kernels_refuse_scaling_and_torch_serves_it(name, monkeypatch):
    monkeypatch.setattr(_native, "unavailable_reason", lambda: None)
    spec = spec_with(RULES[name])
    assert "plain theta RoPE only" in str(native_refusal(spec, H200))
    assert name in str(native_refusal(spec, H200))
    choice = choose_preprocess(spec, H200, fused_rope=True)
    assert choice.mode == ("flashinfer" if name == "linear" else "torch")
    assert "native: computes plain theta RoPE only" in str(choice.fallback)
    refusal = flashinfer_rope_refusal(spec, H200)
    assert (refusal is None) == (name == "linear")
    if refusal is not None:
        assert "plain or linear" in refusal


def test_plain_scaling_is_served_like_no_scaling(monkeypatch):
    monkeypatch.setattr(_native, "unavailable_reason", lambda: None)
    spec = spec_with(ab.RopeScaling())
    assert native_refusal(spec, H200) is None
    assert choose_preprocess(spec, H200, fused_rope=True).mode == "fused"


def test_fused_kernels_are_never_asked_for_scaled_rope():
    caps = Capabilities(
        platforms=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}), fused_rope=True
    )
    assert caps.fuses_rope(spec_with(None), 64)
    row = Row("x", "cuda", "fused RoPE only", rope_fusable=True)
    assert row.holds(spec_with(None), H200)
    for scaling in RULES.values():
        assert not caps.fuses_rope(spec_with(scaling), 64)
        assert not row.holds(spec_with(scaling), H200)
        assert preprocess_mode(spec_with(scaling), fused_rope=True) == "torch"


def test_graph_mode_refuses_scaled_rope_and_says_why(monkeypatch):
    install(monkeypatch)
    monkeypatch.setattr(flashinfer_plugin, "device_sm", lambda device: 90)
    monkeypatch.setattr(_native, "unavailable_reason", lambda: None)
    monkeypatch.setattr(_backend, "platform_of", lambda device: H200)
    platform = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))
    spec = spec_with(RULES["yarn"])
    backend = ab.select(spec, backend="flashinfer", platform=platform, cuda_graph=True).backend
    assert isinstance(backend, ab.CudaGraphPrefill)
    with pytest.raises(GraphModeError, match="not 'yarn' scaling"):
        backend.prepare_graph(ab.GraphBucket(max_tokens=64, max_batch=2), device="cpu")


def test_flashinfer_pass_maps_linear_scaling_to_rope_scale(monkeypatch):
    install(monkeypatch)
    fake_flashinfer_rope.add_to(monkeypatch)
    spec = spec_with(RULES["linear"], dtype=torch.float16)
    lengths = (5, 40, 1)
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=50)
    gen = torch.Generator().manual_seed(3)
    packed = torch.randn(50, spec.qkv_width, generator=gen).to(torch.float16)
    ours, theirs = packed.clone(), packed.clone()
    assert apply_flashinfer_rope(theirs, spec, params)
    apply_torch_pass(ours, spec, params)
    assert not torch.equal(theirs, packed)
    assert (ours.float() - theirs.float()).abs().max().item() <= 2e-3  # one fp16 rounding step
    wrong = spec_with(replace(RULES["linear"], factor=1.0 + 1e-9), dtype=torch.float16)
    unscaled = packed.clone()
    apply_flashinfer_rope(unscaled, replace(wrong, rope=ab.RopeSpec(1e4)), params)
    assert (unscaled.float() - theirs.float()).abs().max().item() > 0.5  # factor reached it


# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("causal", [True, False])
def test_torch_path_matches_float64_reference(name, causal):
    """Through a backend: varlen with a single token, GQA, padding rows, strided input, and
    a batch whose longest sequence passes the 16-token thresholds (llama3 reads no length)."""
    spec = spec_with(RULES[name], dtype=torch.float32, causal=causal)
    backend = ab.select(spec, backend="torch-sdpa", platform=ab.parse_platform("cpu")).backend
    lengths = (5, 1, 40, 12)
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=sum(lengths) + 3)
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(params.rows, spec.qkv_width + 8, generator=gen)
    qkv = wide[:, 4 : 4 + spec.qkv_width]  # non-contiguous rows
    ref = reference_attention(qkv, spec, params)
    out = backend.forward(qkv.clone(), backend.prepare(params))
    assert relative_error(out, ref) <= TOLERANCE[torch.float32]
    plain = reference_attention(qkv, replace(spec, rope=ab.RopeSpec(1e4)), params)
    assert relative_error(plain, ref) > 100 * TOLERANCE[torch.float32]  # the rule mattered
