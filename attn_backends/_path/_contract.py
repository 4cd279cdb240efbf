"""The packed-QKV contract: the single place that accepts, checks, rotates and splits QKV.

Every backend's ``forward`` goes through one `ForwardPath` (built once when the backend is
bound), whatever the input form (packed buffer, ``(packed, None, None)``, separate
``(q, k, v)``) and whatever the plan (`PrefillPlan` or graph mode's `GraphPlan`), so the rules
are enforced once:

* Accepted input: a 2-D tensor ``[rows, (Hq + 2*Hkv) * D]`` with columns Q|K|V, a tuple
  ``(packed, K, V)`` whose K and V are both None or empty, or separate ``(q, k, v)`` (see
  ``_separate``). ``rows`` equals the plan's ``params.rows`` (``token_q_num`` plus any
  CUDA-graph padding); padding rows never reach the output.
* Every check that can fail runs before anything is written: a rejected input is untouched.
  An error that can still come later (inside the kernel) says whether, and where, the input
  was already modified (`AttentionBackendError.modified`).
* RoPE and logn are applied IN PLACE to the Q and K columns of the valid rows (the caller's
  buffer changes), once, before the kernel runs. V and padding rows are never written.
* Q, K, V reach the kernel as views trimmed to the valid rows; they are copied only for a
  backend that declares it needs dense memory, or whose alignment rule the buffer breaks.
* Output is ``[token_q_num, Hq * D]`` in the model dtype.

The checks that depend only on the input's geometry (shape, strides, dtype, device, address,
aliasing) run once per plan and input signature (`BufferMemo`): a per-layer call on a buffer
seen before pays for one dict lookup, a buffer not seen before is checked in full.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, cast

import torch

from .._values._dtypes import dtype_name
from .._values._errors import AttentionBackendError, BackendFailure, ParamsError
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec
from ._checks import Fp8Scales as Fp8Scales
from ._checks import QKVInput as QKVInput
from ._checks import SeparateQKV, check_sinks, check_writable, fail
from ._checks import check_fp8_scales as check_fp8_scales
from ._checks import check_packed as check_packed
from ._checks import unpack_packed as unpack_packed
from ._checks import unpack_tuple as unpack_tuple
from ._geometry import MEMO_SLOTS as MEMO_SLOTS
from ._geometry import BufferMemo as BufferMemo
from ._geometry import Geometry, Grid, Signature, make_geometry
from ._geometry import InputLayout as InputLayout
from ._geometry import buffer_signature as buffer_signature
from ._geometry import cut as cut
from ._geometry import split_views as split_views
from ._graph import GraphPlan
from ._preprocess import (
    PreprocessChoice,
    PreprocessMode,
    RopePass,
    apply_graph_preprocess,
    is_separate,
    pass_named,
    prepare_tables,
    run_rope_pass,
)
from ._preprocess import preprocess_mode as preprocess_mode  # re-exported: backends import it
from ._rope import PositionTables, build_position_tables
from ._separate import (
    alignment,
    is_batch_major,
    packed_of,
    rotate_separate,
    separate_geometry,
    separate_note,
    separate_signature,
)


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
    the kernel; decided once, when the backend was bound (see ``_preprocess``)."""
    tables: PositionTables | None
    """The torch pass's per-token tables, built once per batch for every plan that rotates
    (separate ``(q, k, v)`` input always takes the torch pass); None when nothing rotates."""
    kernel: object
    """Backend-owned plan (a wrapper, host metadata...); opaque to the contract."""
    memo: BufferMemo = field(default_factory=BufferMemo, repr=False, compare=False)
    """Checks already passed per input signature (see `BufferMemo`)."""
    rope_pass: RopePass | None = field(default=None, repr=False, compare=False)
    """The pass object that runs ``preprocess`` on packed input (None: nothing rotates)."""
    rotates: bool = field(init=False, repr=False, compare=False)
    """``preprocess`` is a separate pass that writes the caller's buffer."""

    def __post_init__(self) -> None:
        rotates = is_separate(self.preprocess)
        object.__setattr__(self, "rotates", rotates)
        known = self.rope_pass
        if rotates and (known is None or known.name != self.preprocess):
            # A plan built by hand (or replaced) with a pass name: the pass of that name.
            object.__setattr__(self, "rope_pass", pass_named(self.preprocess))
        elif not rotates and known is not None:
            object.__setattr__(self, "rope_pass", None)
        if rotates and self.tables is None:
            params = self.params
            tables = build_position_tables(self.spec, params.positions, params.max_seqlen_q)
            object.__setattr__(self, "tables", tables)

    @property
    def output_rows(self) -> int:
        """Rows of ``forward``'s output: the batch's valid tokens."""
        return self.params.token_q_num


class QKVViews:
    """Q, K, V of the valid rows, ``[tokens, heads, D]`` each, plus the FP8 scales and the
    layer's attention-sink logits (float ``[Hq]``, checked by the contract) if any.

    ``packed`` is the ``[tokens, (Hq + 2*Hkv) * D]`` rows they were cut from, trimmed to the
    valid tokens when first read (kernels on Q/K/V views never pay for it). With separate
    Q/K/V input it is built, a copy, only if a kernel reads it.

    ``batch``: with batch-major input (``[n, heads, L, D]`` each, ``n`` sequences of ``L``
    tokens), those tensors as given, for a kernel that attends batch-major; ``q``, ``k``, ``v``
    are then made from them (views, or dense copies where no view reaches the rows) when a
    kernel first reads them. None for every other input.
    """

    __slots__ = ("_grids", "_k", "_packed", "_q", "_rows", "_v", "batch", "fp8_scales", "sinks")

    def __init__(
        self,
        packed: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fp8_scales: Fp8Scales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self._packed = packed
        self._rows: torch.Tensor | None = None
        self._q: torch.Tensor | None = q
        self._k: torch.Tensor | None = k
        self._v: torch.Tensor | None = v
        self._grids: tuple[Grid, Grid, Grid] | None = None
        self.batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.fp8_scales = fp8_scales
        self.sinks = sinks

    @classmethod
    def of_batch(
        cls,
        batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        grids: tuple[Grid, Grid, Grid],
        fp8_scales: Fp8Scales | None = None,
    ) -> QKVViews:
        """Views of checked batch-major input whose rows ``grids`` make on first read."""
        views = cls.__new__(cls)
        views._packed = views._rows = views._q = views._k = views._v = None
        views._grids = grids
        views.batch = batch
        views.fp8_scales = fp8_scales
        views.sinks = None
        return views

    def _made(self, index: int) -> torch.Tensor:
        grids, batch = self._grids, self.batch
        assert grids is not None and batch is not None  # every other form sets q, k, v
        return grids[index].of(batch[index])

    @property
    def q(self) -> torch.Tensor:
        if self._q is None:
            self._q = self._made(0)
        return self._q

    @property
    def k(self) -> torch.Tensor:
        if self._k is None:
            self._k = self._made(1)
        return self._k

    @property
    def v(self) -> torch.Tensor:
        if self._v is None:
            self._v = self._made(2)
        return self._v

    @property
    def packed(self) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            q = self.q
            tokens = q.shape[0]
            source = self._packed
            if source is None:  # separate Q/K/V: packed rows exist only as a copy
                rows = packed_of(q, self.k, self.v)
            else:
                rows = source if source.shape[0] == tokens else source[:tokens]
            self._rows = rows
        return rows

    def __iter__(self) -> Iterator[object]:
        """``packed, q, k, v, fp8_scales``, as the tuple this class once was."""
        return iter((self.packed, self.q, self.k, self.v, self.fp8_scales))


def prepare_plan(
    backend: str,
    spec: AttentionSpec,
    params: FMHAParams,
    choice: PreprocessChoice,
    kernel: object,
) -> PrefillPlan:
    """The plan of one batch for the pass ``choice`` the binding resolved."""
    return PrefillPlan(
        backend,
        spec,
        params,
        choice.mode,
        prepare_tables(choice.mode, spec, params),
        kernel,
        rope_pass=choice.rope_pass,
    )


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


class Kernel(Protocol):
    """The backend side of a forward: the kernel call and the alignment rule it reads rows by."""

    def attend(self, views: QKVViews, plan: AnyPlan) -> torch.Tensor: ...

    def accepts_rows(self, rows: torch.Tensor) -> bool: ...


def _not_ours(backend: str, plan: object) -> ParamsError:
    return ParamsError(
        f"the plan ({type(plan).__name__}) was not made by {backend}.prepare() or "
        f"{backend}.prepare_graph() for this spec; call prepare() on the same backend that "
        "runs forward()"
    )


def _as_rows(out: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """``out`` as ``[tokens, Hq * D]``: a view where its strides allow, else a copy; ``view``
    is the cheaper call for a dense output, ``reshape`` decides for any other (no exception
    raised and caught per call: torch-sdpa's one-sequence output is a strided view)."""
    if out.is_contiguous():
        return out.view(rows[0], rows[1])
    return out.reshape(rows[0], rows[1])


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


def _written_rows(plan: AnyPlan, geo: Geometry) -> int:
    """Rows the in-place pass rotates: the batch's tokens (graph mode: the current batch's)."""
    return plan.current().token_q_num if isinstance(plan, GraphPlan) else geo.tokens


class ForwardPath:
    """The per-layer path of one bound backend, built once when it is bound.

    One sequence for every input form and plan: whose plan, the input's checks (once per
    signature, through the plan's memo), the FP8 scales, the in-place pass, the cut, the
    kernel with its failure named, the output checked and shaped. Order matters: every check
    that can fail comes before the first write. The packed buffer seen before (the per-layer
    steady state) takes the same steps in as few interpreter steps as they take.
    """

    __slots__ = (
        "_fp8",
        "_kernel",
        "_layout",
        "_name",
        "_reads_addresses",
        "_separate",
        "_sinks",
        "_spec",
    )

    def __init__(
        self,
        name: str,
        spec: AttentionSpec,
        layout: InputLayout,
        kernel: Kernel,
        *,
        reads_addresses: bool = True,
    ) -> None:
        self._name = name
        self._spec = spec
        self._layout: InputLayout = layout
        self._kernel = kernel
        self._reads_addresses = reads_addresses
        """Whether the kernel's ``accepts_rows`` rule may read an input's address (False: the
        backend states no rule, so separate inputs a plan does not write are told apart by
        their geometry alone)."""
        self._fp8 = spec.is_fp8
        self._sinks = spec.attention_sinks
        self._separate = BufferMemo()
        """Separate-input geometries by signature and the batch's row and token counts and
        device (and, for batch-major input, its lengths), all `separate_geometry` reads of a
        plan: a new batch's plan (each batch of new boundaries has one) finds the checks its
        layers' tensors passed in an earlier batch."""

    def run(
        self,
        qkv: QKVInput,
        plan: AnyPlan,
        fp8_scales: Fp8Scales | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec = self._spec
        if not (type(plan) is PrefillPlan or isinstance(plan, GraphPlan)) or (
            plan.backend != self._name or (plan.spec is not spec and plan.spec != spec)
        ):
            raise _not_ours(self._name, plan)
        given: SeparateQKV | None = None
        if type(qkv) is torch.Tensor:
            packed: torch.Tensor | None = qkv
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
            if geo is None:
                geo = self._learn_packed(qkv, plan)
        else:
            packed, given, geo = self._learn(qkv, plan)
        if fp8_scales is not None or self._fp8:
            device = plan.device if isinstance(plan, GraphPlan) else plan.params.device
            check_fp8_scales(spec, fp8_scales, device)
        if sinks is not None or self._sinks:
            device = plan.device if isinstance(plan, GraphPlan) else plan.params.device
            check_sinks(spec, sinks, device)
        if given is None:
            assert packed is not None  # one of the two input forms
            if plan.rotates:
                self._rotate_packed(packed, plan, geo)
            if geo.plain:
                q, k, v = packed.as_strided(
                    geo.heads_size, geo.heads_stride, geo.storage_offset
                ).split_with_sizes(geo.split, 1)
                views = QKVViews(packed, q, k, v, None, sinks)
            else:
                rows, q, k, v = cut(packed, geo)
                views = QKVViews(rows, q, k, v, fp8_scales, sinks)
        else:
            views = self._separate_views(given, plan, geo, fp8_scales)
            views.sinks = sinks
        return _as_rows(self._attend(views, plan, geo, given), geo.output_rows)

    def _attend(
        self, views: QKVViews, plan: AnyPlan, geo: Geometry, given: SeparateQKV | None
    ) -> torch.Tensor:
        """The kernel on checked views, its failure named and its output checked:
        ``[tokens, Hq, D]`` in the output dtype."""
        try:
            out = self._kernel.attend(views, plan)
        except Exception as exc:
            raise _attend_failure(self._name, exc, self._written(plan, geo, given)) from (
                exc.__cause__ if isinstance(exc, AttentionBackendError) else exc
            )
        if (
            type(out) is torch.Tensor
            and out.shape == geo.output_shape
            and out.dtype == geo.output_dtype
        ):
            return out
        note = self._written(plan, geo, given)
        raise _bad_output(self._name, self._spec, out, geo.output_shape, note)

    def bind(self, qkv: QKVInput, plan: AnyPlan) -> BoundForward | None:
        """`run` for every later input of ``qkv``'s signature: ``qkv`` is checked in full now
        (as `run` checks it), and the result runs the cut, the kernel and the output check
        per call. Separate ``(q, k, v)`` tensors with a per-batch plan that writes nothing
        only; None for any other input (call `run`)."""
        if type(plan) is not PrefillPlan or plan.rotates or self._fp8 or type(qkv) is not tuple:
            return None
        spec = self._spec
        if plan.backend != self._name or (plan.spec is not spec and plan.spec != spec):
            raise _not_ours(self._name, plan)
        _, given, geo = self._learn(qkv, plan)
        if given is None:
            return None
        tensors = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], qkv)
        aligned = _alignments(tensors) if self._reads_addresses else None
        return BoundForward(self, plan, geo, aligned)

    # The input, checked once per signature ------------------------------------------------

    def _learn_packed(self, packed: object, plan: AnyPlan) -> Geometry:
        """Every rule of a packed buffer not seen before, and how to cut it, into the memo."""
        spec = self._spec
        if isinstance(plan, GraphPlan):
            params, rows = plan.current(), plan.bucket.max_tokens
        else:
            params = plan.params
            rows = params.token_q_num
        checked = check_packed(packed, spec, params)
        geo = make_geometry(checked, spec, rows, self._layout, self._kernel.accepts_rows)
        plan.memo.put(buffer_signature(checked), geo)
        return geo

    def _learn(
        self, qkv: object, plan: AnyPlan
    ) -> tuple[torch.Tensor | None, SeparateQKV | None, Geometry]:
        """A tuple input: the packed buffer it carries, or separate ``(q, k, v)``."""
        signature: Signature | None = None
        signed = False  # whether `signature` is already that of these three tensors
        if type(qkv) is tuple and len(qkv) == 3 and type(plan) is PrefillPlan:
            q, k, v = qkv
            if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
                # three tensors of a signature this plan checked as separate input (never
                # empty ones, which carry a packed buffer): the checks hold as they did
                given = SeparateQKV(q, k, v)
                signature = separate_signature(
                    given, writes=plan.rotates, addresses=self._reads_addresses
                )
                signed = True
                seen = plan.memo.get(signature) if signature is not None else None
                if seen is not None:
                    return None, given, seen
        first = unpack_tuple(qkv)
        if not isinstance(first, SeparateQKV):
            known = plan.memo.get(buffer_signature(first)) if type(first) is torch.Tensor else None
            geo = known if known is not None else self._learn_packed(first, plan)
            return cast(torch.Tensor, first), None, geo  # check_packed proved it
        if isinstance(plan, GraphPlan):
            raise fail(
                "separate (q, k, v) tensors with a graph plan",
                "the packed buffer in graph mode (a captured graph reads one fixed buffer)",
            )
        if not signed:  # else the same three tensors were signed above (a memo miss)
            signature = separate_signature(
                first, writes=plan.rotates, addresses=self._reads_addresses
            )
        if signature is None:
            return None, first, self._separate_geometry(first, plan)
        seen = plan.memo.get(signature)
        if seen is None:
            params = plan.params
            # batch-major input is checked against the sequences' lengths too
            lengths = params.input_lengths if is_batch_major(first) else None
            shared = (signature, params.rows, params.token_q_num, params.device, lengths)
            seen = self._separate.get(shared)
            if seen is None:
                seen = self._separate_geometry(first, plan)
                self._separate.put(shared, seen)
            plan.memo.put(signature, seen)
        return None, first, seen

    def _separate_geometry(self, given: SeparateQKV, plan: PrefillPlan) -> Geometry:
        return separate_geometry(
            given,
            self._spec,
            plan.params,
            self._layout,
            self._kernel.accepts_rows,
            writes=plan.rotates,
        )

    # The in-place pass and the cut ----------------------------------------------------------

    def _rotate_packed(self, packed: torch.Tensor, plan: AnyPlan, geo: Geometry) -> None:
        """The plan's separate RoPE/logn pass, after the write checks; a failure names the
        rows it may have written."""
        if (packed.requires_grad and torch.is_grad_enabled()) or (
            packed.is_inference() and not torch.is_inference_mode_enabled()
        ):
            check_writable(packed)  # raises the named error; nothing written
        spec = self._spec
        try:
            if isinstance(plan, GraphPlan):
                apply_graph_preprocess(
                    plan.preprocess, packed, spec, plan.rope_cu, plan.bucket.max_tokens
                )
            else:
                assert plan.rope_pass is not None  # set for every plan that rotates
                run_rope_pass(plan.rope_pass, packed, spec, plan.params, plan.tables)
        except Exception as exc:
            note = modified_note(spec, _written_rows(plan, geo), certain=False)
            raise _pass_failure(plan.preprocess, exc, note) from exc

    def _separate_views(
        self,
        given: SeparateQKV,
        plan: AnyPlan,
        geo: Geometry,
        fp8_scales: Fp8Scales | None,
    ) -> QKVViews:
        """Separate input: the checked views, q and k rotated by the plan's pass (the torch
        pass with the plan's tables where it takes no separate tensors), trimmed to the valid
        tokens (dense copies where declared)."""
        assert geo.grids is not None and isinstance(plan, PrefillPlan)  # _learn proved both
        if geo.batch and not geo.dense_tensors:  # never rotates: the geometry refused that
            batch = cast(
                tuple[torch.Tensor, torch.Tensor, torch.Tensor], (given.q, given.k, given.v)
            )
            return QKVViews.of_batch(batch, geo.grids, fp8_scales)
        gq, gk, gv = geo.grids
        q = gq.of(cast(torch.Tensor, given.q))
        k = gk.of(cast(torch.Tensor, given.k))
        v = gv.of(cast(torch.Tensor, given.v))
        tokens = geo.tokens
        if plan.rotates:
            check_writable(q)
            check_writable(k)
            assert plan.tables is not None  # built in prepare for every plan that rotates
            try:
                rotate_separate(q, k, self._spec, plan.params, plan.tables, plan.rope_pass)
            except Exception as exc:
                name = plan.rope_pass.name if plan.rope_pass is not None else "torch"
                raise _pass_failure(name, exc, separate_note(tokens, certain=False)) from exc
        if q.shape[0] != tokens:  # padding rows after the batch's tokens
            q, k, v = q[:tokens], k[:tokens], v[:tokens]
        if geo.dense_tensors:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return QKVViews(None, q, k, v, fp8_scales)

    def _written(self, plan: AnyPlan, geo: Geometry, given: SeparateQKV | None) -> str | None:
        """What the in-place pass already wrote, for an error raised after it (None: nothing)."""
        if not plan.rotates:
            return None
        if given is not None:
            return separate_note(geo.tokens, certain=True)
        return modified_note(self._spec, _written_rows(plan, geo))


def _alignments(qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[int, int, int]:
    """The `alignment` of q's, k's and v's addresses: what a bound forward compares per call."""
    q, k, v = qkv
    return alignment(q.data_ptr()), alignment(k.data_ptr()), alignment(v.data_ptr())


class BoundForward:
    """`ForwardPath.run` for separate ``(q, k, v)`` input of one signature, checked once
    (`ForwardPath.bind`): each call runs the cut, the kernel and the output check, and none of
    the input checks, which depend on that signature alone (shapes, strides, storage offsets,
    dtypes, devices; `separate_signature`).

    The caller vouches for the signature of every input it passes: it holds the signature in
    its own key (the transformers integration's lane key, `transformers._lane_key`). Where the
    kernel's alignment rule reads addresses, their alignment is compared here per call, and an
    input of another alignment takes the full path. Returns ``[tokens, Hq, D]``.
    """

    __slots__ = ("_aligned", "_geo", "_path", "_plan", "_sinks")

    def __init__(
        self,
        path: ForwardPath,
        plan: PrefillPlan,
        geo: Geometry,
        aligned: tuple[int, ...] | None,
    ) -> None:
        self._path = path
        self._plan = plan
        self._geo = geo
        self._aligned = aligned
        self._sinks = path._sinks

    @property
    def plan(self) -> PrefillPlan:
        return self._plan

    def __call__(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        path, plan, geo = self._path, self._plan, self._geo
        aligned = self._aligned
        if aligned is not None and aligned != _alignments(qkv):
            out = path.run(qkv, plan, None, sinks)
            return out.view(geo.output_shape)
        if sinks is not None or self._sinks:
            check_sinks(path._spec, sinks, plan.params.device)
        grids = geo.grids
        if geo.batch and not geo.dense_tensors and grids is not None:
            views = QKVViews.of_batch(qkv, grids)
        else:
            views = path._separate_views(SeparateQKV(*qkv), plan, geo, None)
        views.sinks = sinks
        return path._attend(views, plan, geo, None)
