"""Explicit per-sequence masks for kernels that take a dense ``attn_mask`` (SDPA).

One sequence of ``L`` tokens, positions ``0 .. L-1``: the causal rule, the spec's sliding
window and its ALiBi bias, in the form SDPA reads (boolean where no bias is needed, additive
otherwise, in the input dtype).
"""

from __future__ import annotations

import torch

from attn_backends import AttentionSpec


def visible_keys(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[L, L]``: True where query ``i`` may see key ``j``."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    visible = torch.ones(length, length, dtype=torch.bool, device=device)
    if spec.causal:
        visible &= j <= i
    if spec.window is not None:
        visible &= (j >= i - spec.window.left) & (j <= i + spec.window.right)
    return visible


def alibi_bias(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    """Float32 ``[H, L, L]``: ``slope * (j - i)`` for causal specs, ``-slope * |i - j|`` else.

    Relative to the query, so the biases that carry weight (near keys) stay small and keep
    their precision in 16-bit dtypes."""
    assert spec.alibi is not None
    slopes = torch.tensor(spec.alibi.slopes_for(spec.num_heads), dtype=torch.float32, device=device)
    pos = torch.arange(length, device=device, dtype=torch.float32)
    distance = pos[None, :] - pos[:, None]
    if not spec.causal:
        distance = -distance.abs()
    return slopes[:, None, None] * distance


def explicit_mask(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    """SDPA's ``attn_mask`` for one sequence: boolean ``[L, L]``, or additive ``[H, L, L]``
    in the spec's dtype when ALiBi adds a bias."""
    visible = visible_keys(spec, length, device)
    if spec.alibi is None:
        return visible
    bias = alibi_bias(spec, length, device).masked_fill(~visible, float("-inf"))
    return bias.to(spec.dtype)
