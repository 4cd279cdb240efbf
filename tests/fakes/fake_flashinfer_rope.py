"""flashinfer's two RoPE-by-position functions for CPU tests: real signatures, torch math.

``apply_rope_pos_ids_inplace`` rotates Q and K in place; ``apply_rope_pos_ids`` returns rotated
copies (``torch.empty_like`` of a strided view is dense, as in flashinfer). Both check what the
kernel checks (unit last-dim stride, matching token counts and head dims) and rotate the
leading ``rotary_dim`` dims with frequency ``theta ** (-2i / rotary_dim) / rope_scale`` at each
token's position. `add_to` puts them on a fake ``flashinfer`` module installed by
``fake_flashinfer.install``.
"""

from __future__ import annotations

import sys

import pytest
import torch

FLASHINFER_FUNCTIONS = ("apply_rope_pos_ids_inplace", "apply_rope_pos_ids")


def _check(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError("q and k must be 3-D (nnz, heads, head_dim)")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have a contiguous last dimension")
    if q.size(0) != k.size(0) or q.size(2) != k.size(2) or pos_ids.numel() != q.size(0):
        raise ValueError("q, k and pos_ids must cover the same tokens and head_dim")
    if pos_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("pos_ids must be int32 or int64")


def _rotated(
    x: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int,
    interleave: bool,
    rope_scale: float,
    rope_theta: float,
) -> torch.Tensor:
    half = rotary_dim // 2
    freq = rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    angle = pos_ids.to(torch.float64)[:, None] * (freq / rope_scale)[None, :]
    cos = angle.cos().to(torch.float32)[:, None, :]
    sin = angle.sin().to(torch.float32)[:, None, :]
    head = x[..., :rotary_dim].to(torch.float32)
    if interleave:
        a, b = head[..., 0::2], head[..., 1::2]
        rot = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = head.chunk(2, dim=-1)
        rot = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def apply_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> None:
    _check(q, k, pos_ids)
    dim = q.size(-1) if rotary_dim is None else rotary_dim
    q.copy_(_rotated(q, pos_ids, dim, interleave, rope_scale, rope_theta))
    k.copy_(_rotated(k, pos_ids, dim, interleave, rope_scale, rope_theta))


def apply_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: int | None = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, pos_ids)
    dim = q.size(-1) if rotary_dim is None else rotary_dim
    q_rope = torch.empty_like(q)
    k_rope = torch.empty_like(k)
    q_rope.copy_(_rotated(q, pos_ids, dim, interleave, rope_scale, rope_theta))
    k_rope.copy_(_rotated(k, pos_ids, dim, interleave, rope_scale, rope_theta))
    return q_rope, k_rope


def add_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the installed fake ``flashinfer`` module these two functions for one test."""
    module = sys.modules["flashinfer"]
    monkeypatch.setattr(module, "apply_rope_pos_ids_inplace", apply_rope_pos_ids_inplace, False)
    monkeypatch.setattr(module, "apply_rope_pos_ids", apply_rope_pos_ids, False)
