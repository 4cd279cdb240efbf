"""How a checked input is cut into the kernel's Q, K, V, decided once per buffer signature.

The checks on an input depend only on its geometry (address, shape, strides, dtype, device),
and so does how to cut it. `make_geometry` (packed buffer) and ``_separate.separate_geometry``
(``(q, k, v)``) decide both once; a plan's `BufferMemo` keeps the result per signature, so a
per-layer call on a buffer seen before pays for one dict lookup and two cheap tensor calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from .._values._spec import AttentionSpec

InputLayout = Literal["views", "dense-tensors", "dense-packed"]
"""How the kernel wants its input: strided views of the packed rows (no copy), dense Q/K/V
tensors, or the dense packed ``[tokens, (Hq + 2*Hkv) * D]`` rows (copied only if strided)."""

RowsRule = Callable[[torch.Tensor], bool]
"""A backend's alignment rule on the rows it reads (``accepts_rows``)."""

Signature = tuple[object, ...]


@dataclass(frozen=True, eq=False)
class Grid:
    """One separate input tensor seen as ``[rows, heads, D]``: ``t.as_strided(size, stride,
    offset)`` rebuilds the checked view from the tensor as given."""

    size: tuple[int, int, int]
    stride: tuple[int, int, int]
    offset: int
    given: bool = False
    """The tensor as given already is this view (``[rows, heads, D]``, same strides): used as
    it is (the signature it was learned under fixes its shape, strides and offset)."""
    copied: bool = False
    """A batch-major ``[n, heads, L, D]`` tensor whose rows no strided view reaches (each
    token's heads apart in memory, or rows of sequences apart): its rows are a dense copy."""

    def of(self, t: torch.Tensor) -> torch.Tensor:
        if self.given:
            return t
        if self.copied:
            return t.transpose(1, 2).reshape(self.size)
        return t.as_strided(self.size, self.stride, self.offset)


@dataclass(frozen=True, eq=False)
class Geometry:
    """How to cut one checked input signature into the kernel's input, decided once.

    Packed input: ``heads`` views the valid rows as ``[tokens, Hq + 2*Hkv, D]`` (one
    ``as_strided``), and ``split`` cuts that into Q, K, V (one ``split_with_sizes``): two
    cheap calls per layer. Separate input: ``grids`` rebuild the three checked views.
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
    """Hand Q, K, V over as separate dense tensors (``needs_contiguous``, or separate tensors
    the alignment rule refuses)."""
    output_shape: torch.Size
    output_rows: tuple[int, int]
    """``(tokens, Hq * D)``: what ``forward`` returns. Plain ints: ``view`` parses them in a
    third of the time it takes for a ``torch.Size``."""
    output_dtype: torch.dtype
    plain: bool
    """Packed views only, no FP8: the per-layer call cuts the buffer inline."""
    grids: tuple[Grid, Grid, Grid] | None = None
    """Separate ``(q, k, v)`` input: the checked ``[rows, heads, D]`` views (None: packed)."""
    batch: bool = False
    """Separate input given batch-major, ``[n, heads, L, D]`` each for ``n`` sequences of
    ``L`` tokens: the kernel may read those tensors as they are (`QKVViews.batch`), and its
    rows are made only if it reads them."""


class BufferMemo:
    """Input signatures a plan has checked, and what the checks concluded.

    An engine's layer loop hands ``forward`` a new QKV tensor per layer, and the caching
    allocator serves those from a few blocks in turn, so the memo keeps up to `MEMO_SLOTS`
    signatures (the oldest is dropped first). An entry holds integers, sizes and a
    `Geometry`, never a tensor: it keeps no memory alive. Each lookup and store is one dict
    operation, so concurrent forwards on one plan never see a signature paired with another
    buffer's geometry; at worst a racing store is checked again.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[Signature, Geometry] = {}

    def get(self, signature: Signature) -> Geometry | None:
        return self._entries.get(signature)

    def put(self, signature: Signature, geometry: Geometry) -> None:
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


def buffer_signature(packed: torch.Tensor) -> Signature:
    """What the geometric checks depend on: equal signatures pass or fail them alike.
    (``forward`` builds the same tuple inline for the packed buffer: keep the two alike.)"""
    return (
        packed.data_ptr(),
        packed.storage_offset(),
        packed.shape,
        packed.stride(),
        packed.dtype,
        packed.device,
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


def make_geometry(
    packed: torch.Tensor,
    spec: AttentionSpec,
    tokens: int,
    layout: InputLayout,
    accepts_rows: RowsRule,
) -> Geometry:
    """The `Geometry` of a checked packed buffer whose first ``tokens`` rows reach the kernel."""
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


def cut(packed: torch.Tensor, geo: Geometry) -> tuple[torch.Tensor, ...]:
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
