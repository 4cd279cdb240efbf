"""One `BatchLayout` per batch, shared by every layer, never served to another batch.

The layers of one forward pass receive the same Python tensor that describes the batch (the
mask, ``cu_seq_lens`` or ``position_ids``), so the layout is keyed on that tensor. A stale hit
would mean another batch's lengths, which attention would accept silently; three checks rule
it out, all of them host-side and free of device syncs:

- **identity**: a weak reference to the tensor object itself (not its address: memory is
  reused by the next batch, and a freed object's ``id`` by the next object). A dead
  reference or another object is a miss.
- **version**: the tensor's in-place version counter, so a caller that rewrites the same
  buffer for the next batch misses. Inference-mode tensors have no counter, hence:
- **pass**: a per-thread counter that the mask function bumps at the start of every model
  forward (models build their masks once, before the first layer). Each forward starts fresh.

Geometry (shape, strides, device, data pointer) is part of the key as a cheap extra guard.
The cache is per thread, so concurrent forwards in other threads never see each other's
entries, and holds a few entries (one per mask kind a model builds, e.g. full and sliding).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from ._layout import BatchLayout

_ENTRIES = 4


class _State(threading.local):
    def __init__(self) -> None:
        self.forward_pass = 0
        self.entries: OrderedDict[Hashable, tuple[weakref.ref[torch.Tensor] | None, BatchLayout]]
        self.entries = OrderedDict()


_state = _State()


def new_forward_pass() -> None:
    """Called once per model forward (by the mask function): earlier layouts expire."""
    _state.forward_pass += 1
    _state.entries.clear()


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _signature(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.device, t.dtype, t.data_ptr(), _version(t))


def cached_layout(
    kind: str,
    source: torch.Tensor | None,
    extra: tuple[object, ...],
    build: Callable[[], BatchLayout],
) -> BatchLayout:
    """The layout of the batch ``source`` describes (None: ``extra`` alone describes it),
    built by ``build`` on a miss."""
    key: tuple[object, ...] = (kind, _state.forward_pass, extra)
    if source is not None:
        key = (*key, id(source), _signature(source))
    found = _state.entries.get(key)
    if found is not None:
        ref, layout = found
        if ref is None or ref() is source:
            _state.entries.move_to_end(key)
            return layout
    layout = build()
    _state.entries[key] = (weakref.ref(source) if source is not None else None, layout)
    while len(_state.entries) > _ENTRIES:
        _state.entries.popitem(last=False)
    return layout
