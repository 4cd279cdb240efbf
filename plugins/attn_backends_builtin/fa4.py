"""``fa4``: FlashAttention-4 (``flash-attn-4``, module ``flash_attn.cute``) on Q/K/V views.

Kernel: ``flash_attn.cute.flash_attn_varlen_func`` on the strided ``[tokens, heads, D]`` views of
the packed rows, with the plan's int32 offsets as both ``cu_seqlens_q`` and ``cu_seqlens_k``
(self-attention, no prefix). Everything the call takes besides Q, K and V is made once per batch
in ``prepare`` (`Fa4Plan`); ``attend`` passes it unchanged and syncs nothing. FA4 allocates its
own output, and for batches of more than 256 sequences two small int32 scheduling tables per
call as well, so this backend is not held to the "output only" allocation rule. Views whose
base or row stride is not 16-byte aligned are copied by FA4 itself before the call (it never
reads them wrongly); buffers torch allocates are aligned.

Limits, read from flash-attn-4 4.0.0b36 (``flash_attn/cute/interface.py``):

- architectures: the forward runs on 8.x to 12.x; sm90 (Hopper) and sm100/sm110 (Blackwell)
  are declared, the ones whose head dims the interface validates. sm80 and sm120 run
  sm80-style kernels whose limits the interface does not state: not declared;
- dtypes: float16 and bfloat16 (FP8 runs on sm100 only, and is not declared);
- head dims (``_validate_head_dims``, Q and V alike): multiples of 8 from 8 to 256 on sm90; on
  sm100/sm110 up to 128, or 256 (`extra_reasons` refuses the others there);
- windows: ``window_size=(left, right)`` lets query ``i`` see keys ``i - left .. i + right``,
  ``None`` for an unbounded side, both sides served (``_resolve_causal_local_window``); the
  kernel adds the sides to int32 indices, so each is capped at the longest sequence of the
  batch, beyond which a side changes nothing (`kernel_arguments`);
- soft-capping: ``softcap`` (``cap * tanh(s / cap)`` on the scaled score, with the fast
  approximate float32 tanh, as a score modifier FA4 builds itself; it cannot be combined with
  a second, user score modifier);
- ALiBi is not declared: FA4 has no ALiBi argument, only user ``score_mod`` functions written
  in the CuTe DSL (JIT functions over ``TensorSSA`` values, slopes read from an auxiliary
  tensor), which this backend does not implement; ALiBi specs are refused here (flashinfer and
  flex serve them). Headwise masks, chunks and MLA are not declared either.

Attention sinks (`SinkSupport`): FA4 takes them as ``learnable_sink``, one logit per query head
(``[Hq]``, float16, bfloat16 or float32, on the device), in the units of the scaled scores, not
soft-capped: the spec's definition. The contract has checked shape and device; FA4 copies them
first unless contiguous and 4-byte aligned (a layer's parameter is).

Compilation: FA4 compiles each kernel configuration with the CuTe DSL JIT the first time a
process calls it (seconds to a minute), in memory unless the environment sets
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``, which keeps them on disk. The configuration
depends on the batch too (its longest sequence, whether it has more than 256 sequences), not
only on the spec, so this backend lists no `KernelModule` for warm-up's estimate: the count
would be wrong.

Placement: none yet (no row in the ranking table). fa4 has not passed its whole conformance
suite on hardware (on the H200 of 2026-12-04, 62 of 83 cases passed and none failed before the
run's time box; docs/hardware-verification.md), so it runs only when chosen by name
(``backend="fa4"``, ``ATTN_BACKEND=fa4``). Measured there through this API: 0.79-1.00 of
FlashAttention-3's H100 throughput on the FA3 grid, 1.1-2.0x torch-varlen's, 0.84x on the
BGE-M3 shape; its row comes once the suite passes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attn_backends import AttentionSpec, FMHAParams, Platform, PrefillPlan
from attn_backends.errors import BackendFailure
from attn_backends.plugin import (
    Capabilities,
    PluginManifest,
    PrefillBackend,
    QKVViews,
    Reason,
    ReasonCode,
    SinkSupport,
    SoftcapSupport,
    WindowSupport,
    hookimpl,
)

API_VERSION = "2.0"
KERNEL = "flash_attn.cute.flash_attn_varlen_func"
DISTRIBUTION = "flash-attn-4"
HEAD_DIMS = frozenset(range(8, 257, 8))
"""What ``_validate_head_dims`` accepts on sm90 for equal Q and V head dims: multiples of the
16-byte alignment (8 elements of a 16-bit dtype) from 8 to 256."""
BLACKWELL_HEAD_DIMS = frozenset(range(8, 129, 8)) | {256}
"""The same on sm100/sm110: up to 128, and 256."""


@dataclass(frozen=True)
class KernelArguments:
    """The spec's keywords of ``flash_attn_varlen_func`` for one batch: host values only."""

    softmax_scale: float
    causal: bool
    window_size: tuple[int | None, int | None]
    """``(left, right)``: keys ``i - left .. i + right``; ``None`` for an unbounded side."""
    softcap: float
    """``cap`` of ``cap * tanh(s / cap)``; ``0.0`` means none (FA4's own convention)."""


def kernel_arguments(spec: AttentionSpec, max_seqlen: int) -> KernelArguments:
    """FA4's arguments for ``spec`` on a batch whose longest sequence has ``max_seqlen`` tokens.

    The project's `SlidingWindow` (``i - left <= j <= i + right``) is FA4's ``window_size``
    as it stands. Each side is capped at ``max_seqlen - 1``, the largest distance within a
    sequence: a wider side sees the same keys, and a side up to 2**31 - 1 would overflow the
    kernel's int32 ``index + side``. A causal spec's window has ``right = 0``, which FA4 also
    forces under ``causal=True``.
    """
    window: tuple[int | None, int | None] = (None, None)
    if spec.window is not None:
        reach = max(max_seqlen - 1, 0)
        window = (min(spec.window.left, reach), min(spec.window.right, reach))
    softcap = spec.logit_softcap
    return KernelArguments(
        softmax_scale=spec.scale,
        causal=spec.causal,
        window_size=window,
        softcap=softcap if softcap is not None else 0.0,
    )


@dataclass(frozen=True, eq=False)
class Fa4Plan:
    """One batch's call, all but Q, K and V: the same objects on every layer."""

    varlen: Callable[..., Any]
    """``flash_attn.cute.flash_attn_varlen_func`` (an untyped library function)."""
    cu_seqlens: torch.Tensor
    """int32, contiguous ``[batch + 1]`` offsets on the QKV device, for queries and keys."""
    max_seqlen: int
    arguments: KernelArguments


def _int32_offsets(params: FMHAParams) -> torch.Tensor:
    """The batch's offsets as FA4 asserts them: int32 with unit stride (`FMHAParams` builds
    them so; a batch built otherwise is converted here, once, never per layer)."""
    cu = params.cu_seqlens_q
    if cu.dtype != torch.int32 or cu.stride(0) != 1:
        cu = cu.to(torch.int32).contiguous()
    return cu


def _fa2_in_place_of_fa4(platform: Platform) -> Reason | None:
    """FlashAttention-2 (``flash-attn``) installs a ``flash_attn`` package too, without
    ``flash_attn.cute``: the library probe would count it as present."""
    version = platform.library_version("flash_attn")
    major = re.match(r"(\d+)\.", version or "")
    if major is None or int(major.group(1)) >= 4:
        return None
    try:
        importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return Reason(
            ReasonCode.LIBRARY_MISSING,
            f"flash_attn {version} is FlashAttention-2, without flash_attn.cute; needs "
            f"{DISTRIBUTION} (the fa4 extra)",
            "libraries",
            f"flash_attn {version}",
            DISTRIBUTION,
        )
    return None


@functools.cache
def cute_import_failure() -> str | None:
    """Why ``flash_attn.cute`` does not import although flash-attn-4 is installed (its CuTe
    DSL missing or broken: seen on an H200 with nvidia-cutlass-dsl's libraries but not its
    ``cutlass.cute``), once per process; None when it imports or nothing is installed (the
    library probe refuses that). ``cute_import_failure.cache_clear()`` tries again."""
    try:
        importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as exc:  # any failure of a third-party import is this reason's text
        return f"{type(exc).__name__}: {exc}"
    return None


class Fa4Backend(PrefillBackend):
    name = "fa4"
    capabilities = Capabilities(
        platforms=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=HEAD_DIMS,
        min_sm=90,
        max_sm=110,
        features=(WindowSupport(), SoftcapSupport(), SinkSupport()),
        requires=("flash_attn",),
    )

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons: list[Reason] = []
        sm = platform.sm
        if sm is not None and sm // 10 in (10, 11) and spec.head_dim not in BLACKWELL_HEAD_DIMS:
            reasons.append(
                Reason(
                    ReasonCode.HEAD_DIM,
                    "head dim not served by FA4 on sm100/sm110",
                    "head_dim",
                    str(spec.head_dim),
                    "8..128 in steps of 8, or 256",
                )
            )
        fa2 = _fa2_in_place_of_fa4(platform)
        if fa2 is not None:
            reasons.append(fa2)
        failure = (
            cute_import_failure() if platform.kind == "cuda" and not platform.assumed else None
        )
        if failure is not None:
            reasons.append(
                Reason(
                    ReasonCode.LIBRARY_MISSING,
                    f"{DISTRIBUTION} is installed but flash_attn.cute does not import; install "
                    "its CuTe DSL (nvidia-cutlass-dsl with the libraries of your CUDA release)",
                    "libraries",
                    failure,
                    "an importable flash_attn.cute",
                )
            )
        return reasons

    def describe(self, platform: Platform) -> dict[str, str]:
        return {
            **super().describe(platform),
            "kernel": KERNEL,
            "flash_attn": platform.library_version("flash_attn") or "assumed",
            "compile": "CuTe DSL JIT per kernel configuration, on first use in each process",
        }

    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> Fa4Plan:
        from flash_attn.cute import flash_attn_varlen_func  # lazily: a GPU library

        max_seqlen = params.max_seqlen_q
        return Fa4Plan(
            varlen=flash_attn_varlen_func,
            cu_seqlens=_int32_offsets(params),
            max_seqlen=max_seqlen,
            arguments=kernel_arguments(spec, max_seqlen),
        )

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, Fa4Plan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        args = kernel.arguments
        returned = kernel.varlen(
            views.q,
            views.k,
            views.v,
            cu_seqlens_q=kernel.cu_seqlens,
            cu_seqlens_k=kernel.cu_seqlens,
            max_seqlen_q=kernel.max_seqlen,
            max_seqlen_k=kernel.max_seqlen,
            softmax_scale=args.softmax_scale,
            causal=args.causal,
            window_size=args.window_size,
            softcap=args.softcap,
            learnable_sink=views.sinks,
        )
        out: torch.Tensor = returned[0]  # (out [tokens, Hq, D], lse: None unless asked for)
        return out


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[Fa4Backend])
