"""Which bytes of a packed QKV buffer a forward may write, and a check that it wrote no other.

The contract lets one pass write the caller's buffer: RoPE rotates the first ``rotary_dim``
columns of every Q and K head, and logn scales every Q column, on the valid rows only. Every
other byte (V, the unrotated columns of K, of Q without logn, the padding rows, all of it
when the kernel fuses RoPE or there is nothing to apply) must come back bit for bit. The strict
canary and the conformance suite both ask `unexpected_writes`.
"""

from __future__ import annotations

import torch

from .._values._spec import AttentionSpec


def writable_columns(spec: AttentionSpec, rotates_in_place: bool) -> torch.Tensor:
    """Bool ``[qkv_width]``: the columns a forward may write in the valid rows."""
    cols = torch.zeros(spec.qkv_width, dtype=torch.bool)
    if not rotates_in_place:
        return cols
    per_head = torch.zeros(spec.head_dim, dtype=torch.bool)
    per_head[: spec.rotary_dim] = True
    q = torch.ones(spec.head_dim, dtype=torch.bool) if spec.use_logn_attn else per_head
    cols[: spec.q_width] = q.repeat(spec.num_heads)
    cols[spec.q_width : spec.q_width + spec.kv_width] = per_head.repeat(spec.num_kv_heads)
    return cols


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Bits, not values: exact, NaN-safe, and defined for FP8 (torch.equal is not everywhere).
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1], t.element_size())


def unexpected_writes(
    before: torch.Tensor,
    after: torch.Tensor,
    spec: AttentionSpec,
    tokens: int,
    rotates_in_place: bool,
) -> str | None:
    """None when ``after`` differs from ``before`` only where the contract allows; otherwise
    which region was written (padding rows, V, unrotated Q/K columns)."""
    changed = (_bytes(before) != _bytes(after)).any(dim=2).cpu()
    if changed[tokens:].any():
        return "the backend wrote the padding rows"
    allowed = writable_columns(spec, rotates_in_place)
    wrong = changed[:tokens] & ~allowed
    if not wrong.any():
        return None
    col = int(wrong.any(dim=0).nonzero()[0])
    if col >= spec.q_width + spec.kv_width:
        region = "the V columns"
    elif col >= spec.q_width:
        region = "K columns outside the rotated dims"
    else:
        region = "Q columns outside the rotated dims" if rotates_in_place else "the Q columns"
    if not rotates_in_place:
        region += " (this plan applies no in-place pass: the buffer must stay as it was)"
    return f"the backend wrote {region} (first at column {col})"
