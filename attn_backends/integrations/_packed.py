"""Packed model input (sequences back to back in one row) and reading its output back.

A packed row only means separate sequences if every attention layer keeps them apart. A model
that never calls the registered attention function (DeBERTa, MPNet, ...) or drops the
``cu_seq_lens``/``position_ids`` kwargs on the way to its attention layers lets them attend
to each other, and nothing in its forward reaches this library to object. So the boundaries
are checked where the packed output is read: the attention function marks the boundary
tensors it served (``cu_seq_lens_q`` or the restarting ``position_ids``, and the
``cu_seq_lens`` that `pack_sequences` made alongside them), and `unpack_hidden` refuses
boundaries that no attention layer read.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar

import torch

from .._values._errors import IntegrationError

__all__ = ["PackedBatch", "check_served", "mark_served", "pack_sequences", "unpack_hidden"]

_T = TypeVar("_T")


class PackedBatch(TypedDict):
    """Keyword arguments of one packed forward: ``model(**packed)``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_q: int
    max_length_k: int
    use_cache: bool
    """False: the prefill needs no cache. A decoder whose config keeps ``use_cache=True``
    (Qwen3-Embedding's does) would build one, and with a cache transformers reads the packed
    row as one sequence."""


class _Tracked(Generic[_T]):
    """Tensors by identity, each with a value (a weak reference each, dropped with the
    tensor)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref[torch.Tensor], _T | None]] = {}
        self._lock = threading.RLock()
        """Reentrant: a tensor's weakref callback takes it, and the garbage collector may run
        that callback on a thread that already holds it (inside `put`)."""

    def put(self, t: torch.Tensor, partner: _T | None = None) -> None:
        key = id(t)

        def forget(_: object, key: int = key) -> None:
            with self._lock:
                self._items.pop(key, None)

        with self._lock:
            self._items[key] = (weakref.ref(t, forget), partner)

    def get(self, t: torch.Tensor) -> tuple[bool, _T | None]:
        entry = self._items.get(id(t))
        if entry is None or entry[0]() is not t:
            return False, None
        return True, entry[1]


@dataclass
class _Served:
    calls: int
    """Attention calls of the latest forward that read the boundaries."""
    expected: int | None
    """Attention calls that forward should have made (its model's attention layers), if
    known."""
    epoch: int
    """The newest mask-hook serial when that forward's first attention call came."""

    @property
    def complete(self) -> bool:
        return self.expected is None or self.calls >= self.expected


_served: _Tracked[_Served] = _Tracked()
"""Boundary tensors an attention layer has read, and how many layers of one forward did."""
_partners: _Tracked[torch.Tensor] = _Tracked()
"""``position_ids`` made by `pack_sequences` -> the ``cu_seq_lens`` made with them."""


def mark_served(
    boundaries: torch.Tensor,
    *,
    request: int | None = None,
    newest: int = 0,
    expected: int | None = None,
) -> None:
    """Called by the attention function for the tensor that gave a packed batch its layout.

    ``request`` is the serial of the mask-hook call behind this attention call (None without
    one), ``newest`` the newest serial issued, ``expected`` the attention calls the model's
    forward makes. Calls are counted per forward, across its mask kinds (a model with local
    and global layers asks the hook twice): a request newer than the forward being counted
    starts the next forward.
    """
    targets = [boundaries]
    found, partner = _partners.get(boundaries)
    if found and partner is not None:
        targets.append(partner)
    for t in targets:
        _, before = _served.get(t)
        if request is None:
            _served.put(t, _Served(1, None, 0))
        elif before is None or request > before.epoch:
            _served.put(t, _Served(1, expected, newest))
        else:
            before.calls += 1
            before.expected = expected


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    *,
    device: torch.device | str | None = None,
    position_offset: int = 0,
) -> PackedBatch:
    """One packed model input: every sequence back to back in a single row, no padding.

    Returns ``input_ids``/``position_ids`` ``[1, T]`` (positions restart at
    ``position_offset`` per sequence: 0 for most models, ``pad_token_id + 1`` for RoBERTa-style
    embeddings), ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 prefix sums) and
    ``max_length_q``/``max_length_k`` and ``use_cache=False``; pass them all as keyword
    arguments to the model.
    """
    if isinstance(position_offset, bool) or not isinstance(position_offset, int):
        raise IntegrationError(f"position_offset must be an int, got {position_offset!r}")
    if position_offset < 0:
        raise IntegrationError(f"position_offset must be >= 0, got {position_offset}")
    if not sequences or any(len(s) == 0 for s in sequences):
        raise IntegrationError("pack_sequences needs at least one sequence, none of them empty")
    flat = [t for s in sequences for t in s]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in flat):
        raise IntegrationError("pack_sequences takes token ids: non-negative ints")
    lengths = [len(s) for s in sequences]
    ids = torch.tensor(flat, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]) + position_offset
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    position_ids = positions[None].to(device)
    _partners.put(position_ids, cu)
    return PackedBatch(
        input_ids=ids[None],
        position_ids=position_ids,
        cu_seq_lens_q=cu,  # one tensor for q and k: equal by construction
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
        use_cache=False,
    )


def unpack_hidden(hidden: torch.Tensor, cu_seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """The per-sequence ``[n_i, C]`` slices (views) of a packed output ``hidden [1, T, C]``.

    Raises `IntegrationError` when ``cu_seq_lens`` do not cover exactly the ``T`` tokens
    (0 first, non-decreasing, ``T`` last), or when a batch of several sequences had its
    boundaries read by no attention layer (or by fewer than all of them): then the model let the
    sequences attend to each other. One sequence has no boundary to cross, so it is not asked.
    """
    bounds = _served_bounds(hidden, cu_seq_lens)
    if len(bounds) == 2:
        return [hidden[0]]  # one sequence: no boundary that attention could have crossed
    return [hidden[0, a:b] for a, b in itertools.pairwise(bounds)]


def check_served(hidden: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """`unpack_hidden`'s checks without the slices, for callers that keep the packed output.
    A batch of one sequence is decided from the tensor's shape, without reading its values (a
    device sync): it has no boundary to check."""
    if cu_seq_lens.numel() > 2:
        _served_bounds(hidden, cu_seq_lens)


def _served_bounds(hidden: torch.Tensor, cu_seq_lens: torch.Tensor) -> list[int]:
    """The prefix sums as ints, once checked to split ``hidden [1, T, C]`` and, for several
    sequences, to have been served by every attention layer (`unpack_hidden` says which
    errors)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] != 1:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise IntegrationError(
            f"unpack_hidden takes a packed [1, tokens, channels] output, got {shape}"
        )
    if (
        not isinstance(cu_seq_lens, torch.Tensor)
        or cu_seq_lens.dim() != 1
        or cu_seq_lens.dtype.is_floating_point
        or cu_seq_lens.dtype == torch.bool
    ):
        raise IntegrationError(
            "unpack_hidden takes cu_seq_lens as a 1-D integer tensor (pack_sequences' "
            "cu_seq_lens_q)"
        )
    bounds = [int(x) for x in cu_seq_lens.tolist()]
    tokens = int(hidden.shape[1])
    if (
        len(bounds) < 2
        or bounds[0] != 0
        or bounds[-1] != tokens
        or any(b < a for a, b in itertools.pairwise(bounds))
    ):
        raise IntegrationError(
            f"cu_seq_lens {bounds[:6]}{'...' if len(bounds) > 6 else ''} do not split the "
            f"{tokens} packed tokens: they must start at 0, never decrease and end at {tokens}"
        )
    if len(bounds) == 2:
        return bounds  # one sequence: no boundary that attention could have crossed
    found, served = _served.get(cu_seq_lens)
    if not found and cu_seq_lens.device != hidden.device:
        raise IntegrationError(
            f"these cu_seq_lens are on {cu_seq_lens.device} and the hidden states on "
            f"{hidden.device}: the model was called with a copy, which is another tensor, so "
            "whether its attention layers kept the sequences apart cannot be told from them. "
            "Pack on the model's device (pack_sequences(..., device=...)) and pass the "
            "cu_seq_lens the model received"
        )
    if not found:
        raise IntegrationError(
            "no attention layer served these cu_seq_lens: the model never ran its attention "
            "through attn_backends on this packed batch (it computes attention in its own "
            "modules, or does not pass cu_seq_lens/position_ids to its attention layers), so "
            "its sequences attended to each other. Run such a model on a padded batch instead"
        )
    if served is not None and not served.complete:
        raise IntegrationError(
            f"only {served.calls} attention calls of the model's {served.expected} attention "
            "layers read these cu_seq_lens: its other layers mix tokens by other means (linear "
            "attention, state-space or recurrent blocks, convolutions) or run attention "
            "outside attn_backends, across the packed sequences' boundaries. Run such a model "
            "on a padded batch instead"
        )
    return bounds
