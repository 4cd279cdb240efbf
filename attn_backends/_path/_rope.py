"""RoPE and logn scaling applied in place on the packed QKV buffer, with torch ops.

`build_position_tables` runs once per batch (in ``prepare``, for every plan that rotates);
`apply_rope_logn` runs once per layer on the Q|K columns of the valid rows. Padding rows and V
are never touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._values._spec import AttentionSpec


@dataclass(frozen=True, eq=False)
class PositionTables:
    """Per-token factors for one batch, float32 on the QKV device."""

    cos: torch.Tensor | None
    """``[token_q_num, 1, rotary_dim / 2]`` or None without RoPE."""
    sin: torch.Tensor | None
    logn: torch.Tensor | None
    """``[token_q_num, 1, 1]`` Q multiplier, or None without logn."""


def build_position_tables(
    spec: AttentionSpec, positions: torch.Tensor, seq_len: int | None = None
) -> PositionTables:
    """Host-side work of RoPE/logn for one batch: angles and scales for every token.

    ``seq_len`` is the batch's longest sequence (``FMHAParams.max_seqlen_q``), which dynamic
    and longrope scaling read; ``None`` derives it from ``positions`` (a device sync).
    """
    pos = positions.to(torch.float64)
    cos = sin = logn = None
    if spec.rope is not None:
        # Built on the host, then copied without blocking: pageable memory is staged before
        # the call returns, and the copy is ordered on the current stream (no device sync).
        inv_freq = torch.tensor(
            rope_frequencies(spec, seq_len if seq_len is not None else _longest(positions)),
            dtype=torch.float64,
        ).to(pos.device, non_blocking=True)
        angles = pos[:, None] * inv_freq[None, :]
        factor = spec.rope.scaling.attention_scaling if spec.rope.scaling is not None else 1.0
        cos = (angles.cos() * factor).to(torch.float32)[:, None, :]
        sin = (angles.sin() * factor).to(torch.float32)[:, None, :]
    if spec.use_logn_attn:
        assert spec.logn_base is not None  # guaranteed by AttentionSpec validation
        scale = torch.log(pos + 1.0) / math.log(spec.logn_base)
        logn = scale.clamp(min=1.0).to(torch.float32)[:, None, None]
    return PositionTables(cos=cos, sin=sin, logn=logn)


def rope_frequencies(spec: AttentionSpec, seq_len: int) -> list[float]:
    """Float64 inverse frequency of each rotated pair for a batch whose longest sequence has
    ``seq_len`` tokens: plain ``theta ** (-2i / rotary_dim)``, or the spec's scaling rule."""
    assert spec.rope is not None
    r = spec.rotary_dim
    if spec.rope.scaling is None:
        return [spec.rope.theta ** (-2.0 * i / r) for i in range(r // 2)]
    return spec.rope.scaling.inverse_frequencies(spec.rope.theta, r, seq_len)


def _longest(positions: torch.Tensor) -> int:
    return int(positions.max()) + 1 if positions.numel() else 0


def apply_rope_logn(
    qk: torch.Tensor, num_q_heads: int, spec: AttentionSpec, tables: PositionTables
) -> None:
    """Rotate ``qk`` (``[tokens, Hq + Hkv, D]`` view of the Q|K columns) and scale Q, in place.

    Math is done in float32 and written back in the buffer's dtype.
    """
    if spec.rope is not None:
        assert tables.cos is not None and tables.sin is not None
        rot = qk[..., : spec.rotary_dim]
        x = rot.to(torch.float32)
        if spec.rope.interleaved:
            pairs = x.reshape(*x.shape[:-1], -1, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
            rotated = torch.stack(
                (x1 * tables.cos - x2 * tables.sin, x2 * tables.cos + x1 * tables.sin), dim=-1
            ).flatten(-2)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat(
                (x1 * tables.cos - x2 * tables.sin, x2 * tables.cos + x1 * tables.sin), dim=-1
            )
        rot.copy_(rotated)
    if tables.logn is not None:
        q = qk[:, :num_q_heads]
        q.copy_(q.to(torch.float32) * tables.logn)
