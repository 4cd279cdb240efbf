"""Which implementation runs the in-place RoPE/logn pass, chosen once per spec and platform.

The pass is "none" (no RoPE, no logn), "fused" (the attention kernel applies RoPE itself), or a
separate pass over the Q|K columns run by a `RopePass`. The core has two: the native kernel of
``csrc/`` ("native", CUDA and ROCm) and torch ops ("torch", runs everywhere); a plugin may add
its own in its `PluginManifest` (the flashinfer plugin adds flashinfer's in-place RoPE); the
table of passes lives in `_rope_passes`. Each
pass ranks itself per platform kind, with the measurement behind the rank; the first pass, best
rank first, that can serve the spec wins, and the decision record says which one and why the
better-ranked ones could not.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .._values._dtypes import dtype_name
from .._values._errors import SpecError
from .._values._params import FMHAParams
from .._values._platform import Platform, detect_platform
from .._values._spec import AttentionSpec, kernel_rope_fusable
from . import _native
from ._rope import PositionTables, apply_rope_logn, build_position_tables
from ._rope_passes import RopePass as RopePass  # the table's names, kept importable from here
from ._rope_passes import find_rope_pass, set_core_passes, table_generation
from ._rope_passes import passes_for as passes_for
from ._rope_passes import register_rope_pass as register_rope_pass
from ._rope_passes import rope_passes as rope_passes

PreprocessMode = str
"""How RoPE/logn run: "none", "fused", or the name of the `RopePass` that runs them."""
IN_KERNEL: frozenset[str] = frozenset({"none", "fused"})
"""Modes that write nothing to the caller's buffer; every other mode is a separate pass."""
GRAPH_MODES: frozenset[str] = frozenset({"none", "fused", "native"})
"""Passes a CUDA graph can replay for any batch of a bucket: the native kernel bounds itself
by the device-side offsets; a pass that takes the token count on the host (torch ops,
flashinfer's) would rotate the bucket's padding rows, so graph mode refuses it."""


def is_separate(mode: PreprocessMode) -> bool:
    """Whether ``mode`` rotates the caller's buffer in place (a separate pass)."""
    return mode not in IN_KERNEL


@dataclass(frozen=True)
class PreprocessChoice:
    """The resolved pass and, in words, why."""

    mode: PreprocessMode
    reason: str
    fallback: str | None = None
    """Why the better-ranked passes before ``mode`` could not serve (None: none skipped);
    shown in the decision record as ``preprocess_fallback``."""
    rope_pass: RopePass | None = field(default=None, compare=False, repr=False)
    """The pass object that runs ``mode`` (None for "none" and "fused"): plans hold it, so a
    layer runs it without looking a name up."""

    @property
    def rotates(self) -> bool:
        """Whether this choice writes the caller's buffer (a separate pass)."""
        return self.rope_pass is not None

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
    if fused_rope and kernel_rope_fusable(spec):
        return "fused"
    return "torch"


def scaling_refusal(spec: AttentionSpec) -> str | None:
    """Why a theta-only kernel cannot serve the spec's RoPE scaling (None: it has none)."""
    if spec.rope is None or spec.rope.scaling is None or spec.rope.is_plain:
        return None
    return (
        f"computes plain theta RoPE only, not {spec.rope.scaling.rope_type!r} scaling (the torch "
        "pass applies every RoPE scaling type)"
    )


def native_refusal(spec: AttentionSpec, platform: Platform) -> str | None:
    """Why the native kernel cannot serve this spec here (None: it can)."""
    if platform.kind not in ("cuda", "rocm"):
        return f"runs on CUDA/ROCm devices, not {platform.kind}"
    if spec.dtype not in _native.NATIVE_DTYPES:
        return f"serves float32/float16/bfloat16, not {dtype_name(spec.dtype)}"
    if spec.rotary_dim > _native.MAX_ROTARY_DIM:
        return f"rotary_dim {spec.rotary_dim} > {_native.MAX_ROTARY_DIM}"
    scaled = scaling_refusal(spec)
    if scaled is not None:
        return scaled
    if platform.assumed:
        return None
    return _native.unavailable_reason()


def _apply_native(packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams) -> bool:
    _native.rope_logn_(packed, params.cu_seqlens_q, params.token_q_num, spec)
    return True


def _apply_native_separate(
    q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, params: FMHAParams
) -> bool:
    # view, never reshape: a copy would be rotated instead of the caller's tensors
    rows_q, rows_k = q.view(q.shape[0], -1), k.view(k.shape[0], -1)
    _native.rope_logn_qk_(rows_q, rows_k, params.cu_seqlens_q, params.token_q_num, spec)
    return True


def apply_torch_pass(packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams) -> bool:
    """The torch pass with tables built on the spot (plans build them once, in prepare)."""
    _apply_torch(
        packed, spec, params, build_position_tables(spec, params.positions, params.max_seqlen_q)
    )
    return True


def _apply_torch(
    packed: torch.Tensor, spec: AttentionSpec, params: FMHAParams, tables: PositionTables
) -> None:
    tokens = params.token_q_num
    heads = spec.num_heads + spec.num_kv_heads
    qk = packed[:tokens, : spec.q_width + spec.kv_width].view(tokens, heads, spec.head_dim)
    apply_rope_logn(qk, spec.num_heads, spec, tables)


NATIVE = RopePass(
    name="native",
    ranks=(("cuda", 100), ("rocm", 100)),
    note="H200 2026-11-30, Qwen3-Embedding (32 seqs 64..2048, 16/8 x 128, bf16), in-place RoPE "
    "as a share of copy bandwidth (scripts/gpu/rope_kernel.py): native 85.1% (0.119 ms), torch "
    "5.8% (1.74 ms); it also does logn and keeps the error within one rounding step. ROCm: one "
    "fused pass against several elementwise torch kernels, not yet measured",
    refusal=native_refusal,
    apply=_apply_native,
    apply_separate=_apply_native_separate,
)
TORCH = RopePass(
    name="torch",
    ranks=(("cpu", 0), ("cuda", 0), ("rocm", 0)),
    note="torch ops: run everywhere, every spec; the last resort on GPUs",
    refusal=lambda spec, platform: None,
    apply=apply_torch_pass,
)
set_core_passes(NATIVE, TORCH)


def choose_preprocess(
    spec: AttentionSpec, platform: Platform, fused_rope: bool
) -> PreprocessChoice:
    """Resolve the pass for ``spec`` on ``platform`` (uncached; see `resolve_preprocess`)."""
    kind = preprocess_mode(spec, fused_rope)
    if kind == "none":
        return PreprocessChoice("none", "the spec has no RoPE and no logn")
    if kind == "fused":
        return PreprocessChoice("fused", "the attention kernel applies RoPE itself")
    order = passes_for(platform.kind)
    names = " > ".join(p.name for p in order)
    skipped: list[str] = []
    for candidate in order:
        problem = candidate.refusal(spec, platform)
        if problem is None:
            why = f"first that fits of {names} on {platform.kind}"
            if platform.assumed and candidate is NATIVE:
                why += " (dry run: built on first use)"
            fallback = "; ".join(skipped) if skipped else None
            return PreprocessChoice(candidate.name, why, fallback, candidate)
        skipped.append(f"{candidate.name}: {problem}")
    raise AssertionError(f"no RoPE/logn pass in {names}")  # torch always fits


_CPU = Platform(kind="cpu")
_choices: dict[tuple[AttentionSpec, Platform, bool, int], PreprocessChoice] = {}
_platforms: dict[str, Platform] = {}
_cache_lock = threading.Lock()


def resolve_preprocess(
    spec: AttentionSpec, platform: Platform, fused_rope: bool
) -> PreprocessChoice:
    """`choose_preprocess`, remembered per (spec, platform, fused_rope) while the table of
    passes stays as it is."""
    key = (spec, platform, fused_rope, table_generation())
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
    """Forget every remembered choice of a pass and every detected device platform, so the
    next plan asks again (tests, or a toolchain installed since)."""
    with _cache_lock:
        _choices.clear()
        _platforms.clear()


def prepare_tables(
    mode: PreprocessMode, spec: AttentionSpec, params: FMHAParams
) -> PositionTables | None:
    """Host work of one batch: the torch pass's per-token tables, for every plan that rotates.

    A plan whose packed pass is native or flashinfer (which derive positions on the device)
    still needs them: separate ``(q, k, v)`` input and buffers a pass refuses go through the
    torch pass, and building them per layer would add host work and a host-to-device copy to
    every layer. ``None`` for a plan that writes nothing.
    """
    if not is_separate(mode):
        return None
    return build_position_tables(spec, params.positions, params.max_seqlen_q)


def pass_named(mode: PreprocessMode) -> RopePass:
    """The registered pass called ``mode`` (for callers holding a name, not a plan)."""
    chosen = find_rope_pass(mode)
    if chosen is None:
        raise SpecError(f"no RoPE pass named {mode!r} is registered")
    return chosen


def run_rope_pass(
    rope_pass: RopePass,
    packed: torch.Tensor,
    spec: AttentionSpec,
    params: FMHAParams,
    tables: PositionTables | None,
) -> None:
    """Run ``rope_pass`` on the Q|K columns of the valid rows of ``packed``, in place.

    The torch pass uses the plan's ``tables``. A buffer another pass cannot take (a plugin's
    alignment rule) goes through the torch pass too: correct, slower, and only for such
    unusual buffers (tables built on the spot only where the caller has none).
    """
    if rope_pass is TORCH and tables is not None:
        _apply_torch(packed, spec, params, tables)
    elif not rope_pass.apply(packed, spec, params):
        if tables is None:
            apply_torch_pass(packed, spec, params)
        else:
            _apply_torch(packed, spec, params, tables)


def apply_preprocess(
    mode: PreprocessMode,
    packed: torch.Tensor,
    spec: AttentionSpec,
    params: FMHAParams,
    tables: PositionTables | None,
) -> None:
    """`run_rope_pass` for the pass registered as ``mode`` (plans hold the pass itself)."""
    run_rope_pass(pass_named(mode), packed, spec, params, tables)


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
