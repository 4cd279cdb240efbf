"""The input types of ``forward`` and the checks on each, before anything is written.

``forward`` takes the packed buffer, the tuple ``(packed, None, None)`` or separate
``(q, k, v)``, plus `Fp8Scales` for FP8 input. Every rule those inputs must meet lives here and
fails with one `PackedQKVError` shape, ``"<what was given>; expected <what to give>"`` (`fail`),
so each message says what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeAlias

import torch

from .._values._dtypes import dtype_name
from .._values._errors import PackedQKVError
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec

QKVInput: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]"


def fail(problem: str, expected: str) -> PackedQKVError:
    """The error for an input that breaks a rule: what was given, and what to give instead."""
    return PackedQKVError(f"{problem}; expected {expected}")


@dataclass(frozen=True, eq=False)
class SeparateQKV:
    """The three tensors of a ``(q, k, v)`` input, as given (checked in ``_separate``)."""

    q: object
    k: object
    v: object


@dataclass(frozen=True, eq=False)
class Fp8Scales:
    """Per-tensor dequantisation factors for FP8 packed input: ``real = stored * scale``.

    Each is a positive finite Python float or a one-element float32 tensor on the QKV device.
    Static (calibrated) scales are best given as floats: kernels that take the scale on the
    host (aiter's FP8 varlen kernel) then need no device-to-host read per layer. Tensor values
    are checked here, once, when the scales are built (one read each), never per layer.
    """

    q: torch.Tensor | float
    k: torch.Tensor | float
    v: torch.Tensor | float

    def __post_init__(self) -> None:
        for name, value in (("q", self.q), ("k", self.k), ("v", self.v)):
            _check_scale(name, value)


def _check_scale(name: str, value: object) -> None:
    expected = "a positive finite float or a one-element float32 tensor"
    if isinstance(value, bool) or not isinstance(value, (float, int, torch.Tensor)):
        raise PackedQKVError(f"fp8_scales.{name} is a {type(value).__name__}; expected {expected}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            raise PackedQKVError(
                f"fp8_scales.{name} has {value.numel()} elements of {dtype_name(value.dtype)}; "
                f"expected {expected}"
            )
        number = float(value.detach().to("cpu").reshape(()).item())
    else:
        number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise PackedQKVError(f"fp8_scales.{name} is {number}; expected {expected}")


def _is_empty(t: object) -> bool:
    return t is None or (isinstance(t, torch.Tensor) and t.numel() == 0)


def unpack_tuple(qkv: object) -> object:
    """The packed buffer of ``(packed, None, None)``, a `SeparateQKV` for ``(q, k, v)``; the
    object itself when it is no tuple."""
    if not isinstance(qkv, tuple):
        return qkv
    if len(qkv) != 3:
        raise fail(f"a tuple of {len(qkv)} items", "a tensor, (packed, None, None) or (q, k, v)")
    first, k, v = qkv
    empty = [name for name, t in (("K", k), ("V", v)) if _is_empty(t)]
    if len(empty) == 2:
        return first
    if empty:
        real = "V" if empty == ["K"] else "K"
        raise fail(
            f"the tuple carries a real {real} but no {empty[0]}",
            "(packed, None, None) for the packed buffer, or (q, k, v) with all three real",
        )
    return SeparateQKV(first, k, v)


def check_packed(packed: object, spec: AttentionSpec, params: FMHAParams) -> torch.Tensor:
    """Every geometric rule of the packed buffer; raises `PackedQKVError` naming the fix."""
    if not isinstance(packed, torch.Tensor):
        raise fail(f"a {type(packed).__name__}", "a torch.Tensor")
    width = spec.qkv_width
    layout = f"[rows, (Hq + 2*Hkv) * D] = [rows, {width}]"
    if packed.dim() != 2:
        raise fail(f"a {packed.dim()}-D tensor of shape {tuple(packed.shape)}", f"2-D {layout}")
    if packed.shape[1] != width:
        raise fail(f"last dim {packed.shape[1]}", f"{layout} for the spec's heads")
    if packed.dtype != spec.dtype:
        raise fail(f"dtype {dtype_name(packed.dtype)}", f"the spec's {dtype_name(spec.dtype)}")
    if packed.shape[0] < params.token_q_num:
        raise fail(f"{packed.shape[0]} rows", f"at least token_q_num = {params.token_q_num}")
    if packed.shape[0] != params.rows:
        raise fail(
            f"{packed.shape[0]} rows for a plan of {params.rows} rows ({params.token_q_num} "
            "tokens)",
            "the buffer the plan was made for: FMHAParams.from_lengths(..., padded_rows=rows) "
            "when the buffer carries padding rows, and one plan per batch",
        )
    if packed.shape[1] > 1 and packed.stride(1) != 1:
        raise fail(f"column stride {packed.stride(1)}", "column stride 1 (rows may be strided)")
    if packed.shape[0] > 1 and packed.stride(0) < width:
        raise fail(
            f"row stride {packed.stride(0)}: rows overlap in memory",
            f"row stride >= {width}, one row of memory per token (e.g. qkv.contiguous())",
        )
    if packed.device != params.device:
        raise fail(
            f"QKV on {packed.device} but FMHAParams on {params.device}",
            "both on one device (build FMHAParams with device=qkv.device)",
        )
    return packed


def unpack_packed(qkv: QKVInput, spec: AttentionSpec, params: FMHAParams) -> torch.Tensor:
    """Return the packed 2-D buffer after checking every rule; raises `PackedQKVError`."""
    return check_packed(unpack_tuple(qkv), spec, params)


def check_fp8_scales(spec: AttentionSpec, scales: Fp8Scales | None, device: torch.device) -> None:
    if spec.is_fp8 and scales is None:
        raise fail("FP8 input without fp8_scales", "forward(qkv, plan, fp8_scales=Fp8Scales(...))")
    if not spec.is_fp8 and scales is not None:
        raise fail(f"fp8_scales for {dtype_name(spec.dtype)} input", "fp8_scales=None")
    if scales is None:
        return
    if not isinstance(scales, Fp8Scales):
        raise fail(f"fp8_scales of type {type(scales).__name__}", "an Fp8Scales")
    for name, t in (("q", scales.q), ("k", scales.k), ("v", scales.v)):
        if isinstance(t, torch.Tensor) and t.device != device:
            raise fail(
                f"fp8_scales.{name} on {t.device} for QKV on {device}",
                "per-tensor scales as Python floats or float32 tensors on the QKV device",
            )


def check_sinks(spec: AttentionSpec, sinks: object, device: torch.device) -> None:
    """The per-layer sink logits against the spec: given exactly when the spec has sinks, a
    float ``[Hq]`` tensor on the QKV device. Their values are not read (that would be a host
    sync per layer): a ``-inf`` sink is no sink, as the softmax makes it."""
    if not spec.attention_sinks:
        if sinks is not None:
            raise fail(
                "sinks for a spec without attention sinks",
                "sinks=None, or AttentionSpec(attention_sinks=True) for a layer that has them",
            )
        return
    if sinks is None:
        raise fail(
            "a spec with attention sinks and no sinks",
            f"forward(qkv, plan, sinks=<float tensor [{spec.num_heads}]>), the layer's logits",
        )
    if not isinstance(sinks, torch.Tensor):
        raise fail(f"sinks of type {type(sinks).__name__}", "a float tensor of one logit a head")
    if sinks.shape != (spec.num_heads,) or not sinks.dtype.is_floating_point:
        raise fail(
            f"sinks of shape {tuple(sinks.shape)} and dtype {dtype_name(sinks.dtype)}",
            f"a float tensor of shape ({spec.num_heads},), one logit per query head",
        )
    if sinks.device != device:
        raise fail(f"sinks on {sinks.device} for QKV on {device}", "sinks on the QKV device")


def check_writable(t: torch.Tensor) -> None:
    """``t`` may be rotated in place here: no autograd graph, no inference tensor used outside
    inference mode (torch would refuse the in-place write half-way)."""
    if t.requires_grad and torch.is_grad_enabled():
        raise fail(
            "a QKV buffer that requires grad, while RoPE/logn are applied to it in place",
            "an inference input: call under torch.inference_mode() or torch.no_grad()",
        )
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise fail(
            "a QKV buffer made under torch.inference_mode() used outside it, while RoPE/logn "
            "are applied to it in place (torch forbids that write)",
            "forward() under torch.inference_mode() too, or a buffer made outside it",
        )
