"""Where a framework batch's valid tokens are, worked out once per batch for every layer.

A model hands attention ``[B, S, ...]`` tensors. The kernels take packed rows of valid tokens,
so each batch needs: the sequence lengths (for `FMHAParams`) and, when the batch carries
padding, which ``(row, column)`` cells hold the valid tokens, in order. Nothing here knows a
framework; `attn_backends.integrations.transformers` decides which source describes the batch.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .._backend._protocol import NoCachePrefill
from .._values._errors import IntegrationError
from .._values._params import FMHAParams
from .._values._spec import AttentionSpec


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """The valid tokens of one ``[batch, seq]`` batch and the plans prepared for it."""

    batch: int
    seq: int
    params: FMHAParams
    cells: tuple[torch.Tensor, torch.Tensor] | None
    """``(row, column)`` int64 indices of the valid tokens in order, or None when every cell
    is valid (the rows are used as they are, no gather)."""
    valid: torch.Tensor | None = None
    """``[batch, seq]`` bool, the valid cells, when a row holds one sequence with padding
    around or inside it; None when every cell is valid."""
    segments: tuple[tuple[int, int, int], ...] = ()
    """``(row, start, stop)`` of each sequence when rows are packed with several sequences;
    empty when each row is one sequence (see ``valid``)."""
    plans: dict[Hashable, tuple[object, object]] = field(default_factory=dict)
    """``(backend, plan)`` per backend and spec: layers of one spec on one backend share the
    plan; the backend object is kept to check that its id is still its own."""


def _layout(
    lengths: Sequence[int],
    batch: int,
    seq: int,
    device: torch.device,
    cells: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    valid: torch.Tensor | None = None,
    segments: tuple[tuple[int, int, int], ...] = (),
) -> BatchLayout:
    params = FMHAParams.from_lengths([n for n in lengths if n > 0], device=device)
    return BatchLayout(batch, seq, params, cells, valid, segments)


def _packed(
    bounds: Sequence[tuple[int, int]], batch: int, seq: int, device: torch.device
) -> BatchLayout:
    """Sequences at flat ``[start, stop)`` token ranges of the ``batch x seq`` rows."""
    segments = tuple((a // seq, a % seq, a % seq + (b - a)) for a, b in bounds if b > a)
    if len(segments) == batch:
        return full_rows(batch, seq, device)
    return _layout([b - a for a, b in bounds], batch, seq, device, None, segments=segments)


@functools.lru_cache(maxsize=16)
def full_rows(batch: int, seq: int, device: torch.device) -> BatchLayout:
    """Each of the ``batch`` rows is one whole sequence of ``seq`` tokens. The layout depends
    on the shape alone, so it is made once and shared by every batch, model and thread of that
    shape, with the plans prepared on it (``plans``: read and written under a lock, see
    `prepared_plan`); `clear_layouts` drops them."""
    return _layout([seq] * batch, batch, seq, device, None)


def from_padding_mask(mask: torch.Tensor) -> BatchLayout:
    """``mask [B, S]`` (True or non-zero: a real token), right, left or any padding. The
    valid tokens of a row form one sequence, in their order (what the model's own causal and
    padding masks mean for those tokens)."""
    if mask.dim() != 2:
        raise IntegrationError(
            f"a padding mask must be [batch, seq], got shape {tuple(mask.shape)}"
        )
    valid = mask if mask.dtype == torch.bool else mask != 0
    batch, seq = valid.shape
    lengths = valid.sum(dim=1).tolist()
    if sum(lengths) == batch * seq:
        return full_rows(batch, seq, mask.device)
    if sum(lengths) == 0:
        raise IntegrationError("the attention mask marks no token as valid; pass a real batch")
    rows, cols = valid.nonzero(as_tuple=True)
    return _layout(lengths, batch, seq, mask.device, (rows, cols), valid=valid)


def cu_seqlens_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """The prefix sums as ints, once checked to be what transformers and `pack_sequences`
    pass: a 1-D integer tensor on a device that holds values (a float would be truncated)."""
    if not _integer_vector(cu_seqlens):
        raise IntegrationError(
            f"cu_seq_lens must be a 1-D integer tensor of prefix sums (int32, as "
            f"pack_sequences makes them); got {cu_seqlens.dim()}-D {cu_seqlens.dtype}"
        )
    if cu_seqlens.device.type == "meta":
        raise IntegrationError(
            "cu_seq_lens are on the meta device, which holds no values to split the batch by; "
            "pass them on the CPU or the model's device"
        )
    return [int(x) for x in cu_seqlens.tolist()]


def _integer_vector(t: torch.Tensor, dims: int = 1) -> bool:
    dtype = t.dtype
    return t.dim() == dims and not (
        dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
    )


def check_position_ids(position_ids: object, tokens: int) -> torch.Tensor:
    """``position_ids`` of one packed row of ``tokens`` tokens: an integer ``[1, tokens]``
    tensor (a ``[1, 1]`` one would broadcast over the row)."""
    if (
        not isinstance(position_ids, torch.Tensor)
        or not _integer_vector(position_ids, dims=2)
        or tuple(position_ids.shape) != (1, tokens)
    ):
        got = (
            f"{tuple(position_ids.shape)} {position_ids.dtype}"
            if isinstance(position_ids, torch.Tensor)
            else type(position_ids).__name__
        )
        raise IntegrationError(
            f"position_ids must be an integer tensor [1, {tokens}], one position per packed "
            f"token; got {got}"
        )
    return position_ids


def from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> BatchLayout:
    """Packed input: one row (``batch == 1``) holding the sequences that ``cu_seqlens``
    (prefix sums, ``[n + 1]``, an integer tensor on a real device) delimit."""
    bounds = cu_seqlens_bounds(cu_seqlens)
    if batch != 1:
        raise IntegrationError(
            f"cu_seq_lens describe one packed row, but the batch has {batch} rows; pack every "
            "sequence into one row (batch size 1) or pass a padding mask instead"
        )
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq:
        raise IntegrationError(
            f"cu_seq_lens must start at 0 and end at the packed length {seq}; got {bounds[:4]}"
            f"{'...' if len(bounds) > 4 else ''} ending at {bounds[-1] if bounds else None}"
        )
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise IntegrationError("cu_seq_lens must be non-decreasing prefix sums of the lengths")
    return _packed_bounds(tuple(bounds), batch, seq, cu_seqlens.device)


@functools.lru_cache(maxsize=16)
def _packed_bounds(
    bounds: tuple[int, ...], batch: int, seq: int, device: torch.device
) -> BatchLayout:
    """The layout of checked prefix sums: a value of them, the shape and the device, so it is
    made once and shared (with its plans, see `full_rows`) by every batch of the same
    boundaries: the mask kinds of one forward, and a batch of lengths seen before. Few are
    kept: each holds its plans (a flashinfer plan its leased wrapper) until dropped."""
    return _packed(list(itertools.pairwise(bounds)), batch, seq, device)


def clear_layouts() -> None:
    """Drop the shared layouts (`full_rows`, `from_cu_seqlens`) and the plans prepared on
    them: they keep their backends, and those backends' memory, alive."""
    full_rows.cache_clear()
    _packed_bounds.cache_clear()


def from_position_ids(position_ids: torch.Tensor, batch: int, seq: int) -> BatchLayout:
    """Sequences packed into rows, each starting where the positions stop counting up by one
    (a restart at 0, or at a model's position offset). Every row starts a sequence."""
    flat = position_ids.expand(batch, seq).reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    if flat.numel() > 1:
        starts[1:] = flat[1:] != flat[:-1] + 1
    starts.view(batch, seq)[:, 0] = True
    begin = starts.nonzero().reshape(-1).tolist()
    ends = [*begin[1:], batch * seq]
    return _packed(list(zip(begin, ends, strict=True)), batch, seq, position_ids.device)


def dense_heads(rows: torch.Tensor) -> torch.Tensor:
    """``rows [T, H, D]`` with each token's heads dense, as the backends read them: the rows
    themselves when they already are (a view of a packed projection), else a copy."""
    if rows.stride(-1) != 1 or (rows.shape[1] > 1 and rows.stride(1) != rows.shape[2]):
        return rows.contiguous()
    return rows


def prepared_plan(
    plans: dict[Hashable, tuple[object, object]],
    lock: threading.Lock,
    backend: NoCachePrefill,
    spec: AttentionSpec,
    params: FMHAParams,
) -> object:
    """``backend``'s plan for ``spec`` on ``params``, prepared once per batch and kept in
    ``plans`` (guarded by ``lock``): outside the lock, since a kernel plan may take
    milliseconds, and the first one stored is the one every layer uses. The backend is kept
    with its plan to check that its id is still its own."""
    key = (id(backend), spec)
    with lock:
        found = plans.get(key)
    if found is not None and found[0] is backend:
        return found[1]
    plan = backend.prepare(params)
    with lock:
        found = plans.get(key)
        if found is None or found[0] is not backend:
            found = plans[key] = (backend, plan)
    return found[1]
