"""Separate Q, K, V input: ``forward((q, k, v), plan)`` for models with separate projections.

BERT-style checkpoints, LoRA on q/v and separately quantised linears produce three tensors;
concatenating them into a packed buffer every layer is the copy this library exists to remove.
Each tensor is ``[rows, heads * D]`` or ``[rows, heads, D]`` (heads dense within a row, any row
stride), the rows those of the plan; or, for a batch of ``n`` sequences of ``L`` tokens each,
batch-major ``[n, heads, L, D]`` (transformers' layout, any strides but a unit last one): a
kernel that attends batch-major reads those tensors as they are, any other reads their rows
(a view where the memory allows, else a dense copy). The rules are the packed contract's:
every check before the first write, RoPE/logn in place on the valid rows of ``q`` and ``k``
(V and padding rows never written), views trimmed to the valid tokens reach the kernel,
copied only for a backend that declares it needs dense memory.

Two rules are this input's own. The RoPE/logn pass is the plan's own when it takes separate
tensors (`RopePass.apply_separate`: the native kernel and flashinfer's do, in one launch that
allocates nothing), else the torch one, with the tables the plan built once in ``prepare``.
And a plan that rotates refuses q or k sharing any byte with another input
(``k is v``, ``q`` a view of ``v``, overlapping columns of one buffer): the pass would write V, or
rotate a byte twice. Views of disjoint columns of one buffer are fine.
"""

from __future__ import annotations

from typing import cast

import torch

from .._values._dtypes import dtype_name
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec
from ._checks import SeparateQKV, fail
from ._geometry import Geometry, Grid, InputLayout, RowsRule
from ._rope import PositionTables, apply_rope_logn
from ._rope_passes import RopePass

__all__ = [
    "SeparateQKV",
    "alignment",
    "check_separate",
    "is_batch_major",
    "packed_of",
    "rotate_separate",
    "separate_geometry",
    "separate_note",
]


def _as_heads(
    name: str, t: object, heads: int, spec: AttentionSpec, params: FMHAParams
) -> torch.Tensor:
    """``t`` checked and viewed as ``[rows, heads, D]`` (a view: nothing is copied)."""
    width = heads * spec.head_dim
    layout = f"[rows, {heads} * {spec.head_dim}] or [rows, {heads}, {spec.head_dim}]"
    if not isinstance(t, torch.Tensor):
        raise fail(f"{name} is a {type(t).__name__}", f"a torch.Tensor {layout}")
    shape = tuple(t.shape)
    if not ((t.dim() == 2 and shape[1] == width) or shape[1:] == (heads, spec.head_dim)):
        raise fail(f"{name} of shape {shape}", f"{layout} for the spec's heads")
    dense_row = t.stride(-1) == 1 and (t.dim() == 2 or heads == 1 or t.stride(1) == spec.head_dim)
    if not dense_row:
        raise fail(
            f"{name} with strides {tuple(t.stride())}",
            "heads dense within a row (unit stride inside a row; rows may be strided)",
        )
    grid = t if t.dim() == 3 else t.view(shape[0], heads, spec.head_dim)
    if t.dtype != spec.dtype:
        raise fail(f"{name} of dtype {dtype_name(t.dtype)}", f"the spec's {dtype_name(spec.dtype)}")
    if t.device != params.device:
        raise fail(
            f"{name} on {t.device} but FMHAParams on {params.device}",
            "every tensor on the plan's device",
        )
    if shape[0] != params.rows:
        raise fail(
            f"{name} with {shape[0]} rows for a plan of {params.rows} rows",
            "the rows the plan was made for (padded_rows when the tensors carry padding)",
        )
    if shape[0] > 1 and grid.stride(0) < width:
        raise fail(f"{name} whose rows overlap (row stride {grid.stride(0)})", f">= {width}")
    return grid


def _row_bytes(grid: torch.Tensor) -> tuple[int, int, int, int]:
    """``(start, row stride, row width, rows)`` in bytes of a checked ``[rows, heads, D]`` view:
    row ``r`` holds the bytes ``[start + r * stride, start + r * stride + width)``."""
    size = grid.element_size()
    return (
        grid.data_ptr(),
        grid.stride(0) * size,
        grid.shape[1] * grid.shape[2] * size,
        grid.shape[0],
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two checked ``[rows, heads, D]`` views share a byte (by address, so views of
    one storage and tensors sharing memory any other way are both seen).

    With one row stride the answer is exact: rows ``r1`` of ``a`` and ``r2`` of ``b`` meet when
    ``(r1 - r2) * stride`` lies strictly between ``d - width_a`` and ``d + width_b`` (``d`` the
    distance of the starts), so disjoint column slices of one buffer pass. With different
    strides the whole spans are compared, which may refuse an unusual layout that does not
    overlap; the error says to pass distinct tensors then.
    """
    start_a, stride_a, width_a, rows = _row_bytes(a)
    start_b, stride_b, width_b, rows_b = _row_bytes(b)
    if rows == 0 or rows_b == 0 or width_a == 0 or width_b == 0:
        return False
    if rows == 1 or stride_a != stride_b:
        end_a = start_a + (rows - 1) * stride_a + width_a
        end_b = start_b + (rows_b - 1) * stride_b + width_b
        return start_a < end_b and start_b < end_a
    d, stride = start_b - start_a, stride_a
    lowest = (d - width_a) // stride + 1  # smallest k with k * stride > d - width_a
    highest = -((-(d + width_b)) // stride) - 1  # largest k with k * stride < d + width_b
    return max(lowest, -(rows - 1)) <= min(highest, rows - 1)


def _refuse_aliasing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q and k are written in place: neither may share a byte with another input."""
    if q.data_ptr() == k.data_ptr():
        raise fail(
            "q and k are the same memory (RoPE would rotate it twice)",
            "three distinct tensors, or the packed buffer",
        )
    for first, second, a, b, harm in (
        ("q", "k", q, k, "RoPE would rotate the shared bytes twice"),
        ("k", "v", k, v, "RoPE on k would write v"),
        ("q", "v", q, v, "RoPE/logn on q would write v"),
    ):
        if _overlap(a, b):
            same = a.data_ptr() == b.data_ptr() and a.shape == b.shape
            how = "are the same memory" if same else "overlap in memory"
            raise fail(
                f"{first} and {second} {how} ({harm}), while this plan applies RoPE/logn to q "
                "and k in place",
                "q and k sharing no memory with each other or with v: distinct tensors, "
                "disjoint column slices of one buffer, or the packed buffer",
            )


def is_batch_major(given: SeparateQKV) -> bool:
    """Whether the input is batch-major: three 4-D tensors (`_batch_grid` checks the rest)."""
    return all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (given.q, given.k, given.v))


def _batch_grid(
    name: str, t: torch.Tensor, heads: int, spec: AttentionSpec, params: FMHAParams
) -> Grid:
    """A batch-major ``[n, heads, L, D]`` tensor checked against a plan of ``n`` sequences of
    ``L`` tokens (no padding rows), and how its ``[rows, heads, D]`` rows are made: one strided
    view where each token's heads are dense and the sequences follow each other at one row
    stride, else a dense copy."""
    count, length = int(t.shape[0]), int(t.shape[2])
    layout = f"[n, {heads}, L, {spec.head_dim}]"
    if tuple(t.shape[1:2]) + tuple(t.shape[3:]) != (heads, spec.head_dim):
        raise fail(f"{name} of shape {tuple(t.shape)}", f"{layout} for the spec's heads")
    if params.input_lengths != (length,) * count or params.rows != params.token_q_num:
        raise fail(
            f"batch-major {name} of {count} sequences of {length} tokens for a plan of lengths "
            f"{list(params.input_lengths)[:8]}{'...' if len(params.input_lengths) > 8 else ''}"
            f" in {params.rows} rows",
            "the plan's batch: n sequences of L tokens each and no padding rows, or rows "
            "[rows, heads, D] for any other batch",
        )
    if spec.head_dim > 1 and t.stride(3) != 1:
        raise fail(f"{name} with strides {tuple(t.stride())}", "a unit stride along head_dim")
    if t.dtype != spec.dtype:
        raise fail(f"{name} of dtype {dtype_name(t.dtype)}", f"the spec's {dtype_name(spec.dtype)}")
    if t.device != params.device:
        raise fail(
            f"{name} on {t.device} but FMHAParams on {params.device}",
            "every tensor on the plan's device",
        )
    s_batch, s_head, s_token, _ = t.stride()
    rows = count * length
    size = (rows, heads, spec.head_dim)
    dense_heads = heads == 1 or s_head == spec.head_dim
    one_stride = count == 1 or s_batch == length * s_token
    if dense_heads and one_stride and (rows == 1 or s_token >= heads * spec.head_dim):
        return Grid(size, (s_token, s_head, 1), int(t.storage_offset()))
    return Grid(size, (heads * spec.head_dim, spec.head_dim, 1), 0, copied=True)


def check_separate(
    given: SeparateQKV, spec: AttentionSpec, params: FMHAParams, *, writes: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V as ``[rows, heads, D]`` views after every rule; raises `PackedQKVError`.

    ``writes``: the plan rotates q and k in place, so they may share no memory with any input.
    """
    q = _as_heads("q", given.q, spec.num_heads, spec, params)
    k = _as_heads("k", given.k, spec.num_kv_heads, spec, params)
    v = _as_heads("v", given.v, spec.num_kv_heads, spec, params)
    if writes:
        _refuse_aliasing(q, k, v)
    return q, k, v


def _grid(view: torch.Tensor, given: object) -> Grid:
    rows, heads, dim = (int(n) for n in view.shape)
    row_stride, head_stride, unit = view.stride()
    offset = int(view.storage_offset())
    same = (
        isinstance(given, torch.Tensor)
        and given.dim() == 3
        and tuple(given.stride()) == (row_stride, head_stride, unit)
        and int(given.storage_offset()) == offset
    )
    return Grid((rows, heads, dim), (row_stride, head_stride, unit), offset, same)


def separate_geometry(
    given: SeparateQKV,
    spec: AttentionSpec,
    params: FMHAParams,
    layout: InputLayout,
    accepts_rows: RowsRule,
    *,
    writes: bool,
) -> Geometry:
    """Every check of a ``(q, k, v)`` input, and how to cut it, as one memoisable `Geometry`."""
    if is_batch_major(given):
        return _batch_geometry(given, spec, params, layout, accepts_rows, writes=writes)
    q, k, v = check_separate(given, spec, params, writes=writes)
    tokens = params.token_q_num
    dense = layout == "dense-tensors" or not all(
        accepts_rows(t[:tokens].flatten(1)) for t in (q, k, v)
    )
    grids = (_grid(q, given.q), _grid(k, given.k), _grid(v, given.v))
    return _views_geometry(spec, tokens, grids, dense=dense, batch=False)


def _views_geometry(
    spec: AttentionSpec,
    tokens: int,
    grids: tuple[Grid, Grid, Grid],
    *,
    dense: bool,
    batch: bool,
) -> Geometry:
    """The `Geometry` of checked separate input: ``grids`` make its ``[rows, heads, D]`` views
    (``batch``: from batch-major tensors, for kernels that read rows), ``dense`` copies them."""
    return Geometry(
        tokens=tokens,
        heads_size=(tokens, spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim),
        heads_stride=(0, spec.head_dim, 1),
        storage_offset=0,
        split=(spec.num_heads, spec.num_kv_heads, spec.num_kv_heads),
        copy_rows=False,
        dense_tensors=dense,
        output_shape=torch.Size((tokens, spec.num_heads, spec.head_dim)),
        output_rows=(tokens, spec.q_width),
        output_dtype=spec.output_dtype,
        plain=False,
        grids=grids,
        batch=batch,
    )


def _batch_geometry(
    given: SeparateQKV,
    spec: AttentionSpec,
    params: FMHAParams,
    layout: InputLayout,
    accepts_rows: RowsRule,
    *,
    writes: bool,
) -> Geometry:
    """`separate_geometry` of batch-major input (`_batch_grid`). A plan that rotates q and k
    in place refuses it: rows made as a copy would be rotated, not the caller's tensors that
    a batch-major kernel reads."""
    if writes:
        raise fail(
            "batch-major [n, heads, L, D] q/k/v for a plan that applies RoPE/logn in place",
            "q/k/v as rows [rows, heads, D] (or the packed buffer) when the backend rotates, "
            "or q and k rotated before the call",
        )
    tensors = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], (given.q, given.k, given.v))
    heads = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
    grids = tuple(
        _batch_grid(name, t, n, spec, params)
        for name, t, n in zip("qkv", tensors, heads, strict=True)
    )
    dense = layout == "dense-tensors" or not all(
        grid.copied or accepts_rows(grid.of(t).flatten(1))
        for grid, t in zip(grids, tensors, strict=True)
    )
    three = cast(tuple[Grid, Grid, Grid], grids)
    return _views_geometry(spec, params.token_q_num, three, dense=dense, batch=True)


ADDRESS_CLASS = 256
"""Bytes: a read-only plan's memo sees an input's address through its power-of-two
alignment, up to this (every alignment rule a backend's ``accepts_rows`` states in practice:
flashinfer's is 16)."""


def alignment(address: int) -> int:
    """The largest power of two dividing ``address``, at most `ADDRESS_CLASS`."""
    return min(address & -address, ADDRESS_CLASS) if address else ADDRESS_CLASS


def separate_signature(
    given: SeparateQKV, *, writes: bool, addresses: bool = True
) -> tuple[object, ...] | None:
    """The memo key of a ``(q, k, v)`` input (None when one of them is no tensor).

    Everything the checks and the cut read: shapes, strides, offsets, dtypes, devices, and
    the addresses. A plan that writes q and k in place keys the addresses themselves (the
    aliasing rule compares them); a read-only one keys their alignment (`alignment`), all
    an alignment rule can see, and nothing of them when the kernel states no rule
    (``addresses=False``). So a model's new q/k/v tensors in every layer (fresh addresses,
    one geometry) are checked once per plan, not once per layer."""
    parts: list[object] = []
    for t in (given.q, given.k, given.v):
        if type(t) is not torch.Tensor:
            return None
        address = t.data_ptr()
        parts += (
            address if writes else alignment(address) if addresses else None,
            t.storage_offset(),
            t.shape,
            t.stride(),
            t.dtype,
            t.device,
        )
    return ("separate", writes, *parts)


def rotate_separate(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: AttentionSpec,
    params: FMHAParams,
    tables: PositionTables,
    rope_pass: RopePass | None = None,
) -> str:
    """RoPE on the valid rows of ``q`` and ``k`` and logn on ``q``, in place; returns the name
    of the pass that ran. The plan's pass runs when it takes separate tensors (the native
    kernel, flashinfer's: one launch, nothing allocated); otherwise the torch ops, with the
    plan's tables (built once per batch, never per layer)."""
    separate = rope_pass.apply_separate if rope_pass is not None else None
    if separate is not None and rope_pass is not None and separate(q, k, spec, params):
        return rope_pass.name
    tokens = params.token_q_num
    apply_rope_logn(q[:tokens], spec.num_heads, spec, tables)
    apply_rope_logn(k[:tokens], 0, spec, tables)
    return "torch"


def separate_note(tokens: int, *, certain: bool) -> str:
    was = "WAS MODIFIED" if certain else "MAY HAVE BEEN MODIFIED"
    return (
        f"the input {was}: RoPE/logn were applied in place to rows [0, {tokens}) of q and k; "
        "v and padding rows are untouched. Recompute q and k (or restore copies) before "
        "retrying or falling back"
    )


def packed_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ``[tokens, (Hq + 2*Hkv) * D]`` rows of separate views: a copy, made only for a
    kernel that reads packed rows."""
    return torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=1)
