"""Which ``attn_implementation`` names run this library's attention function.

A model "loaded with the integration" holds, in ``config._attn_implementation``, a name that
transformers' attention registry maps to `transformers.attention_forward`, or to a pinned
``functools.partial`` of it (``register(backend=...)``), or to a graph runner's dispatcher
(which serves that same function outside its buckets). The sentence-transformers adapter and
the graph runner both refuse a model on anything else, by name.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .._values._errors import IntegrationError
from .transformers import attention_forward

__all__ = ["mark_ours", "require_ours", "require_still"]

_OURS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""Functions registered by this package that serve this library, held weakly: transformers'
registry keeps them alive, and a function it dropped leaves no id another one could reuse."""
_ours_lock = threading.Lock()


def mark_ours(function: Callable[..., Any]) -> None:
    """Record a function registered by this package that ends in `attention_forward`."""
    with _ours_lock:
        _OURS.add(function)


def clear_ours() -> None:
    """Forget every function `mark_ours` recorded (tests that register their own)."""
    with _ours_lock:
        _OURS.clear()


def _is_ours(function: object) -> bool:
    if function is attention_forward:
        return True
    if isinstance(function, functools.partial):
        return function.func is attention_forward
    try:
        with _ours_lock:
            return function in _OURS
    except TypeError:  # an unhashable callable someone else registered: not ours
        return False


def require_ours(model: Any, where: str) -> str:
    """``model``'s attention implementation name, or `IntegrationError` when that name does not
    run this library's attention (``where`` says what the caller wanted to do)."""
    from transformers import AttentionInterface

    name = model.config._attn_implementation
    if not _is_ours(AttentionInterface._global_mapping.get(name)):
        raise IntegrationError(
            f"{type(model).__name__} runs attn_implementation={name!r}, not this library's "
            f"attention, so {where} cannot serve it: load the model with "
            "attn_implementation=attn_backends.integrations.transformers.register() (or, for "
            "sentence-transformers, attn_backends.integrations.sentence_transformers.load())"
        )
    return str(name)


def require_still(model: Any, name: str, where: str) -> None:
    """`IntegrationError` unless ``model`` still runs attention implementation ``name``, the one
    ``where`` switched it to: a model switched to another implementation after wrapping must
    not keep running the wrapper's prepared path."""
    current = model.config._attn_implementation
    if current != name:
        raise IntegrationError(
            f"{type(model).__name__} was switched to attn_implementation={current!r} after "
            f"{where} switched it to {name!r}; call the model directly for {current!r}, or "
            f"set it back (model.set_attn_implementation({name!r})) to use {where}"
        )
