"""RoPE scaling against transformers' own functions, for every type of its RoPE table.

For each type a tiny Qwen2/Llama config is built; transformers' inverse frequencies and
attention scaling (``ROPE_INIT_FUNCTIONS``), its rotary embedding's cos/sin, and its
``apply_rotary_pos_emb`` on a padded batch are compared with `rope_spec_from_hf_config`, the
per-batch tables and the torch pass on the packed buffer. transformers computes in float32,
so every tolerance is a small multiple of float32's epsilon scaled by the largest angle.
Negative controls: a wrong factor or type must fail the same comparison by far.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

import attn_backends as ab
import attn_backends.integrations as abi
from attn_backends._path._preprocess import apply_torch_pass
from attn_backends._path._rope import build_position_tables

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")

EPS32 = torch.finfo(torch.float32).eps
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
PAIRS = HEAD_DIM // 2


def _factors(seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(PAIRS, generator=g, dtype=torch.float64)).tolist()


# (id, max_position_embeddings, rope_parameters): lengths used below straddle 16/32/64.
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("default", 64, {"rope_type": "default", "rope_theta": 10000.0}),
    ("linear", 64, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ("dynamic", 32, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    (
        "yarn",
        64,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),
    (
        "yarn-mscale-no-truncate",
        64,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
            "rope_theta": 5e5,
        },
    ),
    (
        "yarn-attention-factor",
        64,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "attention_factor": 1.3,
        },
    ),
    (
        "longrope",
        64,
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 16,
            "short_factor": _factors(1),
            "long_factor": _factors(2),
        },
    ),
    (
        "llama3",
        128,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    ),
    (
        "proportional",
        64,
        {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.5,
            "factor": 2.0,
            "rope_theta": 10000.0,
        },
    ),
]
LENGTHS = (8, 17, 40, 70)
"""Longest sequence of a call: below and above the 16/32/64 thresholds of the cases."""


def _config(max_pos: int, params: dict[str, Any]) -> Any:
    return transformers.Qwen2Config(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_pos,
        rope_parameters=dict(params),
    )


def _hf_inv_freq(config: Any, seq_len: int) -> Any:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return qwen2.Qwen2RotaryEmbedding.compute_default_rope_parameters(config)
    return rope_utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)


def _freq_tolerance(freqs: torch.Tensor) -> torch.Tensor:
    """Bound of float32 ``base ** (2i/d)`` (exponent rounded, then pow) and of the float32
    blends: a few ulps plus the exponent's rounding magnified by ``|ln(freq)|``."""
    return EPS32 * (8.0 + 2.0 * freqs.abs().clamp(min=1e-30).log().abs()) * freqs.abs()


def _angle_tolerance(seq_len: int) -> float:
    """cos/sin error when angles reach ``seq_len`` radians, computed in float32 (transformers)
    from a float32 frequency: ``p * w * eps * (8 + 2 |ln w|) <= p * eps * 9`` plus the product's
    and the cos's own rounding."""
    return EPS32 * (16.0 * seq_len + 8.0)


def test_every_type_of_transformers_table_is_covered():
    covered = {params["rope_type"] for _, _, params in CASES}
    assert set(rope_utils.ROPE_INIT_FUNCTIONS) | {"default"} == covered
    assert covered == set(abi.ROPE_TYPES)


@pytest.mark.parametrize(("name", "max_pos", "params"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_inverse_frequencies_and_attention_factor_match(name, max_pos, params, seq_len):
    config = _config(max_pos, params)
    rope = abi.rope_spec_from_hf_config(config)
    hf_freq, hf_factor = _hf_inv_freq(config, seq_len)
    hf = hf_freq.to(torch.float64)
    spec = ab.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, torch.float32, causal=True, rope=rope)
    from attn_backends._path._rope import rope_frequencies

    ours = torch.tensor(rope_frequencies(spec, seq_len), dtype=torch.float64)
    assert ours.shape == hf.shape
    assert ((ours - hf).abs() <= _freq_tolerance(hf)).all(), (ours - hf).abs().max()
    assert (ours == 0).equal(hf == 0)
    scaling = rope.scaling.attention_scaling if rope.scaling is not None else 1.0
    assert scaling == pytest.approx(float(hf_factor), rel=1e-12)


def _hf_cos_sin(config: Any, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of a fresh rotary embedding (dynamic NTK keeps state between calls)."""
    embedding = qwen2.Qwen2RotaryEmbedding(config)
    x = torch.empty(1, dtype=torch.float32)
    cos, sin = embedding(x, position_ids)
    return cos.to(torch.float64), sin.to(torch.float64)


@pytest.mark.parametrize(("name", "max_pos", "params"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seq_len", [LENGTHS[0], LENGTHS[-1]])
def test_position_tables_match_the_rotary_embedding(name, max_pos, params, seq_len):
    config = _config(max_pos, params)
    spec = ab.AttentionSpec(
        HEADS, KV_HEADS, HEAD_DIM, torch.float32, True, rope=abi.rope_spec_from_hf_config(config)
    )
    positions = torch.arange(seq_len)
    hf_cos, hf_sin = _hf_cos_sin(config, positions[None])
    tables = build_position_tables(spec, positions.to(torch.int32), seq_len)
    assert tables.cos is not None and tables.sin is not None
    tol = _angle_tolerance(seq_len)
    half = HEAD_DIM // 2
    for ours, hf in ((tables.cos, hf_cos), (tables.sin, hf_sin)):
        theirs = hf[0, :, :half]
        assert torch.equal(hf[0, :, half:], theirs)  # rotate-half: both halves share an angle
        err = (ours[:, 0, :].to(torch.float64) - theirs).abs().max().item()
        assert err <= tol, (name, err, tol)


def _packed(lengths: tuple[int, ...], padding: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return torch.randn(sum(lengths) + padding, width, generator=g, dtype=torch.float32)


def _hf_rotated(config: Any, packed: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """transformers on the padded batch: one rotary call for all rows (its length decision is
    the longest sequence), then ``apply_rotary_pos_emb`` on each sequence's own rows."""
    longest = max(lengths)
    position_ids = torch.arange(longest).expand(len(lengths), longest)
    cos, sin = qwen2.Qwen2RotaryEmbedding(config)(torch.empty(1), position_ids)
    out = packed.clone()
    q_cols, k_cols = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    start = 0
    for b, n in enumerate(lengths):
        rows = packed[start : start + n]
        q = rows[:, :q_cols].view(n, HEADS, HEAD_DIM).transpose(0, 1)[None]
        k = rows[:, q_cols : q_cols + k_cols].view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
        q_rot, k_rot = qwen2.apply_rotary_pos_emb(q, k, cos[b : b + 1, :n], sin[b : b + 1, :n])
        out[start : start + n, :q_cols] = q_rot[0].transpose(0, 1).reshape(n, q_cols)
        out[start : start + n, q_cols : q_cols + k_cols] = (
            k_rot[0].transpose(0, 1).reshape(n, k_cols)
        )
        start += n
    return out


def _torch_pass_error(spec: ab.AttentionSpec, config: Any, lengths: tuple[int, ...]) -> float:
    packed = _packed(lengths, padding=3, seed=sum(lengths))
    expected = _hf_rotated(config, packed, lengths)
    ours = packed.clone()
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=ours.shape[0])
    apply_torch_pass(ours, spec, params)
    tokens = sum(lengths)
    assert torch.equal(ours[tokens:], packed[tokens:])  # padding rows untouched
    v_cols = (HEADS + KV_HEADS) * HEAD_DIM
    assert torch.equal(ours[:, v_cols:], packed[:, v_cols:])  # V untouched
    return (ours - expected).abs().max().item()


BATCHES = [(5, 1, 12), (17, 1, 40, 3), (70, 8, 1, 33)]
"""Packed batches whose longest sequence is below, between and above the thresholds."""


@pytest.mark.parametrize(("name", "max_pos", "params"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("lengths", BATCHES)
def test_torch_pass_on_packed_batch_matches_apply_rotary_pos_emb(name, max_pos, params, lengths):
    config = _config(max_pos, params)
    rope = abi.rope_spec_from_hf_config(config)
    spec = ab.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, torch.float32, causal=True, rope=rope)
    # |x| of a standard normal row stays below ~6, so the rotated error is bounded by 6 * the
    # table error plus the products' float32 rounding.
    tol = 6.0 * _angle_tolerance(max(lengths)) + 16 * EPS32
    assert _torch_pass_error(spec, config, lengths) <= tol


WRONG: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
    ("linear-factor", 64, CASES[1][2], {"factor": 6.0}),
    ("dynamic-factor", 32, CASES[2][2], {"factor": 3.0}),
    ("yarn-as-linear", 64, CASES[3][2], {"rope_type": "linear"}),
    ("yarn-factor", 64, CASES[3][2], {"factor": 6.0}),
    ("longrope-short-for-long", 64, CASES[6][2], {"long_factor": _factors(1)}),
    ("llama3-factor", 128, CASES[7][2], {"factor": 4.0}),
    ("proportional-as-linear", 64, CASES[8][2], {"rope_type": "linear"}),
]


@pytest.mark.parametrize(("name", "max_pos", "params", "change"), WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_factor_or_type_fails_the_same_comparison(name, max_pos, params, change):
    """Negative control: the comparison above has the power to see a wrong rule."""
    config = _config(max_pos, params)
    wrong = _config(max_pos, {**params, **change})
    rope = abi.rope_spec_from_hf_config(wrong)
    assert rope != abi.rope_spec_from_hf_config(config)
    spec = ab.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, torch.float32, causal=True, rope=rope)
    lengths = BATCHES[-1]
    tol = 6.0 * _angle_tolerance(max(lengths)) + 16 * EPS32
    assert _torch_pass_error(spec, config, lengths) > 100 * tol


def test_length_decision_is_the_longest_sequence_of_the_batch():
    """Dynamic NTK on a batch with one long sequence scales its short ones too (transformers
    decides per call from the largest position id), and leaves a batch of short ones plain."""
    config = _config(32, CASES[2][2])
    spec = ab.AttentionSpec(
        HEADS, KV_HEADS, HEAD_DIM, torch.float32, True, rope=abi.rope_spec_from_hf_config(config)
    )
    plain = replace(spec, rope=ab.RopeSpec(10000.0))
    short = build_position_tables(spec, torch.arange(8, dtype=torch.int32), 8)
    unscaled = build_position_tables(plain, torch.arange(8), 8)
    assert short.cos is not None and unscaled.cos is not None
    assert torch.equal(short.cos, unscaled.cos)
    grown = build_position_tables(spec, torch.arange(8, dtype=torch.int32), 70)
    assert grown.cos is not None and short.cos is not None
    assert (grown.cos - short.cos).abs().max().item() > 1e-3


def test_old_rope_scaling_shape_and_top_level_theta():
    """transformers 4 kept ``rope_scaling`` with ``type`` and ``rope_theta`` on the config."""
    old = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    rope = abi.rope_spec_from_hf(old, head_dim=HEAD_DIM, max_position_embeddings=64, rope_theta=5e5)
    assert rope.theta == 5e5
    assert rope.scaling == ab.RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16)
    params = {**old, "rope_type": "yarn", "rope_theta": 5e5}
    params.pop("type")
    assert abi.rope_spec_from_hf_config(_config(64, params)) == rope


def test_partial_rotary_factor_rotates_leading_dims_with_their_own_exponent():
    config = transformers.LlamaConfig(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        max_position_embeddings=64,
        partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "linear", "factor": 2.0},
    )
    rope = abi.rope_spec_from_hf_config(config)
    assert rope.rotary_dim == HEAD_DIM // 2
    hf, _ = rope_utils.ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    assert rope.scaling is not None
    ours = torch.tensor(rope.scaling.inverse_frequencies(rope.theta, HEAD_DIM // 2, 8))
    hf64 = hf.to(torch.float64)
    assert ((ours - hf64).abs() <= _freq_tolerance(hf64)).all()


def test_reference_rotation_matches_transformers():
    """The float64 reference derives every rule on its own; it must agree with transformers
    as closely as the torch pass does."""
    from attn_backends._backend._reference import _rotate

    lengths = (70, 8)
    for _name, max_pos, params in CASES:
        config = _config(max_pos, params)
        rope = abi.rope_spec_from_hf_config(config)
        spec = ab.AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, torch.float32, True, rope=rope)
        packed = _packed(lengths, padding=0, seed=7)
        expected = _hf_rotated(config, packed, lengths)
        q = packed[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM).to(torch.float64)
        positions = torch.cat([torch.arange(n) for n in lengths])
        ours = _rotate(q, positions, spec, max(lengths)).reshape(len(positions), -1)
        err = (ours - expected[:, : HEADS * HEAD_DIM].to(torch.float64)).abs().max().item()
        assert err <= 6.0 * _angle_tolerance(max(lengths)) + 16 * EPS32, (_name, err)
    assert math.isfinite(err)
