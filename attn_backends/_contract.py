"""The packed-QKV contract: the single place that accepts, checks, rotates and splits QKV.

Every backend's ``forward`` goes through `run_forward`, so the rules are enforced once:

* Accepted input: a 2-D tensor ``[rows, (Hq + 2*Hkv) * D]`` with columns Q|K|V, or a tuple
  ``(packed, K, V)`` whose K and V are both None or empty. ``rows >= token_q_num``; rows past
  ``token_q_num`` are padding and never read into the output.
* Validation happens before anything is written: a rejected input is left untouched.
* RoPE and logn are applied IN PLACE to the Q and K columns of the valid rows (the caller's
  buffer changes), once, before the kernel runs. V and padding rows are never written.
* Q, K, V reach the kernel as views trimmed to the valid rows; they are copied only for a
  backend that declares ``needs_contiguous``.
* Output is ``[token_q_num, Hq * D]`` in the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from ._dtypes import dtype_name
from ._errors import BackendFailure, PackedQKVError, ParamsError
from ._params import FMHAParams
from ._preprocess import (
    SEPARATE_MODES,
    PreprocessMode,
    apply_preprocess,
    platform_of,
    prepare_tables,
    resolve_preprocess,
)
from ._preprocess import preprocess_mode as preprocess_mode  # re-exported: backends import it
from ._rope import PositionTables
from ._spec import AttentionSpec

QKVInput: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]"
InputLayout = Literal["views", "dense-tensors", "dense-packed"]
"""How the kernel wants its input: strided views of the packed rows (no copy), dense Q/K/V
tensors, or the dense packed ``[tokens, (Hq + 2*Hkv) * D]`` rows (copied only if strided)."""


@dataclass(frozen=True, eq=False)
class Fp8Scales:
    """Per-tensor dequantisation factors for FP8 packed input: ``real = stored * scale``.

    Each is a one-element tensor on the QKV device or a Python float. Static (calibrated)
    scales are best given as floats: kernels that take the scale on the host (aiter's FP8
    varlen kernel) then need no device-to-host read per layer.
    """

    q: torch.Tensor | float
    k: torch.Tensor | float
    v: torch.Tensor | float


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """What ``prepare`` computed for one batch; pass it to ``forward`` of every layer."""

    backend: str
    spec: AttentionSpec
    params: FMHAParams
    preprocess: PreprocessMode
    """How RoPE/logn run: not needed, a separate pass (torch, native or flashinfer), or inside
    the kernel; resolved once per spec and device (see ``_preprocess``)."""
    tables: PositionTables | None
    kernel: object
    """Backend-owned plan (a wrapper, host metadata...); opaque to the contract."""


@dataclass(frozen=True, eq=False)
class QKVViews:
    """Q, K, V of the valid rows, ``[tokens, heads, D]`` each, plus the FP8 scales if any.

    ``packed`` is the ``[tokens, (Hq + 2*Hkv) * D]`` rows they were cut from.
    """

    packed: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fp8_scales: Fp8Scales | None


def prepare_plan(
    backend: str, spec: AttentionSpec, params: FMHAParams, fused_rope: bool, kernel: object
) -> PrefillPlan:
    if not isinstance(params, FMHAParams):
        raise ParamsError(f"prepare() takes FMHAParams, got {type(params).__name__}")
    mode = resolve_preprocess(spec, platform_of(params.device), fused_rope).mode
    return PrefillPlan(backend, spec, params, mode, prepare_tables(mode, spec, params), kernel)


def _fail(problem: str, expected: str) -> PackedQKVError:
    return PackedQKVError(f"{problem}; expected {expected}")


def _is_empty(t: object) -> bool:
    return t is None or (isinstance(t, torch.Tensor) and t.numel() == 0)


def unpack_packed(qkv: QKVInput, spec: AttentionSpec, params: FMHAParams) -> torch.Tensor:
    """Return the packed 2-D buffer after checking every rule; raises `PackedQKVError`."""
    if isinstance(qkv, tuple):
        if len(qkv) != 3:
            raise _fail(f"a tuple of {len(qkv)} items", "a tensor or (packed, K, V)")
        packed, k, v = qkv
        real = [name for name, t in (("K", k), ("V", v)) if not _is_empty(t)]
        if real:
            raise _fail(
                f"the tuple carries a real {' and '.join(real)} beside the packed buffer",
                "(packed, None, None) or (packed, empty, empty): this path reads K and V from "
                "the packed columns only",
            )
    else:
        packed = qkv
    if not isinstance(packed, torch.Tensor):
        raise _fail(f"a {type(packed).__name__}", "a torch.Tensor")
    width = spec.qkv_width
    layout = f"[rows, (Hq + 2*Hkv) * D] = [rows, {width}]"
    if packed.dim() != 2:
        raise _fail(f"a {packed.dim()}-D tensor of shape {tuple(packed.shape)}", f"2-D {layout}")
    if packed.shape[1] != width:
        raise _fail(f"last dim {packed.shape[1]}", f"{layout} for the spec's heads")
    if packed.dtype != spec.dtype:
        raise _fail(f"dtype {dtype_name(packed.dtype)}", f"the spec's {dtype_name(spec.dtype)}")
    if packed.shape[0] < params.token_q_num:
        raise _fail(f"{packed.shape[0]} rows", f"at least token_q_num = {params.token_q_num}")
    if packed.shape[1] > 1 and packed.stride(1) != 1:
        raise _fail(f"column stride {packed.stride(1)}", "column stride 1 (rows may be strided)")
    if packed.shape[0] > 1 and packed.stride(0) < width:
        raise _fail(
            f"row stride {packed.stride(0)}: rows overlap in memory",
            f"row stride >= {width}, one row of memory per token (e.g. qkv.contiguous())",
        )
    if packed.device != params.device:
        raise _fail(
            f"QKV on {packed.device} but FMHAParams on {params.device}",
            "both on one device (build FMHAParams with device=qkv.device)",
        )
    return packed


def check_fp8_scales(spec: AttentionSpec, scales: Fp8Scales | None, device: torch.device) -> None:
    if spec.is_fp8 and scales is None:
        raise _fail("FP8 input without fp8_scales", "forward(qkv, plan, fp8_scales=Fp8Scales(...))")
    if not spec.is_fp8 and scales is not None:
        raise _fail(f"fp8_scales for {dtype_name(spec.dtype)} input", "fp8_scales=None")
    if scales is not None:
        for name, t in (("q", scales.q), ("k", scales.k), ("v", scales.v)):
            if isinstance(t, float) and math.isfinite(t) and t > 0:
                continue
            if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.device != device:
                raise _fail(
                    f"fp8_scales.{name} is neither a positive float nor a one-element tensor "
                    f"on {device}",
                    "per-tensor scales as Python floats or float32 tensors on the QKV device",
                )


def split_views(packed: torch.Tensor, spec: AttentionSpec, tokens: int) -> tuple[torch.Tensor, ...]:
    """Q, K, V as ``[tokens, heads, D]`` views of the first ``tokens`` rows; nothing is copied."""
    rows = packed[:tokens]
    q_end = spec.q_width
    k_end = q_end + spec.kv_width
    return (
        rows[:, :q_end].view(tokens, spec.num_heads, spec.head_dim),
        rows[:, q_end:k_end].view(tokens, spec.num_kv_heads, spec.head_dim),
        rows[:, k_end:].view(tokens, spec.num_kv_heads, spec.head_dim),
    )


def run_forward(
    backend: str,
    spec: AttentionSpec,
    qkv: QKVInput,
    plan: PrefillPlan,
    fp8_scales: Fp8Scales | None,
    layout: InputLayout,
    attend: Callable[[QKVViews, PrefillPlan], torch.Tensor],
) -> torch.Tensor:
    """Validate, pre-process in place, split, run ``attend`` and shape the output."""
    if not isinstance(plan, PrefillPlan) or plan.backend != backend or plan.spec != spec:
        raise ParamsError(
            f"the plan was not made by {backend}.prepare() for this spec; call prepare() on the "
            "same backend that runs forward()"
        )
    params = plan.params
    packed = unpack_packed(qkv, spec, params)
    check_fp8_scales(spec, fp8_scales, packed.device)
    tokens = params.token_q_num
    if plan.preprocess in SEPARATE_MODES:
        if packed.requires_grad and torch.is_grad_enabled():
            raise _fail(
                "a QKV buffer that requires grad, while RoPE/logn are applied to it in place",
                "an inference input: call under torch.inference_mode() or torch.no_grad()",
            )
        apply_preprocess(plan.preprocess, packed, spec, params, plan.tables)
    rows = packed[:tokens]
    if layout == "dense-packed":
        rows = rows.contiguous()
    q, k, v = split_views(rows, spec, tokens)
    if layout == "dense-tensors":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = attend(QKVViews(rows, q, k, v, fp8_scales), plan)
    expected = (tokens, spec.num_heads, spec.head_dim)
    if tuple(out.shape) != expected or out.dtype != spec.output_dtype:
        raise BackendFailure(
            f"backend {backend} returned {tuple(out.shape)} {dtype_name(out.dtype)}; the contract "
            f"needs {expected} {dtype_name(spec.output_dtype)}"
        )
    return out.reshape(tokens, spec.q_width)
