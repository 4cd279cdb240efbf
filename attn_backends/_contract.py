"""The packed-QKV contract: the single place that accepts, checks, rotates and splits QKV.

Every backend's ``forward`` goes through `run_forward`, so the rules are enforced once:

* Accepted input: a 2-D tensor ``[rows, (Hq + 2*Hkv) * D]`` with columns Q|K|V, or a tuple
  ``(packed, K, V)`` whose K and V are both None or empty. ``rows`` equals the plan's
  ``params.rows`` (``token_q_num`` plus any CUDA-graph padding); padding rows never reach the
  output.
* Every check that can fail runs before anything is written: a rejected input is untouched.
  An error that can still come later (inside the kernel) says whether, and where, the input
  was already modified (`AttentionBackendError.modified`).
* RoPE and logn are applied IN PLACE to the Q and K columns of the valid rows (the caller's
  buffer changes), once, before the kernel runs. V and padding rows are never written.
* Q, K, V reach the kernel as views trimmed to the valid rows; they are copied only for a
  backend that declares it needs dense memory, or whose alignment rule the buffer breaks.
* Output is ``[token_q_num, Hq * D]`` in the model dtype.

The checks that depend only on the buffer's geometry (shape, strides, dtype, device, address)
run once per plan and buffer signature (`BufferMemo`): a per-layer call on a buffer seen before
pays for one dict lookup, a buffer not seen before is checked in full.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch

from ._dtypes import dtype_name
from ._errors import AttentionBackendError, BackendFailure, PackedQKVError, ParamsError
from ._graph import GraphPlan
from ._params import FMHAParams
from ._preprocess import (
    PreprocessMode,
    apply_graph_preprocess,
    apply_preprocess,
    is_separate,
    platform_of,
    prepare_tables,
    resolve_preprocess,
)
from ._preprocess import preprocess_mode as preprocess_mode  # re-exported: backends import it
from ._rope import PositionTables
from ._separate import (
    SeparateQKV,
    check_separate,
    packed_of,
    rotate_separate,
    separate_note,
)
from ._spec import AttentionSpec

QKVInput: TypeAlias = "torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]"
InputLayout = Literal["views", "dense-tensors", "dense-packed"]
"""How the kernel wants its input: strided views of the packed rows (no copy), dense Q/K/V
tensors, or the dense packed ``[tokens, (Hq + 2*Hkv) * D]`` rows (copied only if strided)."""


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


class BufferMemo:
    """Buffer signatures a plan has checked, and what the checks concluded.

    An engine's layer loop hands ``forward`` a new QKV tensor per layer, and the caching
    allocator serves those from a few blocks in turn, so the memo keeps up to `MEMO_SLOTS`
    signatures (the oldest is dropped first). An entry holds integers, sizes and a
    `Geometry`, never a tensor: it keeps no memory alive. Each lookup and store is one dict
    operation, so concurrent forwards on one plan never see a signature paired with another
    buffer's geometry; at worst a racing store is checked again.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple[object, ...], Geometry] = {}

    def get(self, signature: tuple[object, ...]) -> Geometry | None:
        return self._entries.get(signature)

    def put(self, signature: tuple[object, ...], geometry: Geometry) -> None:
        entries = self._entries
        entries[signature] = geometry
        if len(entries) > MEMO_SLOTS:
            # Another thread may change the dict meanwhile: then the next store trims it.
            with contextlib.suppress(RuntimeError, StopIteration):
                entries.pop(next(iter(entries)), None)

    def __len__(self) -> int:
        return len(self._entries)


MEMO_SLOTS = 32
"""Signatures remembered per plan: well above the handful of buffers a layer loop rotates
through; a miss costs one full check, never correctness."""


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """What ``prepare`` computed for one batch; pass it to ``forward`` of every layer.

    A plan is a value: it owns everything its ``forward`` reads, so any number of plans may be
    alive at once and used in any order.
    """

    backend: str
    spec: AttentionSpec
    params: FMHAParams
    preprocess: PreprocessMode
    """How RoPE/logn run: not needed, a separate pass (torch, native or flashinfer), or inside
    the kernel; resolved once per spec and device (see ``_preprocess``)."""
    tables: PositionTables | None
    kernel: object
    """Backend-owned plan (a wrapper, host metadata...); opaque to the contract."""
    memo: BufferMemo = field(default_factory=BufferMemo, repr=False, compare=False)
    """Checks already passed for the last buffer signature (see `BufferMemo`)."""
    rotates: bool = field(init=False, repr=False, compare=False)
    """``preprocess`` is a separate pass that writes the caller's buffer."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rotates", is_separate(self.preprocess))

    @property
    def output_rows(self) -> int:
        """Rows of ``forward``'s output: the batch's valid tokens."""
        return self.params.token_q_num


class QKVViews:
    """Q, K, V of the valid rows, ``[tokens, heads, D]`` each, plus the FP8 scales if any.

    ``packed`` is the ``[tokens, (Hq + 2*Hkv) * D]`` rows they were cut from, trimmed to the
    valid tokens when first read (kernels on Q/K/V views never pay for it). With separate
    Q/K/V input it is built, a copy, only if a kernel reads it.
    """

    __slots__ = ("_packed", "_rows", "fp8_scales", "k", "q", "v")

    def __init__(
        self,
        packed: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fp8_scales: Fp8Scales | None = None,
    ) -> None:
        self._packed = packed
        self._rows: torch.Tensor | None = None
        self.q = q
        self.k = k
        self.v = v
        self.fp8_scales = fp8_scales

    @property
    def packed(self) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            tokens = self.q.shape[0]
            source = self._packed
            if source is None:  # separate Q/K/V: packed rows exist only as a copy
                rows = packed_of(self.q, self.k, self.v)
            else:
                rows = source if source.shape[0] == tokens else source[:tokens]
            self._rows = rows
        return rows

    def __iter__(self) -> Iterator[object]:
        """``packed, q, k, v, fp8_scales``, as the tuple this class once was."""
        return iter((self.packed, self.q, self.k, self.v, self.fp8_scales))


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


def unpack_tuple(qkv: object) -> object:
    """The packed buffer of ``(packed, None, None)``, a `SeparateQKV` for ``(q, k, v)``; the
    object itself when it is no tuple."""
    if not isinstance(qkv, tuple):
        return qkv
    if len(qkv) != 3:
        raise _fail(f"a tuple of {len(qkv)} items", "a tensor, (packed, None, None) or (q, k, v)")
    first, k, v = qkv
    empty = [name for name, t in (("K", k), ("V", v)) if _is_empty(t)]
    if len(empty) == 2:
        return first
    if empty:
        real = "V" if empty == ["K"] else "K"
        raise _fail(
            f"the tuple carries a real {real} but no {empty[0]}",
            "(packed, None, None) for the packed buffer, or (q, k, v) with all three real",
        )
    return SeparateQKV(first, k, v)


def check_packed(packed: object, spec: AttentionSpec, params: FMHAParams) -> torch.Tensor:
    """Every geometric rule of the packed buffer; raises `PackedQKVError` naming the fix."""
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
    if packed.shape[0] != params.rows:
        raise _fail(
            f"{packed.shape[0]} rows for a plan of {params.rows} rows ({params.token_q_num} "
            "tokens)",
            "the buffer the plan was made for: FMHAParams.from_lengths(..., padded_rows=rows) "
            "when the buffer carries padding rows, and one plan per batch",
        )
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


def unpack_packed(qkv: QKVInput, spec: AttentionSpec, params: FMHAParams) -> torch.Tensor:
    """Return the packed 2-D buffer after checking every rule; raises `PackedQKVError`."""
    return check_packed(unpack_tuple(qkv), spec, params)


def check_fp8_scales(spec: AttentionSpec, scales: Fp8Scales | None, device: torch.device) -> None:
    if spec.is_fp8 and scales is None:
        raise _fail("FP8 input without fp8_scales", "forward(qkv, plan, fp8_scales=Fp8Scales(...))")
    if not spec.is_fp8 and scales is not None:
        raise _fail(f"fp8_scales for {dtype_name(spec.dtype)} input", "fp8_scales=None")
    if scales is None:
        return
    if not isinstance(scales, Fp8Scales):
        raise _fail(f"fp8_scales of type {type(scales).__name__}", "an Fp8Scales")
    for name, t in (("q", scales.q), ("k", scales.k), ("v", scales.v)):
        if isinstance(t, torch.Tensor) and t.device != device:
            raise _fail(
                f"fp8_scales.{name} on {t.device} for QKV on {device}",
                "per-tensor scales as Python floats or float32 tensors on the QKV device",
            )


def check_writable(packed: torch.Tensor) -> None:
    """The buffer may be rotated in place here: no autograd graph, no inference tensor used
    outside inference mode (torch would refuse the in-place write half-way)."""
    if packed.requires_grad and torch.is_grad_enabled():
        raise _fail(
            "a QKV buffer that requires grad, while RoPE/logn are applied to it in place",
            "an inference input: call under torch.inference_mode() or torch.no_grad()",
        )
    if packed.is_inference() and not torch.is_inference_mode_enabled():
        raise _fail(
            "a QKV buffer made under torch.inference_mode() used outside it, while RoPE/logn "
            "are applied to it in place (torch forbids that write)",
            "forward() under torch.inference_mode() too, or a buffer made outside it",
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


@dataclass(frozen=True, eq=False)
class Geometry:
    """How to cut one checked buffer signature into the kernel's input, decided once.

    ``heads`` views the valid rows as ``[tokens, Hq + 2*Hkv, D]`` (one ``as_strided``), and
    ``split`` cuts that into Q, K, V (one ``split_with_sizes``): two cheap calls per layer.
    """

    tokens: int
    heads_size: tuple[int, int, int]
    heads_stride: tuple[int, int, int]
    storage_offset: int
    split: tuple[int, int, int]
    copy_rows: bool
    """Copy the valid rows into one dense, aligned buffer first (dense-packed layout on a
    strided buffer, or a buffer the backend's alignment rule refuses)."""
    dense_tensors: bool
    """Hand Q, K, V over as separate dense tensors (``needs_contiguous``)."""
    output_shape: torch.Size
    output_rows: tuple[int, int]
    """``(tokens, Hq * D)``: what ``forward`` returns. Plain ints: ``view`` parses them in a
    third of the time it takes for a ``torch.Size``."""
    output_dtype: torch.dtype
    plain: bool
    """Views only, no FP8: the per-layer call takes the short path in `run_forward`."""


def buffer_signature(packed: torch.Tensor) -> tuple[object, ...]:
    """What the geometric checks depend on: equal signatures pass or fail them alike."""
    return (
        packed.data_ptr(),
        packed.storage_offset(),
        packed.shape,
        packed.stride(),
        packed.dtype,
        packed.device,
    )


def make_geometry(
    packed: torch.Tensor,
    spec: AttentionSpec,
    tokens: int,
    layout: InputLayout,
    accepts_rows: Callable[[torch.Tensor], bool],
) -> Geometry:
    heads = spec.num_heads + 2 * spec.num_kv_heads
    dense_packed = layout == "dense-packed"
    rows = packed[:tokens]
    strided = tokens > 1 and rows.stride(0) != spec.qkv_width
    copy_rows = (dense_packed and strided) or not accepts_rows(rows)
    dense_tensors = layout == "dense-tensors"
    return Geometry(
        tokens=tokens,
        heads_size=(tokens, heads, spec.head_dim),
        heads_stride=(packed.stride(0), spec.head_dim, 1),
        storage_offset=int(packed.storage_offset()),
        split=(spec.num_heads, spec.num_kv_heads, spec.num_kv_heads),
        copy_rows=copy_rows,
        dense_tensors=dense_tensors,
        output_shape=torch.Size((tokens, spec.num_heads, spec.head_dim)),
        output_rows=(tokens, spec.q_width),
        output_dtype=spec.output_dtype,
        plain=not (copy_rows or dense_tensors or spec.is_fp8),
    )


def cut(packed: torch.Tensor, geo: Geometry, spec: AttentionSpec) -> tuple[torch.Tensor, ...]:
    """``(rows, q, k, v)`` for the kernel, per `Geometry`: views unless a copy is declared."""
    if geo.copy_rows:
        rows = packed[: geo.tokens].clone(memory_format=torch.contiguous_format)
        grid = rows.view(geo.heads_size)
    else:
        grid = packed.as_strided(geo.heads_size, geo.heads_stride, geo.storage_offset)
        rows = packed if packed.shape[0] == geo.tokens else packed[: geo.tokens]
    q, k, v = grid.split_with_sizes(geo.split, 1)
    if geo.dense_tensors:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return rows, q, k, v


def modified_note(spec: AttentionSpec, plan_tokens: int, *, certain: bool = True) -> str:
    """Where a separate RoPE/logn pass wrote, and how to recover, for error messages."""
    cols = spec.q_width + spec.kv_width
    was = "WAS MODIFIED" if certain else "MAY HAVE BEEN MODIFIED"
    return (
        f"the input {was}: RoPE/logn were applied in place to columns "
        f"[0, {cols}) (Q and K) of rows [0, {plan_tokens}); V and padding rows are untouched. "
        "Recompute the QKV projection (or restore a copy) before retrying or falling back"
    )


def _mark_modified(exc: AttentionBackendError, note: str) -> None:
    """Say on a library error raised after the in-place pass that the input changed."""
    exc.modified = note
    exc.args = (f"{exc.args[0] if exc.args else exc}; {note}", *exc.args[1:])


AnyPlan: TypeAlias = "PrefillPlan | GraphPlan"
AttendFn = Callable[[QKVViews, AnyPlan], torch.Tensor]
RowsRule = Callable[[torch.Tensor], bool]


def _accept_any(rows: torch.Tensor) -> bool:
    return True


def _not_ours(backend: str, plan: object) -> ParamsError:
    return ParamsError(
        f"the plan ({type(plan).__name__}) was not made by {backend}.prepare() or "
        f"{backend}.prepare_graph() for this spec; call prepare() on the same backend that "
        "runs forward()"
    )


def _as_rows(out: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """``out`` as ``[tokens, Hq * D]``: a view where its strides allow (every kernel's
    output so far), else a copy; ``view`` is the cheaper call when it applies."""
    try:
        return out.view(rows[0], rows[1])
    except RuntimeError:
        return out.reshape(rows[0], rows[1])


def run_forward(
    backend: str,
    spec: AttentionSpec,
    qkv: QKVInput,
    plan: AnyPlan,
    fp8_scales: Fp8Scales | None,
    layout: InputLayout,
    attend: AttendFn,
    accepts_rows: RowsRule = _accept_any,
) -> torch.Tensor:
    """Validate, pre-process in place, split, run ``attend`` and shape the output.

    Order matters: every check that can fail comes before the first write. The first branch
    is the per-layer steady state (a plan's own buffer signature seen before, views, no FP8):
    the same checks, in as few interpreter steps as they take; everything else goes through
    the general path below and `_execute`.
    """
    if (
        type(plan) is PrefillPlan
        and plan.backend == backend
        and (plan.spec is spec or plan.spec == spec)
    ):
        if type(qkv) is torch.Tensor and fp8_scales is None:
            geo = plan.memo.get(
                (
                    qkv.data_ptr(),
                    qkv.storage_offset(),
                    qkv.shape,
                    qkv.stride(),
                    qkv.dtype,
                    qkv.device,
                )
            )
            if geo is not None and geo.plain:
                if plan.rotates:
                    _rotate(qkv, plan, spec, geo.tokens)
                q, k, v = qkv.as_strided(
                    geo.heads_size, geo.heads_stride, geo.storage_offset
                ).split_with_sizes(geo.split, 1)
                try:
                    out = attend(QKVViews(qkv, q, k, v, None), plan)
                except Exception as exc:
                    note = modified_note(spec, geo.tokens) if plan.rotates else None
                    raise _attend_failure(backend, exc, note) from (
                        exc.__cause__ if isinstance(exc, AttentionBackendError) else exc
                    )
                if (
                    type(out) is torch.Tensor
                    and out.shape == geo.output_shape
                    and out.dtype == geo.output_dtype
                ):
                    return _as_rows(out, geo.output_rows)
                note = modified_note(spec, geo.tokens) if plan.rotates else None
                raise _bad_output(backend, spec, out, geo.output_shape, note)
    elif isinstance(plan, GraphPlan):
        return run_graph_forward(backend, spec, qkv, plan, fp8_scales, layout, attend, accepts_rows)
    else:
        raise _not_ours(backend, plan)
    packed = qkv if type(qkv) is torch.Tensor else unpack_tuple(qkv)
    if isinstance(packed, SeparateQKV):
        return _execute_separate(
            backend, spec, packed, plan, fp8_scales, layout, attend, accepts_rows
        )
    known = plan.memo.get(buffer_signature(packed)) if type(packed) is torch.Tensor else None
    if known is not None:
        geo = known
    else:
        params = plan.params
        checked = check_packed(packed, spec, params)
        geo = make_geometry(checked, spec, params.token_q_num, layout, accepts_rows)
        plan.memo.put(buffer_signature(checked), geo)
    assert isinstance(packed, torch.Tensor)  # check_packed proved it for this signature
    return _execute(backend, spec, packed, geo, plan, fp8_scales, attend, geo.tokens)


def run_graph_forward(
    backend: str,
    spec: AttentionSpec,
    qkv: QKVInput,
    plan: GraphPlan,
    fp8_scales: Fp8Scales | None,
    layout: InputLayout,
    attend: AttendFn,
    accepts_rows: RowsRule = _accept_any,
) -> torch.Tensor:
    """`run_forward` for a bucket's plan: the kernel sees every row of the bucket (padding rows
    as sequences of their own) and the output has ``max_tokens`` rows."""
    if plan.backend != backend or (plan.spec is not spec and plan.spec != spec):
        raise _not_ours(backend, plan)
    params = plan.current()
    packed = qkv if type(qkv) is torch.Tensor else unpack_tuple(qkv)
    if isinstance(packed, SeparateQKV):
        raise _fail(
            "separate (q, k, v) tensors with a graph plan",
            "the packed buffer in graph mode (a captured graph reads one fixed buffer)",
        )
    known = plan.memo.get(buffer_signature(packed)) if type(packed) is torch.Tensor else None
    if known is not None:
        geo = known
    else:
        rows = plan.bucket.max_tokens
        checked = check_packed(packed, spec, params)
        geo = make_geometry(checked, spec, rows, layout, accepts_rows)
        plan.memo.put(buffer_signature(checked), geo)
    assert isinstance(packed, torch.Tensor)  # check_packed proved it for this signature
    return _execute(backend, spec, packed, geo, plan, fp8_scales, attend, params.token_q_num)


def _rotate(packed: torch.Tensor, plan: AnyPlan, spec: AttentionSpec, written_rows: int) -> None:
    """The plan's separate RoPE/logn pass, after the write checks; a failure names the rows
    it may have written."""
    if (packed.requires_grad and torch.is_grad_enabled()) or (
        packed.is_inference() and not torch.is_inference_mode_enabled()
    ):
        check_writable(packed)  # raises the named error; nothing written
    try:
        if isinstance(plan, GraphPlan):
            apply_graph_preprocess(
                plan.preprocess, packed, spec, plan.rope_cu, plan.bucket.max_tokens
            )
        else:
            apply_preprocess(plan.preprocess, packed, spec, plan.params, plan.tables)
    except Exception as exc:
        note = modified_note(spec, written_rows, certain=False)
        raise _pass_failure(plan.preprocess, exc, note) from exc


def _pass_failure(mode: str, exc: Exception, note: str) -> BackendFailure:
    """The error for a RoPE/logn pass that raised part-way: the input may have changed."""
    return BackendFailure(
        f"the {mode} RoPE/logn pass failed: {type(exc).__name__}: {exc}; {note}", modified=note
    )


def _attend_failure(backend: str, exc: Exception, note: str | None) -> AttentionBackendError:
    """The error to raise for an exception from ``attend``: the library's own errors keep
    their type (gaining ``note``, where the in-place pass already wrote), any other becomes
    `BackendFailure`."""
    if isinstance(exc, AttentionBackendError):
        if note is not None:
            _mark_modified(exc, note)
        return exc
    return BackendFailure(
        f"backend {backend} failed in attend(): {type(exc).__name__}: {exc}"
        + (f"; {note}" if note else ""),
        modified=note,
    )


def _bad_output(
    backend: str, spec: AttentionSpec, out: object, expected: torch.Size, note: str | None
) -> BackendFailure:
    """The error for an ``attend`` result of the wrong shape or dtype."""
    got = (
        f"{tuple(out.shape)} {dtype_name(out.dtype)}"
        if isinstance(out, torch.Tensor)
        else type(out).__name__
    )
    return BackendFailure(
        f"backend {backend} returned {got}; the contract needs "
        f"{tuple(expected)} {dtype_name(spec.output_dtype)}" + (f"; {note}" if note else ""),
        modified=note,
    )


def _execute(
    backend: str,
    spec: AttentionSpec,
    packed: torch.Tensor,
    geo: Geometry,
    plan: AnyPlan,
    fp8_scales: Fp8Scales | None,
    attend: AttendFn,
    written_rows: int,
) -> torch.Tensor:
    """The per-call part of the general path: FP8 checks, the in-place pass, the cut, the
    kernel, the output. ``written_rows``: the rows the in-place pass rotates (for errors)."""
    if fp8_scales is not None or spec.is_fp8:
        check_fp8_scales(spec, fp8_scales, packed.device)
    rotated = is_separate(plan.preprocess)
    if rotated:
        _rotate(packed, plan, spec, written_rows)
    rows, q, k, v = cut(packed, geo, spec)
    note = modified_note(spec, written_rows) if rotated else None
    return _attend_checked(
        backend, spec, QKVViews(rows, q, k, v, fp8_scales), plan, attend, geo.output_shape, note
    )


def _attend_checked(
    backend: str,
    spec: AttentionSpec,
    views: QKVViews,
    plan: AnyPlan,
    attend: AttendFn,
    expected: torch.Size,
    note: str | None,
) -> torch.Tensor:
    """``attend``, its failure named, its output checked and shaped ``[tokens, Hq * D]``.
    ``note`` says what the in-place pass already wrote (None: nothing)."""
    try:
        out = attend(views, plan)
    except Exception as exc:
        raise _attend_failure(backend, exc, note) from (
            exc.__cause__ if isinstance(exc, AttentionBackendError) else exc
        )
    if type(out) is not torch.Tensor or out.shape != expected or out.dtype != spec.output_dtype:
        raise _bad_output(backend, spec, out, expected, note)
    return out.reshape(expected[0], spec.q_width)


def _execute_separate(
    backend: str,
    spec: AttentionSpec,
    given: SeparateQKV,
    plan: PrefillPlan,
    fp8_scales: Fp8Scales | None,
    layout: InputLayout,
    attend: AttendFn,
    accepts_rows: RowsRule,
) -> torch.Tensor:
    """`_execute` for separate Q/K/V (see ``_separate``): the same order, every check first."""
    params = plan.params
    q, k, v = check_separate(given, spec, params)
    if fp8_scales is not None or spec.is_fp8:
        check_fp8_scales(spec, fp8_scales, q.device)
    tokens = params.token_q_num
    if plan.rotates:
        check_writable(q)
        check_writable(k)
        try:
            rotate_separate(q, k, spec, params, plan.tables)
        except Exception as exc:
            raise _pass_failure("torch", exc, separate_note(tokens, certain=False)) from exc
    q, k, v = q[:tokens], k[:tokens], v[:tokens]
    dense = layout == "dense-tensors" or not all(accepts_rows(t.flatten(1)) for t in (q, k, v))
    if dense:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    note = separate_note(tokens, certain=True) if plan.rotates else None
    expected = torch.Size((tokens, spec.num_heads, spec.head_dim))
    return _attend_checked(
        backend, spec, QKVViews(None, q, k, v, fp8_scales), plan, attend, expected, note
    )
