"""``torch-varlen``: PyTorch's own varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``)
on Q/K/V views of the packed rows.

No extra library: the kernel is the FlashAttention-2 build inside torch's CUDA wheels. Q, K and
V are handed over as the contract's ``[tokens, heads, D]`` views (rows strided, heads and the
last dim dense: the kernel reads any row stride), with the batch's int32 offsets. The kernel
allocates the output and a float32 log-sum-exp that is dropped on return; nothing else is
allocated, except the K/V copy below. ``prepare`` does the host work (offsets without empty
sequences, the keywords); ``attend`` is one call and never syncs the host.

What the installed torch takes is read from ``varlen_attn``'s signature once per process
(`installed_signature`), because the API grew release by release: the module first shipped in
torch 2.10 (with ``is_causal``, by its documentation), 2.11 takes ``window_size`` instead and
no ``enable_gqa`` (read on the H200), 2.13 takes both. So:

- masks: ``window_size`` (`window_size_of`: ``(-1, -1)`` bidirectional, ``(-1, 0)`` causal,
  ``(left, right)`` for a `SlidingWindow`); a torch without it gets ``is_causal`` and refuses
  windows, naming its version;
- GQA: ``enable_gqa=True`` where the signature has it; otherwise K and V heads are repeated to
  Q's head count inside ``attend`` (``repeat_interleave``, a copy of K and V per layer, said in
  the decision record) rather than refusing GQA models on that torch;
- attention sinks (`SinkSupport`) through ``return_aux`` (the log-sum-exp): the kernel's output
  is ``sum_j exp(s_j) v_j / exp(lse)``, and a sink adds ``exp(sink)`` to that denominator only,
  so the served output is the kernel's times ``sigmoid(lse - sink)`` per token and head, one
  float32 elementwise pass (`rescale_for_sinks`). A torch without ``return_aux`` refuses sinks.

Windows are declared (`WindowSupport`, both sides) statically: the capabilities are class data
and probing imports ``torch.nn.attention.varlen``, which pulls in ``torch._dynamo`` (0.7 s),
too much for every import of the plugins; a torch without ``window_size`` refuses them per spec
(`varlen_reasons`). Soft-capping, ALiBi, FP8, headwise masks, MLA and chunks are not declared:
the generic feature checks refuse them.

Alignment: the flash kernel loads 16-byte vectors (``cp.async``), so rows must start on 16-byte
boundaries (`is_aligned`, the rule flashinfer's loads share); a misaligned buffer is handed over
as one aligned copy by the contract.
"""

from __future__ import annotations

import functools
import inspect
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
    WindowSupport,
    hookimpl,
)

from ._flashinfer_common import SIXTEEN_BIT, host_indptr, is_aligned, nonempty_lengths

API_VERSION = "2.0"
VARLEN_MODULE = "torch.nn.attention.varlen"
KERNEL = f"{VARLEN_MODULE}.varlen_attn"
FIRST_RELEASE = "2.10"
"""The torch release that first ships `VARLEN_MODULE`."""
WINDOW_RELEASE = "2.11"
"""The first torch release whose ``varlen_attn`` takes ``window_size``."""
MAX_HEAD_DIM = 256
HEAD_DIMS = frozenset(range(8, MAX_HEAD_DIM + 1, 8))
"""Head dims torch's flash forward takes: ``mha_varlen_fwd`` (aten/src/ATen/native/transformers/
cuda/flash_attn/flash_api.cpp) checks ``head_size <= 256`` and ``head_size % 8 == 0``; SDPA pads
other sizes before calling it, ``varlen_attn`` does not."""

VarlenFn = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
"""``varlen_attn``: the output, or the output and the log-sum-exp with ``return_aux``."""


@dataclass(frozen=True)
class VarlenSignature:
    """The optional keywords the installed ``varlen_attn`` takes."""

    enable_gqa: bool
    window_size: bool
    return_aux: bool
    is_causal: bool
    """The causal flag of torch 2.10, before ``window_size`` replaced it."""
    scale: bool


def probe_signature(fn: Callable[..., object]) -> VarlenSignature:
    """What ``fn`` (``varlen_attn`` or a stand-in with its parameter list) takes, by name."""
    names = inspect.signature(fn).parameters
    return VarlenSignature(
        enable_gqa="enable_gqa" in names,
        window_size="window_size" in names,
        return_aux="return_aux" in names,
        is_causal="is_causal" in names,
        scale="scale" in names,
    )


def load_varlen() -> VarlenFn:
    """torch's ``varlen_attn``, imported on first use (the import raises where torch lacks it)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.cache
def installed_signature() -> VarlenSignature | None:
    """The installed torch's ``varlen_attn`` signature, probed once per process; ``None``
    when this torch has no `VARLEN_MODULE`. ``installed_signature.cache_clear()`` probes anew."""
    try:
        fn = load_varlen()
    except ImportError:
        return None
    return probe_signature(fn)


def window_size_of(spec: AttentionSpec) -> tuple[int, int]:
    """``varlen_attn``'s ``(left, right)`` for the spec's mask; -1 is an unbounded side.

    `SlidingWindow` keeps key ``j`` for query ``i`` when ``i - j <= left`` and ``j - i <=
    right``, the kernel keeps ``j`` in ``[i - left, i + right]``: the same numbers. A causal
    spec has ``right == 0``. Sides up to ``MAX_WINDOW`` pass as they are: the kernel treats a
    side at least as long as the batch's longest sequence as unbounded.
    """
    window = spec.window
    if window is None:
        return (-1, 0) if spec.causal else (-1, -1)
    return (window.left, 0 if spec.causal else window.right)


def varlen_reasons(
    spec: AttentionSpec, signature: VarlenSignature | None, version: str
) -> list[Reason]:
    """Why this torch (version ``version``, ``varlen_attn`` taking ``signature``; ``None``: no
    `VARLEN_MODULE`) cannot run ``spec``."""
    if signature is None:
        return [
            Reason(
                ReasonCode.LIBRARY_MISSING,
                f"this torch ({version}) has no {VARLEN_MODULE}; needs torch >= {FIRST_RELEASE}",
                "torch",
                version,
                f">= {FIRST_RELEASE}",
            )
        ]
    reasons: list[Reason] = []
    if spec.window is not None and not signature.window_size:
        reasons.append(
            Reason(
                ReasonCode.SLIDING_WINDOW,
                f"varlen_attn of torch {version} takes no window_size",
                "window",
                spec.window.describe(),
                f"None, or torch >= {WINDOW_RELEASE}",
            )
        )
    if spec.attention_sinks and not signature.return_aux:
        reasons.append(
            Reason(
                ReasonCode.SINKS,
                f"varlen_attn of torch {version} returns no log-sum-exp (return_aux), which "
                "sinks rescale the output by",
                "attention_sinks",
                "True",
                "False, or a torch whose varlen_attn takes return_aux",
            )
        )
    if spec.causal and not (signature.window_size or signature.is_causal):
        reasons.append(
            Reason(
                ReasonCode.CAUSAL,
                f"varlen_attn of torch {version} takes neither window_size nor is_causal",
                "causal",
                "True",
                "False",
            )
        )
    default = spec.head_dim**-0.5
    if not signature.scale and spec.scale != default:
        reasons.append(
            Reason(
                ReasonCode.BACKEND_SPECIFIC,
                f"varlen_attn of torch {version} takes no scale; it uses 1/sqrt(head_dim)",
                "softmax_scale",
                repr(spec.scale),
                f"None ({default!r})",
            )
        )
    return reasons


@dataclass(frozen=True)
class VarlenCall:
    """How a bound spec calls the installed ``varlen_attn``, decided once at bind."""

    keywords: tuple[tuple[str, object], ...]
    """The keywords of every call (mask, scale, ``enable_gqa``)."""
    kv_repeat: int
    """Query heads per KV head that ``attend`` expands K and V to (1: nothing to expand)."""
    gqa: str
    """How GQA is served, for the decision record."""


def varlen_call(spec: AttentionSpec, signature: VarlenSignature, version: str) -> VarlenCall:
    """The call for ``spec`` on a torch whose ``varlen_attn`` takes ``signature``."""
    keywords: list[tuple[str, object]] = []
    if signature.window_size:
        keywords.append(("window_size", window_size_of(spec)))
    elif spec.causal:
        keywords.append(("is_causal", True))
    if signature.scale:
        keywords.append(("scale", spec.scale))
    kv_repeat = 1
    if not spec.is_gqa:
        gqa = "none (MHA)"
    elif signature.enable_gqa:
        keywords.append(("enable_gqa", True))
        gqa = "native (enable_gqa=True)"
    else:
        kv_repeat = spec.num_heads // spec.num_kv_heads
        gqa = (
            f"K/V heads repeated {kv_repeat}x per layer (repeat_interleave, a copy of K and V): "
            f"varlen_attn of torch {version} takes no enable_gqa"
        )
    return VarlenCall(tuple(keywords), kv_repeat, gqa)


@dataclass(frozen=True, eq=False)
class VarlenPlan:
    """A batch's call: the kernel, the offsets of its non-empty sequences on the device, the
    longest sequence and the keywords."""

    fn: VarlenFn
    cu_seqlens: torch.Tensor
    """int32 ``[sequences + 1]`` on the batch's device, empty sequences dropped."""
    max_seqlen: int
    keywords: dict[str, Any]
    """Built for this plan and never changed (Any: the kernel's keywords have several types)."""
    kv_repeat: int


def run_varlen(
    views: QKVViews, plan: VarlenPlan, **extra: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One ``varlen_attn`` call on the views (K/V expanded when the plan says so); ``extra``
    adds keywords, e.g. ``return_aux=AuxRequest(lse=True)`` to get the log-sum-exp back too."""
    k, v = views.k, views.v
    if plan.kv_repeat > 1:
        k = k.repeat_interleave(plan.kv_repeat, dim=1)
        v = v.repeat_interleave(plan.kv_repeat, dim=1)
    cu, longest = plan.cu_seqlens, plan.max_seqlen
    return plan.fn(views.q, k, v, cu, cu, longest, longest, **plan.keywords, **extra)


class TorchVarlenBackend(PrefillBackend):
    name = "torch-varlen"
    capabilities = Capabilities(
        platforms=frozenset({"cuda"}),
        dtypes=SIXTEEN_BIT,
        head_dims=HEAD_DIMS,
        min_sm=80,  # mha_varlen_fwd: "FlashAttention only supports Ampere GPUs or newer"
        features=(WindowSupport(), SinkSupport()),
    )

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        if platform.kind != "cuda":
            return []  # refused by the platform check; probing would import torch._dynamo
        return varlen_reasons(spec, installed_signature(), torch.__version__)

    def kernel_variant(self, spec: AttentionSpec, platform: Platform) -> VarlenCall:
        signature = installed_signature()
        if signature is None:  # bind refuses first (varlen_reasons)
            raise BackendFailure(f"{self.name}: this torch has no {VARLEN_MODULE}")
        return varlen_call(spec, signature, torch.__version__)

    def _call(self, platform: Platform) -> VarlenCall:
        variant = self.binding_on(platform).variant
        assert isinstance(variant, VarlenCall)  # made by kernel_variant above
        return variant

    def describe(self, platform: Platform) -> dict[str, str]:
        call = self._call(platform)
        keywords = "; ".join(f"{name}={value!r}" for name, value in call.keywords)
        return {
            **super().describe(platform),
            "kernel": KERNEL,
            "torch": torch.__version__,
            "varlen_keywords": keywords or "none",
            "gqa": call.gqa,
        }

    def accepts_rows(self, rows: torch.Tensor) -> bool:
        return is_aligned(rows)

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> VarlenPlan:
        call = self._call(self.binding.platform)  # the same call on every platform
        lengths = params.input_lengths
        nonempty = nonempty_lengths(lengths)
        if len(nonempty) == len(lengths):
            cu = params.cu_seqlens_q
        else:
            # An empty sequence would break the kernel's single-token GQA path (it reshapes Q
            # to one row per sequence), so the kernel never sees one.
            cu = host_indptr(nonempty).to(params.device)
        return VarlenPlan(
            load_varlen(), cu, params.max_seqlen_q, dict(call.keywords), call.kv_repeat
        )

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, VarlenPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        if views.sinks is not None:
            from torch.nn.attention.varlen import AuxRequest

            returned = run_varlen(views, kernel, return_aux=AuxRequest(lse=True))
            if not isinstance(returned, tuple):
                raise BackendFailure(f"{self.name}: varlen_attn returned no log-sum-exp")
            return rescale_for_sinks(returned[0], returned[1], views.sinks)
        out = run_varlen(views, kernel)
        if not isinstance(out, torch.Tensor):
            raise BackendFailure(f"{self.name}: varlen_attn returned {type(out).__name__}")
        return out


def rescale_for_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out [T, H, D]`` of a softmax whose log-denominator is ``lse`` (float32 ``[H, T]``, the
    flash kernel's varlen layout), with ``exp(sink_h)`` added to every denominator:
    ``out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)``."""
    tokens, heads = out.shape[0], out.shape[1]
    if lse.shape != (heads, tokens):
        raise BackendFailure(
            f"torch-varlen: varlen_attn's log-sum-exp has shape {tuple(lse.shape)}, not "
            f"({heads}, {tokens}) as its flash kernel lays it out"
        )
    share = torch.sigmoid(lse.float() - sinks.float()[:, None]).transpose(0, 1)
    return (out.float() * share[..., None]).to(out.dtype)


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[TorchVarlenBackend])
