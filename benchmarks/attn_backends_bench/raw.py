"""The raw kernel: what the public API's ``forward`` calls, called directly by hand.

The baseline of the engine-view modes. It runs the very kernels the API's plan runs for the
batch, with none of the contract around them: the raw RoPE kernel the API would use (the native
``rope_logn_``, flashinfer's ``apply_rope_pos_ids_inplace``, torch ops, or RoPE fused into the
attention kernel), then ``BatchPrefillWithRaggedKVCacheWrapper.run`` on the cheapest views of
the packed rows a hand-written engine would take. ``API - raw`` is then what the contract costs.

It exists for the backends whose plan runs that kernel (the flashinfer backends, the API's
usual pick on NVIDIA), as their decision record says; when the API runs another kernel the raw
path is skipped and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from attn_backends import AttentionSpec, FMHAParams
from attn_backends.plugin import RopePass, rope_passes

from .paths import PreparedPath, Skip, rope_tables, rotate_
from .ragged import RAGGED_KERNEL, flashinfer_ragged, kernel_name

ROPE_TEXT: dict[str, str] = {
    "none": "none (the spec has no RoPE)",
    "fused": "fused into the kernel (ROPE_LLAMA)",
    "native": "attn_backends native rope_logn_, in place on the packed rows",
    "flashinfer": "flashinfer apply_rope_pos_ids_inplace on the packed rows",
    "torch": "torch ops, in place on the packed rows",
}
"""What each RoPE mode of the API's plan runs, called by hand; another registered pass is
called through its own ``apply`` (`PASS_TEXT`)."""
PASS_TEXT = "the {} RoPE pass, through its apply"


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
            "rope": ROPE_TEXT.get(self.rope, PASS_TEXT.format(self.rope)),
        }


def _registered_pass(name: str) -> RopePass | None:
    return next((p for p in rope_passes() if p.name == name), None)


@dataclass(frozen=True)
class ApiPlan:
    """What the public API's plan ran for the batch: its kernel and its RoPE/logn pass."""

    backend: str | None
    kernel: str | None
    """The library kernel the backend's decision record names (``kernel``)."""
    preprocess: str | None
    """``none``, ``fused`` or the name of the separate RoPE pass the batch ran."""

    @classmethod
    def from_record(cls, backend: str | None, details: Mapping[str, str]) -> ApiPlan:
        """Read back from the decision record's text.

        The one place the benchmark parses a decision: the selection does not yet carry it as
        typed attributes (the bound pass, the kernel variant). Once it does, read those here.
        """
        return cls(backend, details.get("kernel"), details.get("preprocess"))


def raw_recipe(api: ApiPlan, spec: AttentionSpec, device: torch.device) -> RawRecipe | Skip:
    """The raw counterpart of the API's plan: its kernel and the batch's RoPE pass."""
    if api.kernel != RAGGED_KERNEL:
        return Skip(
            f"the public API runs {api.backend or 'nothing'}; the raw baseline is flashinfer's "
            f"ragged kernel ({RAGGED_KERNEL}), built when the API's plan runs it"
        )
    rope = api.preprocess or ""
    if rope not in ROPE_TEXT and _registered_pass(rope) is None:
        return Skip(f"the public API's RoPE pass {api.preprocess!r} is not registered")
    fused = rope == "fused"
    return RawRecipe(kernel_name(spec, device, fused_rope=fused), rope)


Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``(rows, q, k)``: rotate in place; ``q``/``k`` are views of ``rows``."""


def _through_pass(name: str, spec: AttentionSpec, params: FMHAParams) -> Rotation:
    """A registered pass called through its ``apply``; a buffer it declines goes to the torch
    pass, as the API's plan does."""
    chosen, fallback = _registered_pass(name), _registered_pass("torch")
    if chosen is None or fallback is None:
        raise ValueError(f"no RoPE pass named {name!r} (or 'torch') is registered")

    def rotate(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        if not chosen.apply(rows, spec, params):
            fallback.apply(rows, spec, params)

    return rotate


def raw_rotation(rope: str, spec: AttentionSpec, params: FMHAParams) -> Rotation | None:
    """The raw RoPE kernel call for ``rope``; None when the attention kernel does it or the
    spec has no RoPE.

    ``torch`` on plain RoPE is torch ops on tables built once per batch, as a hand-written
    engine does; the native kernel, a RoPE-scaled or logn spec on ``torch`` and any other pass
    go through the registered pass's ``apply`` (which builds torch tables per call).
    """
    if rope in ("none", "fused"):
        return None
    tokens = params.token_q_num
    plain = spec.rope is not None and spec.rope.is_plain and not spec.use_logn_attn
    tables = rope_tables(spec, params) if rope == "torch" and plain else None
    if tables is not None:
        heads = spec.num_heads + spec.num_kv_heads
        width = spec.q_width + spec.kv_width

        def torch_rope(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
            rotate_(rows[:, :width].view(tokens, heads, spec.head_dim), tables)

        return torch_rope
    if rope != "flashinfer":
        return _through_pass(rope, spec, params)
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
