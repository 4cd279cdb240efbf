"""Which transformers models route their attention through the registry: transformers' own signal.

A model loaded with ``attn_implementation="attn_backends"`` only reaches this library if its
attention modules ask ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` for the function. Many
older architectures (MPNet, MegatronBERT, RoFormer, ConvBERT, I-BERT, LUKE, BigBird,
SqueezeBERT, BLOOM, MPT, Falcon, DeBERTa, ...) compute attention in their own modules, yet
transformers accepts the name and still calls the registered *mask* function for them, then
adds whatever it returns to their scores as if it were their own 4-D mask.

transformers answers the question itself: ``PreTrainedModel._can_set_attn_implementation()``
reads the modeling module's source and is False when the module defines an attention
``nn.Module`` that never asks the registry (``set_attn_implementation`` refuses to switch such
models). It is the same for every class of one modeling module, so the mask hook, which only
receives the model's config, can ask it of the classes built from that config class. Checked
against transformers 5.24's modeling code: every module that calls ``create_*_mask`` without
``get_interface`` answers False, except the composites that own no attention module and hand
the work to a sub-model (PaliGemma, Gemma 4 assistants), which the sub-model's own config
decides.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from .._model._errors import IntegrationError

__all__ = ["model_name", "refuse_bypassing_model"]


_classes: dict[type, tuple[Any, ...]] = {}
_bypassers: dict[type, str | None] = {}
_lock = threading.Lock()


def _model_classes(config_class: type) -> tuple[Any, ...]:
    with _lock:
        found = _classes.get(config_class)
    if found is None:
        found = _find_model_classes(config_class)
        with _lock:
            _classes[config_class] = found
    return found


def _find_model_classes(config_class: type) -> tuple[Any, ...]:
    """The transformers model classes built from ``config_class``: the auto mapping's entry
    and the classes of the matching modeling module (remote-code models included)."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    found: list[Any] = []
    try:
        mapped = MODEL_MAPPING[config_class]
    except (KeyError, ValueError):
        mapped = None
    if isinstance(mapped, type):
        found.append(mapped)
    module_name = config_class.__module__.replace(".configuration_", ".modeling_")
    if module_name != config_class.__module__:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if module is not None:
            for obj in vars(module).values():
                if (
                    isinstance(obj, type)
                    and issubclass(obj, PreTrainedModel)
                    and obj.__module__ == module_name
                    and obj.config_class is config_class
                    and obj not in found
                ):
                    found.append(obj)
    return tuple(found)


def model_name(config: Any) -> str:
    """The model class a config builds, for messages (the config class when unknown)."""
    classes = _model_classes(type(config))
    return classes[0].__name__ if classes else type(config).__name__


def _bypassing(config_class: type) -> str | None:
    """The first model class of ``config_class`` whose attention bypasses the registry."""
    with _lock:
        if config_class in _bypassers:
            return _bypassers[config_class]
    classes = _model_classes(config_class)
    name = next((str(c.__name__) for c in classes if not c._can_set_attn_implementation()), None)
    with _lock:
        _bypassers[config_class] = name
    return name


def refuse_bypassing_model(config: Any) -> None:
    """Raise `IntegrationError` when the model built from ``config`` computes attention in its
    own modules: the registered attention function would never run, and the mask hook's
    result would be added to its scores as if it were its own mask."""
    name = _bypassing(type(config))
    if name is not None:
        raise IntegrationError(
            f"{name} computes attention in its own modules, not through transformers' "
            "attention registry (transformers' _can_set_attn_implementation() is False for "
            f"it), so attn_implementation={config._attn_implementation!r} cannot serve it; "
            "load it with attn_implementation='sdpa' or 'eager'"
        )
