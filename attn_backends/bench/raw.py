"""The raw kernel: what the public API's ``forward`` calls, called directly by hand.

The baseline of the engine-view modes. It runs the very kernels the API's plan runs for the
batch, with none of the contract around them: the raw RoPE kernel the API would use (the native
``rope_logn_``, flashinfer's ``apply_rope_pos_ids_inplace``, torch ops, or RoPE fused into the
attention kernel), then ``BatchPrefillWithRaggedKVCacheWrapper.run`` on the cheapest views of
the packed rows a hand-written engine would take. ``API - raw`` is then what the contract costs.

It exists for the flashinfer backends only (the API's usual pick on NVIDIA); when the API runs
another backend the raw path is skipped and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attn_backends import AttentionSpec, FMHAParams, RopePass, _native, rope_passes
from attn_backends._preprocess import apply_torch_pass
from attn_backends._rope import apply_rope_logn, build_position_tables

from .paths import PreparedPath, Skip, flashinfer_kernel_name, flashinfer_ragged

RAW_BACKENDS = frozenset({"flashinfer", "flashinfer-rope"})
"""Backends whose kernel the raw path can call by hand."""

ROPE_TEXT: dict[str, str] = {
    "none": "none (the spec has no RoPE)",
    "fused": "fused into the kernel (ROPE_LLAMA)",
    "native": "attn_backends native rope_logn_, in place on the packed rows",
    "flashinfer": "flashinfer apply_rope_pos_ids_inplace on the packed rows",
    "torch": "torch ops, in place on the packed rows",
}
"""What each RoPE mode of the API's plan runs, called by hand; another registered pass is
called through its own ``apply``."""


@dataclass(frozen=True)
class RawRecipe:
    """Which kernels the raw path calls: the API plan's, for this batch."""

    kernel: str
    """flashinfer's implementation, ``fa2`` or ``fa3``."""
    rope: str
    """The API plan's RoPE mode: ``none``, ``fused`` or the name of its separate pass."""

    def details(self) -> dict[str, str]:
        return {
            "flashinfer_backend": self.kernel,
            "pos_encoding_mode": "ROPE_LLAMA" if self.rope == "fused" else "NONE",
            "rope": ROPE_TEXT.get(self.rope, f"the {self.rope} RoPE pass, through its apply"),
        }


def _registered_pass(name: str) -> RopePass | None:
    return next((p for p in rope_passes() if p.name == name), None)


def raw_recipe(
    api_backend: str | None, preprocess: str | None, spec: AttentionSpec, device: torch.device
) -> RawRecipe | Skip:
    """The raw counterpart of the API's plan: its backend and the batch's RoPE pass."""
    if api_backend not in RAW_BACKENDS:
        return Skip(
            f"the public API runs {api_backend or 'nothing'}; the raw baseline is flashinfer's "
            f"ragged kernel, built when the API runs {' or '.join(sorted(RAW_BACKENDS))}"
        )
    rope = preprocess or ""
    if rope not in ROPE_TEXT and _registered_pass(rope) is None:
        return Skip(f"the public API's RoPE pass {preprocess!r} is not registered")
    fused = rope == "fused"
    return RawRecipe(flashinfer_kernel_name(spec, device, fused_rope=fused), rope)


Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``(rows, q, k)``: rotate in place; ``q``/``k`` are views of ``rows``."""


def raw_rotation(rope: str, spec: AttentionSpec, params: FMHAParams) -> Rotation | None:
    """The raw RoPE kernel call for ``rope``; None when the attention kernel does it or the
    spec has no RoPE."""
    if rope in ("none", "fused"):
        return None
    tokens = params.token_q_num
    if rope == "native":
        cu = params.cu_seqlens_q
        return lambda rows, q, k: _native.rope_logn_(rows, cu, tokens, spec)
    if rope == "torch":
        tables = build_position_tables(spec, params.positions)
        heads = spec.num_heads + spec.num_kv_heads
        width = spec.q_width + spec.kv_width

        def torch_rope(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
            qk = rows[:, :width].view(tokens, heads, spec.head_dim)
            apply_rope_logn(qk, spec.num_heads, spec, tables)

        return torch_rope
    if rope != "flashinfer":
        other = _registered_pass(rope)
        if other is None:
            raise ValueError(f"no RoPE pass named {rope!r} is registered")

        def registered(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
            if not other.apply(rows, spec, params):  # a buffer it cannot take: torch serves it
                apply_torch_pass(rows, spec, params)

        return registered
    import flashinfer  # untyped GPU library

    assert spec.rope is not None  # the API runs a flashinfer pass only with RoPE
    rotate: Any = flashinfer.apply_rope_pos_ids_inplace  # untyped library function
    positions = params.positions
    rotary_dim, interleave = spec.rotary_dim, spec.rope.interleaved
    theta = float(spec.rope.theta)
    return lambda rows, q, k: rotate(
        q, k, positions, rotary_dim=rotary_dim, interleave=interleave, rope_theta=theta
    )


def build_raw(spec: AttentionSpec, params: FMHAParams, recipe: RawRecipe) -> PreparedPath | Skip:
    """The raw step: RoPE kernel (if separate), views, ``wrapper.run``, the output as rows."""
    kernel = flashinfer_ragged(spec, params, fused_rope=recipe.rope == "fused")
    if isinstance(kernel, Skip):
        return kernel
    rotate = raw_rotation(recipe.rope, spec, params)
    tokens, d, q_width = params.token_q_num, spec.head_dim, spec.q_width
    heads = spec.num_heads + 2 * spec.num_kv_heads
    split = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)

    def run(qkv: torch.Tensor) -> torch.Tensor:
        rows = qkv if qkv.shape[0] == tokens else qkv[:tokens]
        q, k, v = rows.view(tokens, heads, d).split_with_sizes(split, 1)
        if rotate is not None:
            rotate(rows, q, k)
        return kernel(q, k, v).view(tokens, q_width)

    return PreparedPath(run, backend="flashinfer", details=recipe.details())
