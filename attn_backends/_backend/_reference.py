"""Float64 attention written from the definitions, independent of the contract's code paths.

It takes the packed QKV as the engine hands it over (before any in-place RoPE), so it checks
the whole no-cache path: RoPE, logn, masking, GQA and the trimming of padding rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import cast

import torch

from .._path._contract import Fp8Scales
from .._values._errors import InvalidArgumentError
from .._values._feature_table import FEATURES
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec


def _frequencies(spec: AttentionSpec, seq_len: int, device: torch.device) -> torch.Tensor:
    """Float64 inverse frequency per rotated pair, each scaling rule derived here on its own
    (whole-vector torch math rather than the per-pair loop of ``_rope_scaling``)."""
    assert spec.rope is not None
    r = spec.rotary_dim
    theta = float(spec.rope.theta)
    exponent = torch.arange(0, r, 2, dtype=torch.float64, device=device) / r
    base = theta ** (-exponent)
    sc = spec.rope.scaling
    if sc is None or sc.rope_type == "default":
        return base
    f = float(sc.factor)
    if sc.rope_type == "linear":
        return base / f
    if sc.rope_type == "dynamic":
        m = float(cast(int, sc.max_position_embeddings))
        grown = f * max(float(seq_len), m) / m - f + 1.0
        stretched_theta: float = theta * grown ** (r / (r - 2.0))
        return stretched_theta ** (-exponent)
    if sc.rope_type == "longrope":
        limit = cast(int, sc.original_max_position_embeddings)
        chosen = sc.long_factor if seq_len > limit else sc.short_factor
        return base / torch.tensor(chosen, dtype=torch.float64, device=device)
    if sc.rope_type == "proportional":
        keep = torch.arange(r // 2, device=device) < int(sc.partial_rotary_factor * r // 2)
        return torch.where(keep, base / f, torch.zeros_like(base))
    original = float(cast(int, sc.original_max_position_embeddings))
    turns = original * base / (2 * math.pi)  # rotations of each pair over the original context
    if sc.rope_type == "llama3":
        low, high = float(cast(float, sc.low_freq_factor)), float(cast(float, sc.high_freq_factor))
        # Share kept at full frequency: 0 below low_freq_factor turns, 1 above high_freq_factor.
        kept = ((turns - low) / (high - low)).clamp(0.0, 1.0)
        return base * (kept + (1.0 - kept) / f)

    # yarn: the pair index where a pair turns beta times over the original context.
    def index_at(beta: float) -> float:
        return r / 2 * math.log(original / (2 * math.pi * beta)) / math.log(theta)

    lo, hi = index_at(float(sc.beta_fast)), index_at(float(sc.beta_slow))
    if sc.truncate:
        lo, hi = float(math.floor(lo)), float(math.ceil(hi))
    lo, hi = max(lo, 0.0), min(hi, r - 1.0)
    width = hi - lo if hi != lo else 0.001
    i = torch.arange(r // 2, dtype=torch.float64, device=device)
    stretched = ((i - lo) / width).clamp(0.0, 1.0)
    return base * (1.0 - stretched * (1.0 - 1.0 / f))  # blends frequencies, not wavelengths


def _attention_factor(spec: AttentionSpec) -> float:
    """The cos/sin magnitude of YaRN and longrope (1 for every other rule)."""
    assert spec.rope is not None
    sc = spec.rope.scaling
    if sc is None or sc.rope_type not in ("yarn", "longrope"):
        return 1.0
    if sc.attention_factor is not None:
        return float(sc.attention_factor)
    f = float(sc.factor)
    if f <= 1.0:
        return 1.0
    if sc.rope_type == "longrope":
        return math.sqrt(
            1.0 + math.log(f) / math.log(cast(int, sc.original_max_position_embeddings))
        )
    if sc.mscale and sc.mscale_all_dim:
        return (1.0 + 0.1 * sc.mscale * math.log(f)) / (1.0 + 0.1 * sc.mscale_all_dim * math.log(f))
    return 1.0 + 0.1 * math.log(f)


def _rotate(
    x: torch.Tensor, positions: torch.Tensor, spec: AttentionSpec, seq_len: int | None = None
) -> torch.Tensor:
    """RoPE as a complex rotation of each (even, odd) or (i, i + r/2) pair, scaled by the
    attention factor; ``seq_len`` is the batch's longest sequence (dynamic, longrope), by
    default the largest position plus one."""
    assert spec.rope is not None
    if seq_len is None:
        seq_len = int(positions.max()) + 1 if positions.numel() else 0
    r = spec.rotary_dim
    half = r // 2
    freqs = _frequencies(spec, seq_len, x.device)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    magnitude = torch.full_like(angles, _attention_factor(spec))
    phase = torch.polar(magnitude, angles)[:, None, :]
    head = x[..., :r]
    if spec.rope.interleaved:
        pairs = torch.complex(head[..., 0::2], head[..., 1::2]) * phase
        rotated = torch.stack((pairs.real, pairs.imag), dim=-1).flatten(-2)
    else:
        pairs = torch.complex(head[..., :half], head[..., half:]) * phase
        rotated = torch.cat((pairs.real, pairs.imag), dim=-1)
    return torch.cat((rotated, x[..., r:]), dim=-1)


def _positions(length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 query positions ``[L, 1]`` and key positions ``[1, L]`` of one sequence."""
    pos = torch.arange(length, device=device)
    return pos[:, None], pos[None, :]


def _mask(spec: AttentionSpec, length: int, heads: range, device: torch.device) -> torch.Tensor:
    """Boolean ``[heads, L, L]`` of visible keys for one sequence: the causal rule, then each
    feature's own rule (`_feature_table`: the reference pieces written there, not the
    plugins' masks)."""
    i, j = _positions(length, device)
    full = (j <= i) if spec.causal else torch.ones(length, length, dtype=torch.bool, device=device)
    masks = full.expand(len(heads), length, length)
    for feature in FEATURES:
        if feature.used(spec):
            visible = feature.reference_visible(spec, i, j, heads)
            if visible is not None:
                masks = masks & visible
    return masks


def _scores(
    spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, heads: range, device: torch.device
) -> torch.Tensor:
    """Masked ``[heads, L, L]`` scores: scale, each feature in the table's order (soft-cap,
    then ALiBi bias), then the mask."""
    length = q.shape[1]
    i, j = _positions(length, device)
    scores = (q @ k.transpose(1, 2)) * spec.scale
    for feature in FEATURES:
        if feature.used(spec):
            scores = feature.reference_score(spec, scores, i, j, heads)
    return scores.masked_fill(~_mask(spec, length, heads, device), float("-inf"))


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the keys of ``[heads, L, L]`` scores; with sinks, each head's logit is one
    more term of the denominator (a column of its own, dropped after the softmax)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks[:, None, None].expand(-1, scores.shape[1], 1)
    return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]


def reference_attention(
    qkv: torch.Tensor,
    spec: AttentionSpec,
    params: FMHAParams,
    *,
    fp8_scales: Fp8Scales | None = None,
    sinks: torch.Tensor | None = None,
    compute_device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[token_q_num, Hq * D]`` float64 attention of the valid rows of a packed QKV buffer.

    ``sinks``: the layer's attention-sink logits ``[Hq]``, required exactly when the spec has
    ``attention_sinks``: one more softmax term per head, ``exp(sink)``, with no value.
    Computed on ``compute_device`` (default: the buffer's device; a GPU does float64 too).
    """
    if spec.attention_sinks != (sinks is not None):
        raise InvalidArgumentError(
            "reference_attention takes sinks exactly when the spec has attention_sinks "
            f"(attention_sinks={spec.attention_sinks}, sinks given: {sinks is not None})"
        )
    tokens = params.token_q_num
    device = qkv.device if compute_device is None else torch.device(compute_device)
    x = qkv[:tokens].detach().to(device, torch.float64)
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = x[:, : hq * d].reshape(tokens, hq, d)
    k = x[:, hq * d : (hq + hkv) * d].reshape(tokens, hkv, d)
    v = x[:, (hq + hkv) * d :].reshape(tokens, hkv, d)
    if fp8_scales is not None:
        q = q * float(fp8_scales.q)
        k = k * float(fp8_scales.k)
        v = v * float(fp8_scales.v)
    positions = torch.cat([torch.arange(n, device=device) for n in params.input_lengths])
    if spec.rope is not None:
        longest = max(params.input_lengths)
        q = _rotate(q, positions, spec, longest)
        k = _rotate(k, positions, spec, longest)
    if spec.use_logn_attn:
        assert spec.logn_base is not None
        factor = torch.tensor(
            [max(1.0, math.log(p + 1) / math.log(spec.logn_base)) for p in positions.tolist()],
            dtype=torch.float64,
            device=device,
        )
        q = q * factor[:, None, None]
    k = k.repeat_interleave(spec.group_size, dim=1)
    v = v.repeat_interleave(spec.group_size, dim=1)
    sink = sinks.detach().to(device, torch.float64) if sinks is not None else None
    out = torch.zeros(tokens, hq, d, dtype=torch.float64, device=device)
    start = 0
    for length in params.input_lengths:
        end = start + length
        # Bound the [heads, L, L] score block to about 256 MiB.
        chunk = max(1, (1 << 25) // max(1, length * length))
        for h0 in range(0, hq, chunk):
            heads = range(h0, min(hq, h0 + chunk))
            qs = q[start:end, h0 : heads.stop].transpose(0, 1)
            ks = k[start:end, h0 : heads.stop].transpose(0, 1)
            vs = v[start:end, h0 : heads.stop].transpose(0, 1)
            scores = _scores(spec, qs, ks, heads, device)
            weights = _softmax(scores, None if sink is None else sink[h0 : heads.stop])
            out[start:end, h0 : heads.stop] = (weights @ vs).transpose(0, 1)
        start = end
    return out.reshape(tokens, hq * d)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives ``inf``."""
    a = out.detach().to(ref.device, torch.float64)
    diff = torch.linalg.vector_norm(a - ref)
    norm = torch.linalg.vector_norm(ref)
    value = float(diff / norm) if float(norm) > 0 else float(diff)
    return value if math.isfinite(value) else math.inf


# Relative-error bounds against the float64 reference, by input dtype. bf16 keeps 8 mantissa
# bits and RoPE rounds Q/K back to the buffer dtype once, so its bound is the loosest.
TOLERANCE: Mapping[torch.dtype, float] = MappingProxyType(
    {
        torch.float32: 1e-4,
        torch.float16: 5e-3,
        torch.bfloat16: 1e-2,
        torch.float8_e4m3fn: 8e-2,
        torch.float8_e4m3fnuz: 8e-2,
        torch.float8_e5m2: 1.5e-1,
    }
)
