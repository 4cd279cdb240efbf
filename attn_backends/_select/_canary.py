"""The strict start-up canary: a few short sequences through a backend, checked against the
float64 reference before the engine trusts it.

A backend can declare a capability it does not deliver (a kernel built for another arch, a
library with a regression). The canary runs the request's own spec on the target device with
private random inputs, so a wrong backend is caught at ``select`` time instead of as quietly
wrong embeddings. Nothing shared is touched: the buffers are the canary's own, the random
numbers come from a private generator, and the backend instance is bound for the canary only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .._backend._protocol import NoCachePrefill
from .._backend._reference import TOLERANCE, reference_attention, relative_error
from .._path._contract import Fp8Scales, PrefillPlan
from .._path._untouched import unexpected_writes
from .._values._dtypes import dtype_name
from .._values._errors import PlatformError
from .._values._params import FMHAParams
from .._values._platform import indexed
from .._values._spec import AttentionSpec

CANARY_LENGTHS: tuple[int, ...] = (5, 1, 12, 0, 3)
"""Varlen, a single-token and a zero-length sequence: cheap, yet enough to expose a kernel
that ignores ``cu_seqlens`` or the mask."""
CANARY_PADDING_ROWS = 3
"""Padding rows after the valid tokens; filled with a large value a wrong kernel would show."""
_PAD_VALUE = 1.0e4

CanaryStatus = Literal["off", "skipped", "passed", "failed"]


@dataclass(frozen=True)
class CanaryResult:
    """What the strict canary found; ``detail`` is one line ready for ``explain``."""

    status: CanaryStatus
    detail: str
    relative_error: float | None = None
    tolerance: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "status": self.status,
            "detail": self.detail,
            "relative_error": self.relative_error,
            "tolerance": self.tolerance,
        }


CANARY_OFF = CanaryResult("off", "strict mode off: no canary run")


def _describe_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is not None:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


def _inputs(
    spec: AttentionSpec, device: torch.device, seed: int
) -> tuple[FMHAParams, torch.Tensor, Fp8Scales | None]:
    tokens = sum(CANARY_LENGTHS)
    params = FMHAParams.from_lengths(
        CANARY_LENGTHS, device=device, padded_rows=tokens + CANARY_PADDING_ROWS
    )
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(params.rows, spec.qkv_width, generator=gen, dtype=torch.float32)
    values[tokens:] = _PAD_VALUE
    try:
        qkv = values.to(device=device, dtype=spec.dtype)
        scales = None
        if spec.is_fp8:
            one = torch.ones((), dtype=torch.float32, device=device)
            scales = Fp8Scales(one, one, one)
    except (RuntimeError, AssertionError) as exc:
        raise PlatformError(f"cannot run the strict canary on {device}: {exc}") from None
    return params, qkv, scales


def run_canary(
    backend: NoCachePrefill, spec: AttentionSpec, device: torch.device | str, *, seed: int = 0
) -> CanaryResult:
    """Run ``backend`` (bound to ``spec``, used for nothing else) once and judge the numbers.

    Any exception from the backend, a wrong output shape or dtype, a relative error at or above
    `TOLERANCE`, or a write outside what the contract allows (padding rows, V, Q/K columns
    no in-place pass touches) makes the result ``failed``. Raises
    `PlatformError` only when the device itself cannot hold the inputs.
    """
    dev = indexed(device)  # a tensor on "cuda" reports "cuda:0"
    params, qkv, scales = _inputs(spec, dev, seed)
    pristine = qkv.clone()
    tokens = params.token_q_num
    where = f"on {dev} ({dtype_name(spec.dtype)}, lengths {list(CANARY_LENGTHS)})"
    try:
        plan = backend.prepare(params)
        out = backend.forward(qkv, plan, fp8_scales=scales)
        rotates = isinstance(plan, PrefillPlan) and plan.rotates
    except Exception as exc:
        return CanaryResult("failed", f"canary raised {where}: {_describe_error(exc)}")
    expected = (tokens, spec.q_width)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return CanaryResult("failed", f"canary output {where} is {got}, expected {expected}")
    if out.dtype != spec.output_dtype or out.device != dev:
        return CanaryResult(
            "failed",
            f"canary output {where} is {dtype_name(out.dtype)} on {out.device}, expected "
            f"{dtype_name(spec.output_dtype)} on {dev}",
        )
    tol = TOLERANCE[spec.dtype]
    err = relative_error(out, reference_attention(pristine, spec, params, fp8_scales=scales))
    if not err < tol:
        return CanaryResult(
            "failed",
            f"canary output {where} differs from the float64 reference: relative error "
            f"{err:.3g} >= tolerance {tol:g}",
            err,
            tol,
        )
    written = unexpected_writes(pristine, qkv, spec, tokens, rotates)
    if written is not None:
        return CanaryResult("failed", f"canary {where}: {written}")
    return CanaryResult(
        "passed", f"canary passed {where}: relative error {err:.3g} < {tol:g}", err, tol
    )
