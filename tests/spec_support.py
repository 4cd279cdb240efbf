"""Random packed batches for the feature tests (windows, soft-cap, ALiBi, chunks)."""

from __future__ import annotations

import torch

import attn_backends as ab


def batch(
    spec: ab.AttentionSpec, lengths: tuple[int, ...], pad: int = 0, seed: int = 0
) -> tuple[ab.FMHAParams, torch.Tensor]:
    """The metadata of ``lengths`` with ``pad`` padding rows after them, and random packed
    QKV (values ~N(0, 1), padding rows too) for ``spec``."""
    tokens = sum(lengths)
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=tokens + pad)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens + pad, spec.qkv_width, generator=gen).to(spec.dtype)
    return params, qkv
