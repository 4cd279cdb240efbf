"""flashinfer's in-place RoPE as a separate RoPE pass (`attn_backends.plugin.RopePass`).

Registered by the flashinfer plugin when it loads. It rotates Q and K views of the packed rows
with ``flashinfer.apply_rope_pos_ids_inplace`` (positions from ``FMHAParams.positions``, already
int32 on the device) and ranks between the native kernel and torch on CUDA: as fast as the
native kernel, but RoPE only (no logn) and with a larger error at long positions.
"""

from __future__ import annotations

from typing import Any

import torch

from attn_backends import AttentionSpec, FMHAParams, Platform
from attn_backends.plugin import RopePass, dtype_name

from ._flashinfer_common import is_aligned

ROPE_HEAD_DIMS = frozenset({64, 128, 256, 512})
"""Head dims flashinfer's RoPE kernels are compiled for (``DISPATCH_HEAD_DIM``)."""


FLASHINFER_SCALINGS = frozenset({"default", "linear"})
"""Scaling rules this pass computes exactly: ``rope_scale`` divides every frequency, which is
linear scaling. Its llama3 variant (``apply_llama31_rope_pos_ids_inplace``) is not wired: no
CPU fake checks its argument mapping, so llama3 goes to the torch pass."""


def flashinfer_rope_refusal(spec: AttentionSpec, platform: Platform) -> str | None:
    """Why flashinfer's in-place RoPE cannot serve this spec here (None: it can)."""
    if platform.kind != "cuda":
        return f"runs on CUDA devices, not {platform.kind}"
    if not platform.has_library("flashinfer"):
        return "flashinfer is not installed"
    if spec.rope is None:
        return "applies RoPE only and the spec has none"
    if spec.use_logn_attn:
        return "has no logn scaling"
    scaling = spec.rope.scaling
    if scaling is not None and scaling.rope_type not in FLASHINFER_SCALINGS:
        return (
            f"applies plain or linear RoPE scaling only, not {scaling.rope_type!r} (the torch "
            "pass applies every RoPE scaling type)"
        )
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return f"serves float16/bfloat16, not {dtype_name(spec.dtype)}"
    if spec.head_dim not in ROPE_HEAD_DIMS:
        return f"head_dim {spec.head_dim} is not one of 64, 128, 256, 512"
    # One thread rotates a 16-byte vector (or head_dim / 32 elements, if more); a vector must
    # not straddle the rotary boundary, nor the two halves in rotate-half style.
    vec = max(8, spec.head_dim // 32)
    span = spec.rotary_dim if spec.rope.interleaved else spec.rotary_dim // 2
    if span % vec:
        style = "rotary_dim" if spec.rope.interleaved else "rotary_dim / 2"
        return f"{style} ({span}) is not a multiple of its vector width {vec}"
    return None


def apply_flashinfer_rope(packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams) -> bool:
    """Rotate Q and K of the valid rows in place; False (nothing written) for rows that break
    flashinfer's 16-byte rule, which the torch pass then serves."""
    if not is_aligned(packed):
        return False
    import flashinfer  # lazily: a GPU library, present when this pass was chosen

    assert spec.rope is not None  # chosen only with RoPE
    tokens = params.token_q_num
    rows = packed[:tokens]
    q = rows[:, : spec.q_width].view(tokens, spec.num_heads, spec.head_dim)
    k = rows[:, spec.q_width : spec.q_width + spec.kv_width].view(
        tokens, spec.num_kv_heads, spec.head_dim
    )
    _rotate(flashinfer, q, k, spec, params)
    return True


def apply_flashinfer_rope_separate(
    q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, params: FMHAParams
) -> bool:
    """The same on separate ``q`` ``[rows, Hq, D]`` and ``k`` ``[rows, Hkv, D]``; False
    (nothing written) when either breaks the 16-byte rule."""
    if not (is_aligned(q) and is_aligned(k)):  # base and row stride, as for packed rows
        return False
    import flashinfer  # lazily: a GPU library, present when this pass was chosen

    tokens = params.token_q_num
    _rotate(flashinfer, q[:tokens], k[:tokens], spec, params)
    return True


def _rotate(
    flashinfer: Any, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, params: FMHAParams
) -> None:
    """``apply_rope_pos_ids_inplace`` on ``[tokens, heads, D]`` views of the valid rows."""
    assert spec.rope is not None  # chosen only with RoPE
    flashinfer.apply_rope_pos_ids_inplace(
        q,
        k,
        params.positions,
        rotary_dim=spec.rotary_dim,
        interleave=spec.rope.interleaved,
        rope_scale=float(spec.rope.scaling.factor) if spec.rope.scaling is not None else 1.0,
        rope_theta=float(spec.rope.theta),
    )


FLASHINFER_ROPE = RopePass(
    name="flashinfer",
    ranks=(("cuda", 50),),
    note="H200 2026-11-30, Qwen3-Embedding in-place RoPE (scripts/gpu/rope_kernel.py): "
    "apply_rope_pos_ids_inplace 85.1% of copy bandwidth (0.119 ms), like the native kernel, "
    "but RoPE only and a larger error at long positions: below native, above torch (5.8%)",
    refusal=flashinfer_rope_refusal,
    apply=apply_flashinfer_rope,
    apply_separate=apply_flashinfer_rope_separate,
)
