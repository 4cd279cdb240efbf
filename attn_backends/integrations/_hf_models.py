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
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._values._errors import IntegrationError

__all__ = [
    "attention_layers",
    "model_name",
    "padding_blind_mixers",
    "position_offset",
    "refuse_bypassing_model",
    "refuse_in_attention_tables",
    "token_mixers_outside_attention",
]


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


def position_offset(model: Any) -> int:
    """Where a model's own position ids start: ``padding_idx + 1`` for RoBERTa-family
    embeddings (XLM-R, CamemBERT, ...), which number positions past the padding index, else
    0. Read from the model as transformers builds it: a module pairing an int
    ``padding_idx`` with a learned ``position_embeddings`` table (no 0-based or rotary model
    does)."""
    import torch

    for module in model.modules():
        # transformers' untyped modules: only RoBERTa-style embeddings carry both attributes
        padding_idx = getattr(module, "padding_idx", None)
        table = getattr(module, "position_embeddings", None)
        if isinstance(padding_idx, int) and isinstance(table, torch.nn.Embedding):
            return padding_idx + 1
    return 0


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


ATTENTION_LAYER_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``config.layer_types`` entries whose layer mixes tokens through the attention function
alone (which keeps packed sequences apart)."""
TOKENWISE_LAYER_KINDS = frozenset({"mlp", "moe"})
"""Entries whose layer does not mix tokens at all (NemotronH's MLP and MoE blocks)."""


_TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")
"""The attributes transformers' ``get_text_config()`` looks for a text sub-config under."""


_beyond_instance: dict[type, bool] = {}


def _names_beyond_instance(cls: type) -> bool:
    """Whether ``cls`` may answer one of `_TEXT_CONFIG_NAMES` other than from an instance's
    own ``__dict__`` (a class attribute or property, an ``attribute_map`` alias, its own
    ``get_text_config``): then only that method says which config is the text one. Once
    per config class."""
    found = _beyond_instance.get(cls)
    if found is None:
        from transformers import PretrainedConfig

        # what get_text_config() itself consults: the class's method, names and aliases
        aliases = getattr(cls, "attribute_map", None) or {}
        own_method = getattr(cls, "get_text_config", None) is not PretrainedConfig.get_text_config
        on_class = any(hasattr(cls, n) or n in aliases for n in _TEXT_CONFIG_NAMES)
        found = own_method or on_class
        _beyond_instance[cls] = found
    return found


def _text_config(config: Any) -> Any:
    # transformers' configs are untyped; a composite hands its text sub-config to the mask
    # helpers, but a few pass the outer one
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None and callable(getattr(config, "get_text_config", None)):
        own = getattr(config, "__dict__", None)
        if isinstance(own, dict) and not _names_beyond_instance(type(config)):
            # what get_text_config() reads, from the instance dict it would find it in
            found = [own[name] for name in _TEXT_CONFIG_NAMES if own.get(name) is not None]
            if len(found) <= 1:
                return found[0] if found else config
        try:
            return config.get_text_config()
        except ValueError as exc:  # several text configs (MusicGen: text_encoder and decoder)
            raise IntegrationError(
                f"{model_name(config)}: its config holds more than one text config, so which "
                f"one describes the attention layers is ambiguous (transformers: {exc}); "
                "attn_backends serves one self-attention stack per call: call the sub-model "
                "itself, or load it with attn_implementation='sdpa' or 'eager'"
            ) from exc
    return config


PADDING_BLIND_MIXERS = {"use_repmixer_blocks": "RepMixer convolutions (use_repmixer_blocks)"}
"""Config flags of token mixers that ``layer_types`` does not list and that read the padded
positions of a batch (Sam3-LiteText's depthwise convolutions): the attention output there is
the model's to define, and attn_backends leaves it at 0."""


def padding_blind_mixers(config: Any) -> tuple[str, ...]:
    """The token mixers of ``config`` that read padded positions (`PADDING_BLIND_MIXERS`)."""
    text = _text_config(config)
    # untyped config: the flags exist only on the models that have such mixers
    return tuple(what for flag, what in PADDING_BLIND_MIXERS.items() if getattr(text, flag, False))


def token_mixers_outside_attention(config: Any) -> tuple[str, ...]:
    """The kinds of ``config.layer_types`` that mix tokens by other means than the attention
    function (linear attention, gated delta rules, Mamba, RG-LRU, short convolutions, the
    ``hybrid`` attention-plus-SSM blocks) or that this library does not know: such layers
    run across the boundaries of packed sequences. Any kind not known to be attention or
    token-wise counts, so a new kind of mixer is refused rather than trusted."""
    layer_types = getattr(_text_config(config), "layer_types", None)  # untyped config
    kinds = dict.fromkeys(
        repr(str(kind)) for kind in (layer_types if isinstance(layer_types, (list, tuple)) else ())
    )
    known = {repr(k) for k in ATTENTION_LAYER_KINDS | TOKENWISE_LAYER_KINDS}
    return (*(k for k in kinds if k not in known), *padding_blind_mixers(config))


def attention_layers(config: Any) -> int | None:
    """How many attention calls one forward of a model of ``config`` makes at least: one per
    attention entry of ``layer_types``, else one per decoder layer (``num_hidden_layers``).
    None when the config says neither."""
    text = _text_config(config)
    layer_types = getattr(text, "layer_types", None)  # untyped config
    if isinstance(layer_types, (list, tuple)):
        return sum(str(kind) in ATTENTION_LAYER_KINDS for kind in layer_types)
    layers = getattr(text, "num_hidden_layers", None)
    return layers if isinstance(layers, int) and not isinstance(layers, bool) else None


@dataclass(frozen=True)
class ConfigFacts:
    """What the mask hook needs of a config, once per distinct content of the fields it reads
    (`config_facts`)."""

    model: str
    """The model class, for messages (`model_name`)."""
    mixers: tuple[str, ...]
    """`token_mixers_outside_attention`."""
    blind: tuple[str, ...]
    """`padding_blind_mixers`."""
    attention_layers: int | None
    """`attention_layers`."""


_FACTS_KEPT = 64
_facts: dict[tuple[object, ...], ConfigFacts] = {}


def config_facts(config: Any) -> ConfigFacts:
    """`ConfigFacts` of ``config``, kept by the content of every field they are read from (the
    config class, ``layer_types``, ``num_hidden_layers``, the padding-blind flags, of the text
    sub-config where the config has one): a config edited after loading gets its own."""
    key = _instance_key(config)
    if key is None:
        text = _text_config(config)
        layer_types = getattr(text, "layer_types", None)  # untyped config
        key = (
            type(config),
            tuple(str(k) for k in layer_types) if isinstance(layer_types, (list, tuple)) else None,
            _hashable(getattr(text, "num_hidden_layers", None)),  # a dict on a few (LXMERT)
            *(bool(getattr(text, flag, False)) for flag in PADDING_BLIND_MIXERS),
        )
    found = _facts.get(key)
    if found is None:
        found = ConfigFacts(
            model_name(config),
            token_mixers_outside_attention(config),
            padding_blind_mixers(config),
            attention_layers(config),
        )
        with _lock:
            if len(_facts) >= _FACTS_KEPT:
                _facts.clear()
            _facts[key] = found
    return found


def _hashable(value: object) -> object:
    """``value`` where it can be a key, else its repr (a config field's content either way)."""
    try:
        hash(value)
    except TypeError:
        return ("repr", type(value), repr(value))
    return value


_FACT_FIELDS = ("layer_types", "num_hidden_layers", *PADDING_BLIND_MIXERS)
_PLAIN_DEFAULTS = (type(None), bool, int, str, list, tuple)
"""Class defaults an instance read returns as they are (no descriptor among them)."""
_NOT_PLAIN = object()
_defaults: dict[type, tuple[object, ...] | object] = {}


def _instance_key(config: Any) -> tuple[object, ...] | None:
    """`config_facts`' key read from the instance dict (a transformers config's attribute
    reads go through two ``__getattribute__`` layers, a microsecond or two each), where that
    dict and the class's plain defaults are what those reads answer (`_class_defaults`), the
    config has no text sub-config and no per-layer (heterogeneous) fields. None: read them
    the slow way."""
    cls = type(config)
    defaults = _defaults.get(cls)
    if defaults is None:
        defaults = _defaults[cls] = _class_defaults(cls)
    if not isinstance(defaults, tuple):
        return None
    try:
        own = object.__getattribute__(config, "__dict__")
    except AttributeError:
        return None
    if own.get("_heterogeneity_spec") is not None:
        return None
    if any(own.get(name) is not None for name in _TEXT_CONFIG_NAMES):
        return None
    values = [own.get(n, d) for n, d in zip(_FACT_FIELDS, defaults, strict=True)]
    if isinstance(values[0], list):  # layer_types
        values[0] = tuple(values[0])
    return ("instance", cls, *map(_hashable, values))


def _class_defaults(cls: type) -> tuple[object, ...] | object:
    """The value a read of each of `_FACT_FIELDS` answers for an instance whose dict lacks it
    (a plain class attribute, else None), when the reads answer the instance dict first: no
    ``attribute_map`` alias, no descriptor (property) of those names, no ``get_text_config``
    of its own, no ``__getattr__`` fallback. `_NOT_PLAIN` otherwise. Once per config class."""
    import inspect

    aliases = getattr(cls, "attribute_map", None) or {}
    names = (*_FACT_FIELDS, *_TEXT_CONFIG_NAMES)
    if any(name in aliases for name in names) or _names_beyond_instance(cls):
        return _NOT_PLAIN
    if inspect.getattr_static(cls, "__getattr__", None) is not None:
        return _NOT_PLAIN
    found = [inspect.getattr_static(cls, name, None) for name in _FACT_FIELDS]
    if not all(isinstance(value, _PLAIN_DEFAULTS) for value in found):
        return _NOT_PLAIN  # a property, a method, or an object that may be one
    return tuple(found)


# --- models that pick their attention module from a table by implementation name ---------

_TABLE = re.compile(r"^([A-Z][A-Z0-9_]*_ATTENTION_CLASSES)\s*=\s*\{", re.MULTILINE)
_tables_found: list[tuple[str, str]] | None = None


def _attention_tables() -> list[tuple[str, str]]:
    """``(modeling module, table)`` for each modeling module of the installed transformers
    that defines a module-level ``*_ATTENTION_CLASSES = {...}`` table: read from the source
    text (no import), once per process."""
    global _tables_found
    with _lock:
        if _tables_found is not None:
            return list(_tables_found)
    import transformers

    root = Path(transformers.__file__).parent / "models"
    found: list[tuple[str, str]] = []
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "_ATTENTION_CLASSES" not in text:
            continue
        module = f"transformers.models.{path.parent.name}.{path.stem}"
        found.extend((module, m.group(1)) for m in _TABLE.finditer(text))
    with _lock:
        _tables_found = found
    return list(found)


def clear_model_caches() -> None:
    """Forget the model classes, registry verdicts, config facts and classes, and attention
    tables read so far, so that the next model asks transformers again (a module reloaded,
    remote code updated, tests)."""
    global _tables_found
    with _lock:
        _classes.clear()
        _bypassers.clear()
        _facts.clear()
        _beyond_instance.clear()
        _tables_found = None


class _RefusedAttention:
    """What a table of attention modules holds under the registered name: building a layer
    raises `IntegrationError` naming the model, at load, instead of transformers' KeyError."""

    table = ""

    def __init__(self, config: Any, *args: object, **kwargs: object) -> None:
        raise IntegrationError(
            f"{model_name(config)} picks its attention module by implementation name from "
            f"transformers' {self.table} (eager, sdpa, flash attention): it computes attention "
            "in its own modules, not through transformers' attention registry, so "
            f"attn_implementation={config._attn_implementation!r} cannot serve it; load it "
            "with attn_implementation='sdpa' or 'eager'"
        )


def refuse_in_attention_tables(name: str) -> None:
    """Make ``name`` a named refusal in every ``*_ATTENTION_CLASSES`` table of transformers.

    Falcon, GPT-Neo, Bark, GIT, SAM and a few vision models build each layer's attention as
    ``TABLE[config._attn_implementation](config, ...)``: with a registered name their load
    fails with ``KeyError`` inside transformers, which offers no hook before it (the attention
    and mask registries are consulted only at forward). The table gets an entry under ``name``
    whose construction raises `IntegrationError`. A table's module that does not import (an
    optional dependency missing) cannot build its model either, and is skipped.
    """
    for module_name, table_name in _attention_tables():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # any import failure: that model cannot load at all
            continue
        table = vars(module).get(table_name)
        if isinstance(table, dict) and name not in table:
            table[name] = type(
                f"AttnBackendsRefused_{table_name}", (_RefusedAttention,), {"table": table_name}
            )
