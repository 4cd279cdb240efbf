"""What the two aiter backends share: the lazy import, the per-batch plan and the one call path.

Both backends hand aiter Q, K and V as views of the packed rows, trimmed to ``token_q_num`` and
``token_kv_num``: aiter reads each tensor's token and head strides and only needs a unit stride
on the last dim (``maybe_contiguous``, aiter/ops/mha.py:1164; ``TORCH_CHECK(q.stride(-1) == 1)``
in both C++ entry points). They pass the batch's int32 ``cu_seqlens`` (already on Q's device in
`FMHAParams`), the spec's causal flag and softmax scale, and get ``[token_q_num, Hq, D]`` back.
They differ only in the aiter function they call (`EntryPoint`) and in what they declare.

Checked against the source of amd-aiter 0.1.7.post2.dev18; not run on ROCm hardware here.
"""

from __future__ import annotations

import importlib
import types
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from attn_backends import (
    AttentionSpec,
    BackendFailure,
    FMHAParams,
    ParamsError,
    Platform,
    PrefillBackend,
    PrefillPlan,
    QKVViews,
)

AITER_VERSION_CHECKED = "0.1.7.post2.dev18"
"""The amd-aiter release whose Python and C++ source these backends were written against."""

EntryPoint = Literal["fmha_v3_varlen_fwd", "mha_varlen_fwd", "flash_attn_varlen_fp8_pertensor_func"]
"""aiter functions the backends call.

* ``fmha_v3_varlen_fwd``: the hand-written ASM kernels (aiter/ops/mha.py:546), the function
  ``flash_attn_varlen_func`` itself calls when its ASM test passes (mha.py:1903-1943).
* ``mha_varlen_fwd``: the CK kernels (mha.py:455), what ``flash_attn_varlen_func`` calls
  otherwise (mha.py:1945-1990). ``flash_attn_varlen_func`` has no switch to skip ASM for bf16
  d128, so the non-ASM backend calls this op directly.
* ``flash_attn_varlen_fp8_pertensor_func``: the FP8 varlen entry point (mha.py:2730); it has no
  descale arguments, see `AiterVarlenBackend.attend`.
"""

NATIVE_FP8: dict[str, torch.dtype] = {
    "gfx942": torch.float8_e4m3fnuz,
    "gfx950": torch.float8_e4m3fn,
}
"""The FP8 dtype aiter builds its FP8 kernels for, per arch (``aiter.dtypes.fp8``,
aiter/utility/dtypes.py:7-21); other archs have none (``torch.uint8``)."""

BF16_ROUNDING_RTNA = 1
"""``how_v3_bf16_cvt``: bf16 output rounding of the gfx942 ASM kernels (0 RTNE, 1 RTNA, 2 RTZ);
1 is what ``flash_attn_varlen_func`` passes by default. gfx950 ignores it."""


def import_aiter() -> types.ModuleType:
    """Import aiter on first use; any failure becomes a `BackendFailure` that says why.

    ``import aiter`` raises ``RuntimeError`` (not ImportError) on a machine without ROCm, from
    its JIT setup (aiter/jit/utils/cpp_extension.py:89-94), so every exception is caught.
    """
    try:
        return importlib.import_module("aiter")
    except Exception as exc:
        raise BackendFailure(
            f"cannot import aiter ({type(exc).__name__}: {exc}); the aiter backends need the "
            "amd-aiter package on a ROCm machine"
        ) from exc


def local_cu_count(platform: Platform) -> int | None:
    """Compute units of the current ROCm device when ``platform`` is this machine, else None.

    None for a dry run (``rocm:gfx942``) and off ROCm, so only a live selection is checked.
    """
    if platform.kind != "rocm" or platform.assumed:
        return None
    if torch.version.hip is None or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(props.multi_processor_count)


@dataclass(frozen=True, eq=False)
class AiterPlan:
    """Everything one batch needs, resolved in ``prepare`` so ``forward`` only launches."""

    entry: EntryPoint
    kernel: Callable[..., Any]
    """The aiter function; ``Any`` because aiter ships no type information."""
    softmax_scale: float
    options: dict[str, object]
    """Keyword arguments after the first seven, fixed for the batch (see `kernel_options`)."""


def _check_cu_seqlens(params: FMHAParams) -> None:
    """aiter's C++ checks (int32, contiguous, on Q's device) turned into a named error up front."""
    for name, cu in (("cu_seqlens_q", params.cu_seqlens_q), ("cu_seqlens_k", params.cu_seqlens_k)):
        if cu.dtype != torch.int32 or not cu.is_contiguous() or cu.device != params.device:
            raise ParamsError(
                f"{name} must be a contiguous int32 tensor on {params.device} for aiter, got "
                f"{cu.dtype} on {cu.device}; build FMHAParams with FMHAParams.from_lengths"
            )


def kernel_options(entry: EntryPoint, softmax_scale: float, causal: bool) -> dict[str, object]:
    """Everything after ``max_seqlen_k``, by keyword: aiter's eighth positional parameter is
    ``min_seqlen_q``, not ``dropout_p`` as in upstream flash-attn.

    aiter type-checks op arguments with isinstance (aiter/jit/core.py:813-890), so the scale
    is a Python float and the flag a bool. The FP8 entry point gets its scale per forward.
    """
    if entry == "flash_attn_varlen_fp8_pertensor_func":
        return {"causal": causal}
    options: dict[str, object] = {
        "min_seqlen_q": 0,
        "dropout_p": 0.0,
        "softmax_scale": softmax_scale,
        "logits_soft_cap": 0.0,
        "zero_tensors": False,
        "is_causal": causal,
        "window_size_left": -1,
        "window_size_right": -1,
        "return_softmax_lse": False,
        "return_dropout_randval": False,
    }
    if entry == "fmha_v3_varlen_fwd":
        options["how_v3_bf16_cvt"] = BF16_ROUNDING_RTNA
    return options


def make_plan(entry: EntryPoint, spec: AttentionSpec, params: FMHAParams) -> AiterPlan:
    """Import aiter, look up ``entry``, check the offsets and fix the per-batch arguments."""
    aiter = import_aiter()
    try:
        kernel = cast(Callable[..., Any], getattr(aiter, entry))
    except AttributeError as exc:
        raise BackendFailure(
            f"this aiter has no {entry}; the backends were written against amd-aiter "
            f"{AITER_VERSION_CHECKED}"
        ) from exc
    _check_cu_seqlens(params)
    scale, causal = float(spec.scale), bool(spec.causal)
    return AiterPlan(entry, kernel, scale, kernel_options(entry, scale, causal))


class AiterVarlenBackend(PrefillBackend):
    """Base of ``aiter-asm`` and ``aiter-nonasm``: subclasses pick the entry point and declare."""

    @abstractmethod
    def entry_point(self, spec: AttentionSpec) -> EntryPoint:
        """The aiter function this backend calls for ``spec``."""

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> AiterPlan:
        return make_plan(self.entry_point(spec), spec, params)

    def describe(self, platform: Platform) -> dict[str, str]:
        details = super().describe(platform)
        entry = self.entry_point(self.bound_spec())
        details["aiter_entry"] = entry
        if entry == "fmha_v3_varlen_fwd" and platform.arch == "gfx942":
            details["bf16_rounding"] = (
                f"how_v3_bf16_cvt={BF16_ROUNDING_RTNA} (round to nearest, ties away)"
            )
        if entry == "flash_attn_varlen_fp8_pertensor_func":
            details["fp8_descale"] = (
                "q and k scales folded into softmax_scale (Python-float scales cost nothing, "
                "device-tensor scales are read to the host each forward); v scale applied to "
                "the output"
            )
        return details

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        """One aiter launch on the views (the contract trims them to the valid tokens)."""
        p = cast(AiterPlan, plan.kernel)
        b = plan.params
        # aiter type-checks with isinstance: the lengths go over as Python ints.
        lengths = (int(b.max_seqlen_q), int(b.max_seqlen_k))
        head = (views.q, views.k, views.v, b.cu_seqlens_q, b.cu_seqlens_k, *lengths)
        if p.entry == "flash_attn_varlen_fp8_pertensor_func":
            scales = views.fp8_scales
            if scales is None:
                raise BackendFailure("FP8 input reached aiter without fp8_scales")
            # The FP8 kernel runs with scale_p = scale_o = 1 and takes no descales (aiter
            # py_itfs_ck/mha_varlen_fwd_kernels.cu:140-142, "TODO - support descale" :366):
            # dequantising Q and K is the same as scaling the logits, and V a scale of the output.
            # The scale is a host float: scales given as Python floats cost nothing here,
            # scales given as device tensors are read back (a sync) on every call.
            scale = p.softmax_scale * float(scales.q) * float(scales.k)
            out = p.kernel(*head, **p.options, softmax_scale=scale)
            return cast(torch.Tensor, out).mul_(scales.v)
        # Both ops return (out, softmax_lse, dropout_randval, rng_state).
        return cast(torch.Tensor, p.kernel(*head, **p.options)[0])
