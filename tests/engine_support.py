"""What the engine plugin tests share: a packed QKV projection as an engine holds it (q, k and v
are column views of one buffer, with padding rows after the batch), and the float64 check."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import attn_backends as ab
from attn_backends.reference import TOLERANCE, reference_attention, relative_error


@dataclass
class Projection:
    """One layer's packed QKV rows ``[tokens + pad, (Hq + 2 Hkv) * D]`` and its views."""

    qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def projection(
    lengths: tuple[int, ...],
    heads: int,
    kv_heads: int,
    dim: int,
    *,
    pad: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Projection:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths) + pad
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return Projection(qkv, q, k, v, lengths)


def assert_matches_reference(
    out: torch.Tensor,
    proj: Projection,
    spec: ab.AttentionSpec,
    *,
    sinks: torch.Tensor | None = None,
) -> None:
    """``out`` (``[rows, Hq * D]`` or ``[rows, Hq, D]``) equals the float64 attention of the
    batch's rows under ``spec``, and every padding row after them is 0."""
    params = ab.FMHAParams.from_lengths(list(proj.lengths), device="cpu")
    ref = reference_attention(proj.qkv, spec, params, sinks=sinks)
    flat = out.reshape(out.shape[0], -1)
    err = relative_error(flat[: proj.tokens], ref)
    assert err < TOLERANCE[spec.dtype], f"relative error {err:.3g} against float64"
    assert not flat[proj.tokens :].any(), "a padding row after the batch is not 0"
