"""The legacy path: what a chat engine does with an embedding batch when it has no no-cache path.

Per layer: copy Q, K and V out of the packed rows into new dense ``[T, H, D]`` buffers (the
layout the kernel reads; a head-major transpose moves the same bytes), rotate the Q/K copies,
write K/V into a paged cache nobody reads, then run the ragged kernel on the copies.

A fair baseline rotates with the fastest RoPE the engine it stands for could use, so the path
comes in variants (`legacy_variants`), each recording which RoPE it ran:

* ``legacy``: the copies, then the fastest in-place RoPE on them: flashinfer's
  ``apply_rope_pos_ids_inplace`` where it serves the spec, else torch ops. The native kernel
  of this package cannot serve: it rotates packed Q|K|V rows, not separate Q and K tensors.
* ``legacy:fused-copy-rope``: flashinfer's ``apply_rope_pos_ids`` reads Q/K from the packed
  rows and writes the rotated copies: the copy and the rotation in one pass.
* ``legacy:torch-rope``: torch ops on the copies, the baseline as it was first measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from attn_backends_builtin._flashinfer_rope import flashinfer_rope_refusal

from attn_backends import AttentionSpec, FMHAParams, Platform

from .paths import PreparedPath, Skip, qkv_views, rope_tables, rotate_
from .ragged import RaggedKernel, flashinfer_ragged, kernel_name

CACHE_BLOCK = 64

LegacyRope = Literal["none", "torch", "flashinfer-inplace", "flashinfer-fused-copy"]

ROPE_TEXT: dict[LegacyRope, str] = {
    "none": "none (the spec has no RoPE)",
    "torch": "torch ops on the Q/K copies, in place",
    "flashinfer-inplace": "flashinfer apply_rope_pos_ids_inplace on the Q/K copies",
    "flashinfer-fused-copy": "flashinfer apply_rope_pos_ids: copy and rotation in one pass",
}
NATIVE_REFUSAL = "the native kernel rotates packed Q|K|V rows in place, not separate Q and K copies"


@dataclass(frozen=True, eq=False)
class PagedCache:
    """A paged KV cache ``[num_blocks, 2, block, Hkv, D]`` and where each token's K/V go."""

    tensor: torch.Tensor
    k_slots: torch.Tensor
    """int64 ``[tokens]`` row of each token's K in ``rows()``; its V is ``block`` rows later."""
    v_slots: torch.Tensor
    block: int

    def rows(self) -> torch.Tensor:
        """The cache as ``[num_blocks * 2 * block, Hkv, D]`` rows (a view)."""
        return self.tensor.flatten(0, 2)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self.rows()
        rows.index_copy_(0, self.k_slots, k)
        rows.index_copy_(0, self.v_slots, v)


def paged_cache(spec: AttentionSpec, params: FMHAParams, block: int = CACHE_BLOCK) -> PagedCache:
    """Blocks handed out in order, ``ceil(L / block)`` per sequence."""
    k_slots: list[torch.Tensor] = []
    first = 0
    for length in params.input_lengths:
        pos = torch.arange(length, dtype=torch.int64)
        blocks = first + pos // block
        k_slots.append(blocks * (2 * block) + pos % block)
        first += -(-length // block)
    tensor = torch.empty(
        max(1, first),
        2,
        block,
        spec.num_kv_heads,
        spec.head_dim,
        dtype=spec.dtype,
        device=params.device,
    )
    k = torch.cat(k_slots).to(params.device)
    return PagedCache(tensor, k, k + block, block)


@dataclass(frozen=True)
class LegacyVariant:
    """One legacy path to measure: its RoPE, and why (or why it cannot run here)."""

    path: str
    label: str
    rope: LegacyRope
    why: str
    unavailable: str | None = None
    """Set when this variant's RoPE cannot run here: the path is recorded as skipped."""


def legacy_variants(spec: AttentionSpec, platform: Platform) -> tuple[LegacyVariant, ...]:
    """The legacy paths for ``spec`` on ``platform``, the fairest (``legacy``) first.

    Where flashinfer's RoPE kernels serve a spec is the flashinfer plugin's own rule (its RoPE
    pass's refusal), the same on the copies as on the packed rows; ``platform`` must have
    probed the ``flashinfer`` library.
    """
    base = "legacy: copy-split + paged cache write"
    if spec.rope is None:
        return (LegacyVariant("legacy", base, "none", "the spec has no RoPE"),)
    refusal = flashinfer_rope_refusal(spec, platform)
    if refusal is None:
        fastest = LegacyVariant(
            "legacy",
            f"{base}, fastest RoPE on the copies",
            "flashinfer-inplace",
            f"fastest in-place RoPE available on separate copies ({NATIVE_REFUSAL})",
        )
    else:
        fastest = LegacyVariant(
            "legacy",
            f"{base}, fastest RoPE on the copies",
            "torch",
            f"flashinfer's RoPE cannot serve: {refusal}; {NATIVE_REFUSAL}",
        )
    fused = LegacyVariant(
        "legacy:fused-copy-rope",
        f"{base}, RoPE fused into the Q/K copy",
        "flashinfer-fused-copy",
        "one kernel reads Q/K from the packed rows and writes the rotated copies",
        unavailable=None if refusal is None else f"flashinfer's RoPE cannot serve: {refusal}",
    )
    variants = [fastest, fused]
    if fastest.rope != "torch":
        variants.append(
            LegacyVariant(
                "legacy:torch-rope",
                f"{base}, torch RoPE on the copies",
                "torch",
                "the RoPE of the first legacy measurements, kept for comparison",
            )
        )
    return tuple(variants)


QKRotation = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(q view, k view) -> (q copy, k copy)`` rotated, dense ``[T, H, D]`` each."""


def _flashinfer_rope_args(spec: AttentionSpec) -> dict[str, object]:
    assert spec.rope is not None  # legacy_variants offers flashinfer RoPE only with RoPE
    return {
        "rotary_dim": spec.rotary_dim,
        "interleave": spec.rope.interleaved,
        "rope_theta": float(spec.rope.theta),
    }


def qk_rotation(rope: LegacyRope, spec: AttentionSpec, params: FMHAParams) -> QKRotation:
    """How the legacy path turns the Q/K views into rotated dense copies."""
    if (rope == "none") != (spec.rope is None):
        raise ValueError(f"legacy RoPE {rope!r} does not fit a spec with rope={spec.rope}")
    if rope == "none":
        return lambda q, k: (q.contiguous(), k.contiguous())
    if rope == "torch":
        tables = rope_tables(spec, params)
        assert tables is not None  # spec.rope is set

        def torch_rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, k = q.contiguous(), k.contiguous()
            rotate_(q, tables)
            rotate_(k, tables)
            return q, k

        return torch_rope
    import flashinfer  # untyped GPU library; present wherever this variant was offered

    args = _flashinfer_rope_args(spec)
    positions = params.positions
    if rope == "flashinfer-fused-copy":
        rotate_copy: Any = flashinfer.apply_rope_pos_ids  # untyped library function

        def fused(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q_rot, k_rot = rotate_copy(q, k, positions, **args)
            return q_rot, k_rot

        return fused
    rotate_inplace: Any = flashinfer.apply_rope_pos_ids_inplace  # untyped library function

    def inplace(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = q.contiguous(), k.contiguous()
        rotate_inplace(q, k, positions, **args)
        return q, k

    return inplace


def build_legacy(
    spec: AttentionSpec,
    params: FMHAParams,
    rope: LegacyRope,
    kernel: RaggedKernel,
    cache: PagedCache | None = None,
    details: dict[str, str] | None = None,
) -> PreparedPath:
    """The legacy step on ``kernel``: copy-split, ``rope`` on the copies, cache write, kernel."""
    kv_cache = cache if cache is not None else paged_cache(spec, params)
    tokens = params.token_q_num
    rotate = qk_rotation(rope, spec, params)

    def run(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv_views(qkv, spec, tokens)
        q, k = rotate(q, k)
        v = v.contiguous()
        kv_cache.write(k, v)
        return kernel(q, k, v).reshape(tokens, spec.q_width)

    record = {**(details or {}), "rope": ROPE_TEXT[rope], "cache_block": str(kv_cache.block)}
    return PreparedPath(run, details=record)


def build_legacy_flashinfer(
    spec: AttentionSpec, params: FMHAParams, variant: LegacyVariant
) -> PreparedPath | Skip:
    """``variant`` on flashinfer's ragged kernel; a `Skip` when it cannot run here."""
    if variant.unavailable is not None:
        return Skip(variant.unavailable)
    kernel = flashinfer_ragged(spec, params)
    if isinstance(kernel, Skip):
        return kernel
    details = {
        "flashinfer_backend": kernel_name(spec, params.device),
        "rope_why": variant.why,
    }
    return build_legacy(spec, params, variant.rope, kernel, details=details)
