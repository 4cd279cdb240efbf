"""Which implementation runs the in-place RoPE/logn pass, chosen once per spec and platform.

The pass is "none" (no RoPE, no logn), "fused" (the attention kernel applies RoPE itself), or a
separate pass over the Q|K columns run by one of: the native kernel of ``csrc/`` ("native"),
flashinfer's ``apply_rope_pos_ids_inplace`` ("flashinfer", RoPE only) or torch ops ("torch",
runs everywhere). The order of preference per platform kind is data (`PREFERENCES`), each
entry naming the measurement behind it; the first implementation that can serve the spec wins,
and the decision record says which one and why the earlier ones could not.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch

from . import _native
from ._dtypes import dtype_name
from ._params import FMHAParams
from ._platform import Platform, PlatformKind, detect_platform
from ._rope import PositionTables, apply_rope_logn, build_position_tables
from ._spec import AttentionSpec

PreprocessMode = Literal["none", "torch", "native", "flashinfer", "fused"]
"""How RoPE/logn run: not needed, a separate pass (torch / native / flashinfer), or in-kernel."""
Implementation = Literal["native", "flashinfer", "torch"]
SEPARATE_MODES: frozenset[str] = frozenset({"torch", "native", "flashinfer"})
GRAPH_MODES: frozenset[str] = frozenset({"none", "fused", "native"})
"""Passes a CUDA graph can replay for any batch of a bucket: the native kernel bounds itself
by the device-side offsets; the torch and flashinfer passes take the token count on the host
(they would rotate the bucket's padding rows), so graph mode refuses them."""

FLASHINFER_HEAD_DIMS = frozenset({64, 128, 256, 512})
"""Head dims flashinfer's RoPE kernels are compiled for (``DISPATCH_HEAD_DIM``)."""


@dataclass(frozen=True)
class Preference:
    """Implementations to try, best first, on one platform kind, and the evidence for it."""

    platform: PlatformKind
    order: tuple[Implementation, ...]
    note: str


PREFERENCES: tuple[Preference, ...] = (
    Preference(
        "cuda",
        ("native", "flashinfer", "torch"),
        "H200 2026-11-30, Qwen3-Embedding (32 seqs 64..2048, 16/8 x 128, bf16), in-place RoPE "
        "as a share of copy bandwidth (scripts/gpu/rope_kernel.py): native 85.1% (0.119 ms), "
        "flashinfer apply_rope_pos_ids_inplace 85.1% (0.119 ms, RoPE only, larger error at long "
        "positions), torch 5.8% (1.74 ms); native first: it also does logn and keeps the error "
        "within one rounding step",
    ),
    Preference(
        "rocm",
        ("native", "torch"),
        "one fused pass against the several elementwise torch kernels; not yet measured on ROCm",
    ),
    Preference("cpu", ("torch",), "torch ops; no kernel is compiled on CPU"),
)


@dataclass(frozen=True)
class PreprocessChoice:
    """The resolved pass and, in words, why."""

    mode: PreprocessMode
    reason: str
    fallback: str | None = None
    """Why the preferred implementations before ``mode`` could not serve (None: none skipped);
    shown in the decision record as ``preprocess_fallback``."""

    def details(self) -> dict[str, str]:
        """Entries for a backend's ``describe()``."""
        out: dict[str, str] = {"preprocess": self.mode}
        if self.fallback is not None:
            out["preprocess_fallback"] = self.fallback
        return out


def preprocess_mode(spec: AttentionSpec, fused_rope: bool) -> PreprocessMode:
    """The kind of pass before choosing an implementation: "none", "fused", or "torch".

    ``fused`` only when the kernel can do all of it: rotate-half over the whole head, no logn.
    "torch" stands for any separate pass here; `resolve_preprocess` picks its implementation.
    """
    if spec.rope is None and not spec.use_logn_attn:
        return "none"
    if fused_rope and spec.rope_fusable:
        return "fused"
    return "torch"


def native_refusal(spec: AttentionSpec, platform: Platform) -> str | None:
    """Why the native kernel cannot serve this spec here (None: it can)."""
    if platform.kind not in ("cuda", "rocm"):
        return f"runs on CUDA/ROCm devices, not {platform.kind}"
    if spec.dtype not in _native.NATIVE_DTYPES:
        return f"serves float32/float16/bfloat16, not {dtype_name(spec.dtype)}"
    if spec.rotary_dim > _native.MAX_ROTARY_DIM:
        return f"rotary_dim {spec.rotary_dim} > {_native.MAX_ROTARY_DIM}"
    if platform.assumed:
        return None
    return _native.unavailable_reason()


def flashinfer_refusal(spec: AttentionSpec, platform: Platform) -> str | None:
    """Why flashinfer's in-place RoPE cannot serve this spec here (None: it can)."""
    if platform.kind != "cuda":
        return f"runs on CUDA devices, not {platform.kind}"
    if not platform.has_library("flashinfer"):
        return "flashinfer is not installed"
    if spec.rope is None:
        return "applies RoPE only and the spec has none"
    if spec.use_logn_attn:
        return "has no logn scaling"
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return f"serves float16/bfloat16, not {dtype_name(spec.dtype)}"
    if spec.head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head_dim {spec.head_dim} is not one of 64, 128, 256, 512"
    # One thread rotates a 16-byte vector (or head_dim / 32 elements, if more); a vector must
    # not straddle the rotary boundary, nor the two halves in rotate-half style.
    vec = max(8, spec.head_dim // 32)
    span = spec.rotary_dim if spec.rope.interleaved else spec.rotary_dim // 2
    if span % vec:
        style = "rotary_dim" if spec.rope.interleaved else "rotary_dim / 2"
        return f"{style} ({span}) is not a multiple of its vector width {vec}"
    return None


def _refusal(impl: Implementation, spec: AttentionSpec, platform: Platform) -> str | None:
    if impl == "native":
        return native_refusal(spec, platform)
    if impl == "flashinfer":
        return flashinfer_refusal(spec, platform)
    return None


def preference_for(kind: PlatformKind) -> Preference:
    return next(p for p in PREFERENCES if p.platform == kind)


def choose_preprocess(
    spec: AttentionSpec, platform: Platform, fused_rope: bool
) -> PreprocessChoice:
    """Resolve the pass for ``spec`` on ``platform`` (uncached; see `resolve_preprocess`)."""
    kind = preprocess_mode(spec, fused_rope)
    if kind == "none":
        return PreprocessChoice("none", "the spec has no RoPE and no logn")
    if kind == "fused":
        return PreprocessChoice("fused", "the attention kernel applies RoPE itself")
    pref = preference_for(platform.kind)
    skipped: list[str] = []
    for impl in pref.order:
        problem = _refusal(impl, spec, platform)
        if problem is None:
            why = f"first that fits of {' > '.join(pref.order)} on {platform.kind}"
            if platform.assumed and impl == "native":
                why += " (dry run: built on first use)"
            fallback = "; ".join(skipped) if skipped else None
            return PreprocessChoice(impl, why, fallback)
        skipped.append(f"{impl}: {problem}")
    raise AssertionError(f"no RoPE/logn implementation in {pref.order}")  # torch always fits


_CPU = Platform(kind="cpu")
_choices: dict[tuple[AttentionSpec, Platform, bool], PreprocessChoice] = {}
_platforms: dict[str, Platform] = {}
_cache_lock = threading.Lock()


def resolve_preprocess(
    spec: AttentionSpec, platform: Platform, fused_rope: bool
) -> PreprocessChoice:
    """`choose_preprocess`, remembered per (spec, platform, fused_rope) for the process."""
    key = (spec, platform, fused_rope)
    with _cache_lock:
        cached = _choices.get(key)
    if cached is not None:
        return cached
    choice = choose_preprocess(spec, platform, fused_rope)
    with _cache_lock:
        return _choices.setdefault(key, choice)


def platform_of(device: torch.device) -> Platform:
    """The platform a tensor device belongs to, detected once per device.

    A device other than a GPU is plain ``cpu``: only torch serves it, so nothing is probed.
    """
    if device.type != "cuda":
        return _CPU
    name = str(device)
    with _cache_lock:
        known = _platforms.get(name)
    if known is not None:
        return known
    found = detect_platform(device)
    with _cache_lock:
        return _platforms.setdefault(name, found)


def clear_preprocess_cache() -> None:
    with _cache_lock:
        _choices.clear()
        _platforms.clear()


def prepare_tables(
    mode: PreprocessMode, spec: AttentionSpec, params: FMHAParams
) -> PositionTables | None:
    """Host work of one batch: only the torch pass needs per-token tables.

    The native kernel derives positions from ``cu_seqlens``; flashinfer reads
    ``params.positions`` (int32 on the device), which `FMHAParams` already holds.
    """
    return build_position_tables(spec, params.positions) if mode == "torch" else None


def _flashinfer_aligned(packed: torch.Tensor) -> bool:
    """flashinfer moves 16-byte vectors: the buffer and its row stride must be aligned to it."""
    size = packed.element_size()
    return packed.data_ptr() % 16 == 0 and (packed.stride(0) * size) % 16 == 0


def _apply_flashinfer(packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams) -> None:
    import flashinfer  # lazily: a GPU library, present when this mode was chosen

    assert spec.rope is not None  # flashinfer is chosen only with RoPE
    tokens = params.token_q_num
    rows = packed[:tokens]
    q = rows[:, : spec.q_width].view(tokens, spec.num_heads, spec.head_dim)
    k = rows[:, spec.q_width : spec.q_width + spec.kv_width].view(
        tokens, spec.num_kv_heads, spec.head_dim
    )
    flashinfer.apply_rope_pos_ids_inplace(
        q,
        k,
        params.positions,
        rotary_dim=spec.rotary_dim,
        interleave=spec.rope.interleaved,
        rope_theta=float(spec.rope.theta),
    )


def apply_preprocess(
    mode: PreprocessMode,
    packed: torch.Tensor,
    spec: AttentionSpec,
    params: FMHAParams,
    tables: PositionTables | None,
) -> None:
    """Run the separate pass ``mode`` on the Q|K columns of the valid rows of ``packed``.

    A buffer that flashinfer cannot take (rows not 16-byte aligned) goes through torch, with
    tables built on the spot: correct, slower, and only for such unusual buffers.
    """
    tokens = params.token_q_num
    if mode == "native":
        _native.rope_logn_(packed, params.cu_seqlens_q, tokens, spec)
        return
    if mode == "flashinfer" and _flashinfer_aligned(packed):
        _apply_flashinfer(packed, spec, params)
        return
    if tables is None:
        tables = build_position_tables(spec, params.positions)
    heads = spec.num_heads + spec.num_kv_heads
    qk = packed[:tokens, : spec.q_width + spec.kv_width].view(tokens, heads, spec.head_dim)
    apply_rope_logn(qk, spec.num_heads, spec, tables)


def apply_graph_preprocess(
    mode: PreprocessMode,
    packed: torch.Tensor,
    spec: AttentionSpec,
    cu_seqlens: torch.Tensor,
    rows: int,
) -> None:
    """The separate pass of graph mode: launched over all ``rows`` of the bucket, bounded on
    the device by ``cu_seqlens[-1]`` (the current batch's tokens)."""
    if mode != "native":
        raise AssertionError(f"graph mode admits no {mode} pass")  # prepare_graph refuses it
    _native.rope_logn_(packed, cu_seqlens, rows, spec)
