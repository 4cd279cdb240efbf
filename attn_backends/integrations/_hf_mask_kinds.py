"""Which mask functions a model hands over can be evaluated by broadcasting instead of vmap.

transformers composes a layer's mask from primitives it ships (`causal_mask_function`,
`sliding_window_overlay`, `padding_mask_function`, `packed_sequence_mask_function`, ...) joined
by `and_masks` / `or_masks`, and switches its own evaluation to `torch.vmap` as soon as a model
adds a function of its own, because such a function may not accept index tensors. vmap costs
milliseconds of host time per evaluation, most of a small forward on a CPU (EmbeddingGemma: 2.7
of 2.8 ms per layer call).

The primitives are written with broadcasting tensor ops, so transformers' non-vmap path
(index tensors ``[B,1,1,1]``, ``[1,1,Q,1]``, ``[1,1,1,K]``) evaluates them exactly. Here a
function is recognised by its code object, walking the closures of the composing functions; a
tree whose every node is recognised is evaluated that way. Anything not recognised keeps the
vmap path: a function this module does not know is never assumed to broadcast.

Recognised beyond `transformers.masking_utils`: a closure-free function whose code names only
``torch.tensor`` and ``torch.bool`` (it returns a constant: Gemma 3's bidirectional
``or_mask_function``), and Gemma 3's ``_bidirectional_window_overlay``.
"""

from __future__ import annotations

import dis
import functools
import types
from typing import Any

__all__ = [
    "Data",
    "Signature",
    "broadcastable",
    "clear_caches",
    "proof_signature",
    "recognised_codes",
]

_CONSTANT_NAMES = frozenset({"torch", "tensor", "bool"})
"""The names a constant mask function may use (Gemma 3's or-mask:
``lambda *a: torch.tensor(True, dtype=torch.bool)``)."""
_READS_LOCALS = ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_NAME")
"""Instructions that read a local, a cell or a name looked up at run time."""
_COMPOSING = ("mask_functions", "mask_function")
"""Closure variables through which a recognised function reaches the functions it composes."""


Code = types.CodeType


@functools.cache
def _codes_by_name() -> dict[str, types.CodeType]:
    """The code objects of the mask primitives transformers ships (and Gemma 3's window
    overlay), by factory name, found by building each one once. A transformers release
    without one simply has fewer."""
    import torch
    from transformers import masking_utils as mu

    index = torch.zeros(1, 1, dtype=torch.long)
    builders: list[tuple[str, tuple[object, ...]]] = [
        ("and_masks", ()),
        ("or_masks", ()),
        ("causal_mask_function", ()),
        ("bidirectional_mask_function", ()),
        ("sliding_window_overlay", (1,)),
        ("sliding_window_bidirectional_overlay", (1,)),
        ("chunked_overlay", (1, index[0])),
        ("blockwise_overlay", (index,)),
        ("padding_mask_function", (index.bool(),)),
        ("packed_sequence_mask_function", (index,)),
        ("remap_positions_for_packed_sequence", (mu.causal_mask_function, index)),
        ("add_offsets_to_mask_function", (mu.causal_mask_function, 0, 0)),
    ]
    shipped = vars(mu)
    codes: dict[str, types.CodeType] = {}
    for name, args in builders:
        factory = shipped.get(name)
        if callable(factory):
            built = factory(*args) if args or name.endswith("masks") else factory
            codes[name] = built.__code__
    try:
        from transformers.models.gemma3 import modeling_gemma3

        codes["gemma3_window"] = modeling_gemma3._bidirectional_window_overlay(1).__code__
    except (ImportError, AttributeError):
        pass
    return codes


@functools.cache
def recognised_codes() -> frozenset[types.CodeType]:
    """Every recognised code object (`_codes_by_name`), for `broadcastable`."""
    return frozenset(_codes_by_name().values())


def clear_caches() -> None:
    """Forget the recognised codes: the next use builds them again (a transformers module
    replaced under a running process, tests)."""
    _codes_by_name.cache_clear()
    recognised_codes.cache_clear()
    _constant_code.cache_clear()
    _roles.cache_clear()
    _leaf_signature.cache_clear()


def _constant(function: types.FunctionType) -> bool:
    """A function that cannot depend on its arguments: no closure, no nested code, it reads no
    local variable (its arguments included), and the only globals and attributes it names are
    ``torch.tensor`` and ``torch.bool``."""
    return not function.__closure__ and _constant_code(function.__code__)


@functools.lru_cache(maxsize=256)
def _constant_code(code: types.CodeType) -> bool:
    """`_constant`'s reading of a code object (a value: read once per code, not per call)."""
    if not set(code.co_names) <= _CONSTANT_NAMES:
        return False
    if any(isinstance(c, types.CodeType) for c in code.co_consts):
        return False
    return not any(i.opname.startswith(_READS_LOCALS) for i in dis.get_instructions(code))


def _composed(function: types.FunctionType) -> list[object] | None:
    """The functions a recognised composing function closes over, or None when it closes over
    no function (a leaf)."""
    names = function.__code__.co_freevars
    cells = function.__closure__ or ()
    out: list[object] = []
    for name, cell in zip(names, cells, strict=True):
        if name not in _COMPOSING:
            continue
        value = cell.cell_contents
        out.extend(value if isinstance(value, tuple) else (value,))
    return out or None


def broadcastable(function: object, *, depth: int = 0) -> bool:
    """Whether transformers' non-vmap evaluation computes ``function`` exactly: every function
    in its tree is a recognised primitive or a constant."""
    if depth > 32 or not isinstance(function, types.FunctionType):
        return False
    if _constant(function):
        return True
    if function.__code__ not in recognised_codes():
        return False
    inner = _composed(function)
    return inner is None or all(broadcastable(f, depth=depth + 1) for f in inner)


@functools.cache
def _roles() -> tuple[
    frozenset[types.CodeType],
    frozenset[types.CodeType],
    types.CodeType | None,
    types.CodeType | None,
]:
    """The codes whose masks depend on the query and key only through ``q - k`` (shift-free),
    the composing ones (``and_masks``/``or_masks``), ``packed_sequence_mask_function``'s, and
    ``remap_positions_for_packed_sequence``'s (None in a release without one)."""
    codes = _codes_by_name()
    shift_free = (
        "causal_mask_function",
        "bidirectional_mask_function",
        "sliding_window_overlay",
        "sliding_window_bidirectional_overlay",
        "gemma3_window",
    )
    return (
        frozenset(codes[n] for n in shift_free if n in codes),
        frozenset(codes[n] for n in ("and_masks", "or_masks") if n in codes),
        codes.get("packed_sequence_mask_function"),
        codes.get("remap_positions_for_packed_sequence"),
    )


Signature = tuple[object, ...]
Data = tuple[str, Any]
"""A tensor a recognised mask function reads, by role: ``("ids", packed-sequence ids)`` or
``("positions", position ids)``; each batch checks it against its layout."""


def proof_signature(function: object, *, depth: int = 0) -> tuple[Signature, list[Data]] | None:
    """What a mask function is, as a value, when it is built from shift-free primitives (with
    packed-sequence ids, and positions remapped per packed sequence), with the tensors it
    reads; None for anything else.

    Two functions with one signature compute one mask on every batch whose ids are the
    layout's sequences and whose positions count up by one within each, and the mask of a
    sequence does not depend on where it starts: so the check of the model's mask against the
    library's, passed once for a signature and a spec, holds for every such batch
    (`transformers._mask_proof`)."""
    if depth > 32 or not isinstance(function, types.FunctionType):
        return None
    if function.__closure__ is None:  # a module-level function: its code says it all
        leaf = _leaf_signature(function.__code__)
        return None if leaf is None else (leaf, [])
    if _constant(function):
        return (function.__code__,), []
    shift_free, composing, packed, remapped = _roles()
    code = function.__code__
    closure = function.__closure__ or ()
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=True))
    if code in composing:
        parts: list[Signature] = []
        data: list[Data] = []
        for inner in cells.get("mask_functions", ()):
            found = proof_signature(inner, depth=depth + 1)
            if found is None:
                return None
            parts.append(found[0])
            data += found[1]
        return (code, tuple(parts)), data
    if packed is not None and code == packed:
        return (code,), [("ids", cells.get("packed_sequence_mask"))]
    if remapped is not None and code == remapped:
        inner_found = proof_signature(cells.get("mask_function"), depth=depth + 1)
        if inner_found is None or inner_found[1]:
            return None  # only a shift-free function of positions is proved
        return (code, inner_found[0]), [("positions", cells.get("position_ids"))]
    if code in shift_free and all(
        isinstance(v, (int, float, bool)) or v is None for v in cells.values()
    ):
        return (code, tuple(sorted(cells.items()))), []
    return None


@functools.lru_cache(maxsize=256)
def _leaf_signature(code: types.CodeType) -> Signature | None:
    """`proof_signature` of a function without a closure (transformers' module-level
    ``causal_mask_function``, ``bidirectional_mask_function``): a value of its code alone, read
    once per code, not once per forward. It reads no tensor: a closure is where one would be."""
    if _constant_code(code):
        return (code,)
    if code in _roles()[0] and not code.co_freevars:
        return (code, ())
    return None
