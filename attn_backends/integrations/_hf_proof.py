"""Mask proofs: a check of the model's own mask, passed once, kept as a value on the module.

The integration checks the mask a model builds against what the spec computes over the
batch's layout (`_hf_mask.check_mask`). When the model's mask function is built from
shift-free primitives (`_hf_mask_kinds.proof_signature`), one passed check proves every batch
of the same class: the same function signature, the same spec mask fields, and a layout whose
sequences those primitives see from their start. That class is a `MaskProof`, kept in the
attention module's ``__dict__``; a later batch of the class skips the evaluation, and the
drivers that never evaluate a mask per batch (`GraphRunner`) serve only the calls a proof of
their kind covers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._values._features import SlidingWindow
from .._values._spec import AttentionSpec
from ._hf_mask import MaskRequest
from ._layout import BatchLayout

__all__ = [
    "MaskProof",
    "mask_proof",
    "model_proofs",
    "positions_split_at",
    "proved",
    "proves",
    "remember",
]

_PROOFS = "_attn_backends_mask_proofs"
"""The attention module's set of `MaskProof` values: checks passed once per class."""
CLASSES = "_attn_backends_call_classes"
"""The attention module's resolved classes of call (the eager integration's ``_CallClass``):
a spec, a selection and whether whole rows are proved for the mask, by class key."""

LayoutKind = Literal["rows", "packed"]


@dataclass(frozen=True)
class MaskProof:
    """One class of mask check that passed: every batch of it computes the model's mask."""

    signature: tuple[object, ...]
    """The model's mask function as a value (`MaskRequest.proof`)."""
    reads: tuple[str, ...]
    """The roles of the tensors the function reads (``ids``: packed-sequence ids, ``positions``:
    remapped positions): each batch of the class has them agree with its sequences."""
    causal: bool
    window: SlidingWindow | None
    chunk_size: int | None
    kind: LayoutKind
    """``rows``: rows whose valid tokens are contiguous; ``packed``: one row of sequences."""

    def covers(self, spec: AttentionSpec) -> bool:
        """Whether the spec computes the mask this proof was passed for."""
        return (self.causal, self.window, self.chunk_size) == (
            spec.causal,
            spec.window,
            spec.chunk_size,
        )


def mask_proof(request: MaskRequest, layout: BatchLayout, spec: AttentionSpec) -> MaskProof | None:
    """The class of this batch's mask check, when one passed check proves every batch of it;
    None: this batch is checked in full."""
    if request.proof is None:
        return None
    kind: LayoutKind
    if layout.segments:
        if layout.batch != 1 or not _reads_match_segments(request.packed_ids, layout):
            return None
        kind = "packed"
    else:
        if request.packed_ids or not _contiguous(layout.valid):
            return None
        kind = "rows"
    reads = tuple(role for role, _ in request.packed_ids)
    return MaskProof(request.proof, reads, spec.causal, spec.window, spec.chunk_size, kind)


def proved(module: torch.nn.Module, proof: MaskProof) -> bool:
    """Whether a check of ``proof``'s class passed on ``module``."""
    kept: set[MaskProof] | None = module.__dict__.get(_PROOFS)
    return kept is not None and proof in kept


def remember(module: torch.nn.Module, proof: MaskProof) -> None:
    """Keep a passed check's class on ``module``."""
    module.__dict__.setdefault(_PROOFS, set()).add(proof)


def forget(module: torch.nn.Module) -> None:
    """Drop ``module``'s proofs, and the classes of call that hold one (whole rows proved):
    the next batch of every class is checked in full again."""
    module.__dict__.pop(_PROOFS, None)
    module.__dict__.pop(CLASSES, None)


def model_proofs(model: torch.nn.Module) -> frozenset[MaskProof]:
    """The proofs passed on any attention module of ``model``: a check passed once for a
    class is kept on the first module of a forward that ran it, and holds for every layer
    handed the same mask."""
    found: set[MaskProof] = set()
    for module in model.modules():
        kept: set[MaskProof] | None = module.__dict__.get(_PROOFS)
        if kept:
            found.update(list(kept))
    return frozenset(found)


def proves(proofs: frozenset[MaskProof], spec: AttentionSpec, *, several: bool) -> bool:
    """Whether one of ``proofs`` covers ``spec`` on one packed row holding several sequences
    (``several``: a proof of packed rows), or one sequence (either kind)."""
    return any(p.covers(spec) and (p.kind == "packed" or not several) for p in proofs)


def _contiguous(valid: torch.Tensor | None) -> bool:
    """Whether each row's valid tokens are one run (no padding between them)."""
    if valid is None:
        return True
    count = valid.sum(1)
    first = valid.int().argmax(1)
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)
    return bool(((last - first + 1 == count) | (count == 0)).all())


def positions_split_at(row: torch.Tensor, starts: list[int], *, strict: bool) -> bool:
    """Whether position ids ``row`` count up by one inside every sequence starting at
    ``starts`` (the first at 0); ``strict``: and break that count at every later start, as
    transformers finds packed sequences in them. A few tensor operations and one host read,
    whatever the row's length; positions that cannot count (bool, complex) do not."""
    return _positions_break_at(row, _boundary_mask(starts, row.shape[0], row.device), strict)


def _positions_break_at(row: torch.Tensor, boundary: torch.Tensor, strict: bool) -> bool:
    """`positions_split_at` against a `_boundary_mask` already made."""
    dtype = row.dtype
    if dtype == torch.bool or dtype.is_complex:
        return False
    breaks = row[1:] - row[:-1] != 1  # step i: i -> i + 1
    # strict: the breaks are the boundaries; else they are among them
    return torch.equal(breaks, boundary) if strict else torch.equal(breaks | boundary, boundary)


def _boundary_mask(starts: list[int], seq: int, device: torch.device) -> torch.Tensor:
    """bool ``[seq - 1]``: step ``i`` (token ``i`` to ``i + 1``) enters a sequence of
    ``starts`` (those past the first, inside the row), built on the host in one buffer."""
    steps = bytearray(max(0, seq - 1))
    for start in starts[1:]:
        if 0 < start < seq:
            steps[start - 1] = 1
    if not steps:
        return torch.zeros(0, dtype=torch.bool, device=device)
    mask = torch.frombuffer(steps, dtype=torch.bool)
    return mask if device.type == "cpu" else mask.to(device)


def _reads_match_segments(data: tuple[tuple[str, Any], ...], layout: BatchLayout) -> bool:
    """Whether the tensors the mask reads agree with the layout's sequences, over a row they
    tile: packed-sequence ids change exactly where a sequence starts, remapped positions count
    up by one within each sequence."""
    starts = [start for _, start, _ in layout.segments]
    if starts[0] != 0 or layout.segments[-1][2] != layout.seq:
        return False
    if any(a[2] != b[1] for a, b in itertools.pairwise(layout.segments)):
        return False
    boundary: torch.Tensor | None = None  # made once, for every tensor read
    for role, tensor in data:
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (1, layout.seq):
            return False
        row = tensor[0]
        if boundary is None or boundary.device != row.device:
            boundary = _boundary_mask(starts, layout.seq, row.device)
        if role == "ids":
            if not torch.equal(row[1:] != row[:-1], boundary):  # step i: i -> i + 1
                return False
        elif role == "positions":
            if not _positions_break_at(row, boundary, strict=False):
                return False
        else:
            return False
    return True
