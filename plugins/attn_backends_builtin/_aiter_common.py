"""What the two aiter backends share: the lazy import, the per-batch plan and the one call path.

Both backends hand aiter Q, K and V as views of the packed rows, trimmed to ``token_q_num`` and
``token_kv_num``: aiter reads each tensor's token and head strides and only needs a unit stride
on the last dim (``maybe_contiguous`` in aiter/ops/mha.py; ``TORCH_CHECK(q.stride(-1) == 1)``
in both C++ entry points). They pass the batch's int32 ``cu_seqlens`` (already on Q's device in
`FMHAParams`), the spec's causal flag and softmax scale, and get ``[token_q_num, Hq, D]`` back.
Every argument goes by keyword, as the installed aiter's parameter lists say (`_aiter_binding`).

Checked against the source of every amd-aiter tag from 0.1.7 to 0.1.20.post1 and main of
2026-08-22; not run on ROCm hardware.
"""

from __future__ import annotations

import functools
import importlib
import types
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from attn_backends import AttentionSpec, FMHAParams, Platform, PrefillPlan
from attn_backends.errors import BackendFailure, ParamsError
from attn_backends.plugin import PrefillBackend, QKVViews

from ._aiter_binding import (
    AITER_RELEASES_CHECKED,
    BATCH_PARAMETERS,
    BF16_ROUNDING_RTNA,
    DESCALES,
    FP8_ENTRY,
    SETTINGS,
    EntryBinding,
    EntryPoint,
    binding_for,
    last_binding,
)
from ._aiter_features import feature_settings
from ._aiter_signature import installed_version

NATIVE_FP8: dict[str, torch.dtype] = {
    "gfx942": torch.float8_e4m3fnuz,
    "gfx950": torch.float8_e4m3fn,
}
"""The FP8 dtype aiter builds its FP8 kernels for, per arch (``aiter.dtypes.fp8``,
aiter/utility/dtypes.py); other archs have none (``torch.uint8``)."""


def import_aiter() -> types.ModuleType:
    """Import aiter on first use; any failure becomes a `BackendFailure` that says why.

    ``import aiter`` raises ``RuntimeError`` (not ImportError) on a machine without ROCm, from
    its JIT setup (aiter/jit/utils/cpp_extension.py), so every exception is caught.
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

    binding: EntryBinding
    kernel: Callable[..., Any]
    """The aiter function; ``Any`` because aiter ships no type information."""
    softmax_scale: float
    settings: dict[str, object]
    """Keyword arguments fixed for the spec: the scale (unless folded), the causal flag, the
    `SETTINGS` this entry point has and the spec's window, soft-cap and ALiBi slopes on the
    batch's device. Q/K/V and the batch offsets are added per forward."""


def _check_cu_seqlens(params: FMHAParams) -> None:
    """aiter's C++ checks (int32, contiguous, on Q's device) turned into a named error up front."""
    for name, cu in (("cu_seqlens_q", params.cu_seqlens_q), ("cu_seqlens_k", params.cu_seqlens_k)):
        if cu.dtype != torch.int32 or not cu.is_contiguous() or cu.device != params.device:
            raise ParamsError(
                f"{name} must be a contiguous int32 tensor on {params.device} for aiter, got "
                f"{cu.dtype} on {cu.device}; build FMHAParams with FMHAParams.from_lengths"
            )


def spec_settings(binding: EntryBinding, softmax_scale: float, causal: bool) -> dict[str, object]:
    """The keywords fixed for a spec: the folding FP8 call gets its scale per forward."""
    folds = binding.entry == FP8_ENTRY and not binding.descales
    values: dict[str, object] = {
        **SETTINGS,
        "softmax_scale": softmax_scale,
        "is_causal": causal,
        "causal": causal,
    }
    per_forward = {*BATCH_PARAMETERS, *DESCALES, *(("softmax_scale",) if folds else ())}
    return {name: values[name] for name in binding.keywords if name not in per_forward}


def make_plan(entry: EntryPoint, spec: AttentionSpec, params: FMHAParams) -> AiterPlan:
    """Import aiter, bind ``entry`` (once per function), check the offsets, fix the keywords."""
    aiter = import_aiter()
    try:
        kernel = cast(Callable[..., Any], getattr(aiter, entry))
    except AttributeError as exc:
        raise BackendFailure(
            f"aiter {installed_version()} has no {entry}; the aiter backends know amd-aiter "
            f"{AITER_RELEASES_CHECKED}"
        ) from exc
    binding = binding_for(entry, kernel)
    _check_cu_seqlens(params)
    scale = float(spec.scale)
    settings = spec_settings(binding, scale, bool(spec.causal))
    features = feature_settings(spec, params.device)
    missing = sorted(set(features) - set(settings))
    if missing:  # declared capabilities keep such specs away; this guards a wrong declaration
        raise BackendFailure(
            f"aiter {binding.aiter_version}'s {entry} takes no {', '.join(missing)}, which the "
            "spec's window, soft-cap or ALiBi needs"
        )
    return AiterPlan(binding, kernel, scale, {**settings, **features})


def descale_tensor(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A per-tensor scale as aiter reads it: through a float pointer, so a float32 ``[1]``
    tensor on Q's device (``per_tensor_quant``'s scale, aiter/ops/quant.py).

    A float32 tensor goes as a view; another dtype is cast on the device. A Python float
    becomes a device constant made once per value and device, so no forward syncs.
    """
    if isinstance(scale, torch.Tensor):
        flat = scale.reshape(1)
        return flat if flat.dtype == torch.float32 else flat.to(torch.float32)
    return _device_constant(float(scale), device)


@functools.lru_cache(maxsize=1024)
def _device_constant(value: float, device: torch.device) -> torch.Tensor:
    """Read-only once made: aiter only reads a descale, and nothing else sees it."""
    return torch.full((1,), value, dtype=torch.float32, device=device)


class AiterVarlenBackend(PrefillBackend):
    """Base of ``aiter-asm`` and ``aiter-nonasm``: subclasses pick the entry point and declare."""

    @abstractmethod
    def entry_point(self, spec: AttentionSpec) -> EntryPoint:
        """The aiter function this backend calls for ``spec``."""

    def kernel_variant(self, spec: AttentionSpec, platform: Platform) -> EntryPoint:
        """The aiter function for ``spec``, decided once at bind."""
        return self.entry_point(spec)

    def _entry(self) -> EntryPoint:
        # kernel_variant above made the binding's variant: an EntryPoint.
        return cast(EntryPoint, self.binding.variant)

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> AiterPlan:
        return make_plan(self._entry(), spec, params)

    def describe(self, platform: Platform) -> dict[str, str]:
        details = super().describe(platform)
        entry = self._entry()
        binding = last_binding(entry)
        details["aiter_entry"] = entry
        details["aiter_signature"] = (
            binding.describe()
            if binding is not None
            else "read from the installed aiter at the first prepare"
        )
        if entry == "fmha_v3_varlen_fwd" and platform.arch == "gfx942":
            details["bf16_rounding"] = (
                f"how_v3_bf16_cvt={BF16_ROUNDING_RTNA} (round to nearest, ties away)"
            )
        if entry == FP8_ENTRY:
            details["fp8_descale"] = _fp8_record(binding)
        return details

    def attend(self, views: QKVViews, plan: object) -> torch.Tensor:
        """One aiter launch on the views (the contract trims them to the valid tokens).

        ``plan`` is typed wide on purpose: the aiter backends have no graph mode, so anything
        but a `PrefillPlan` from their own ``prepare`` is refused here.
        """
        if not isinstance(plan, PrefillPlan) or not isinstance(plan.kernel, AiterPlan):
            raise BackendFailure(
                f"aiter backends run only plans made by their prepare(), got {type(plan).__name__}"
            )
        p = plan.kernel
        b = plan.params
        # All by keyword; aiter type-checks with isinstance: the lengths go as Python ints.
        batch = {
            "q": views.q,
            "k": views.k,
            "v": views.v,
            "cu_seqlens_q": b.cu_seqlens_q,
            "cu_seqlens_k": b.cu_seqlens_k,
            "max_seqlen_q": int(b.max_seqlen_q),
            "max_seqlen_k": int(b.max_seqlen_k),
        }
        if p.binding.entry != FP8_ENTRY:
            # Both ops return (out, softmax_lse, dropout_randval, rng_state).
            return cast(torch.Tensor, p.kernel(**batch, **p.settings)[0])
        scales = views.fp8_scales
        if scales is None:
            raise BackendFailure("FP8 input reached aiter without fp8_scales")
        if p.binding.descales:
            device = views.q.device
            out = p.kernel(
                **batch,
                q_descale=descale_tensor(scales.q, device),
                k_descale=descale_tensor(scales.k, device),
                v_descale=descale_tensor(scales.v, device),
                **p.settings,
            )
            return cast(torch.Tensor, out)
        # 0.1.7 to 0.1.7.post2: the FP8 kernel runs with scale_p = scale_o = 1 and takes no
        # descales (py_itfs_ck/mha_varlen_fwd_kernels.cu, "TODO - support descale"):
        # dequantising Q and K is the same as scaling the logits, and V a scale of the output.
        # Scales given as device tensors are read back (a sync) on every call.
        scale = p.softmax_scale * float(scales.q) * float(scales.k)
        out = p.kernel(**batch, softmax_scale=scale, **p.settings)
        return cast(torch.Tensor, out).mul_(scales.v)


def _fp8_record(binding: EntryBinding | None) -> str:
    if binding is None:
        return (
            "decided at the first prepare: aiter 0.1.7.post3 and later take q/k/v descale "
            "tensors; older releases get the q and k scales folded into softmax_scale and the "
            "v scale applied to the output"
        )
    if binding.descales:
        return (
            "q/k/v_descale: float32 [1] tensors on Q's device (float32 scale tensors go as "
            "views; Python floats become device constants made once per value)"
        )
    return (
        "q and k scales folded into softmax_scale (Python-float scales cost nothing, "
        "device-tensor scales are read to the host each forward); v scale applied to the output"
    )
