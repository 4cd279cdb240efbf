"""Which transformers model classes the zoo runs, and why the others are not applicable.

The candidates are read from transformers' own Auto mappings (``MODEL_MAPPING_NAMES``: model
type -> base model class), never hand-listed. A class is in the zoo when it takes text
(``input_ids``), is not an encoder-decoder, takes no other modality and has attention heads;
every other class gets the first rule it fails as its reason. Several model types share one
class (a checkpoint family converted to Llama, say): each class appears once, under the model
type of its own ``config_class``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Sequence
from typing import Any

import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto import modeling_auto

# Inputs of other modalities: a class whose forward takes one of them is multimodal.
OTHER_MODALITY_INPUTS = (
    "pixel_values",
    "pixel_values_videos",
    "input_features",
    "input_values",
    "audio_values",
    "past_values",
)
# Classes whose forward needs a non-text input it declares optional (found by running them).
NEEDS = {"BrosModel": "bbox (a layout model: a bounding box for every token)"}
# Auto mappings of text tasks: a model type listed under one of them reads text; one listed
# only under other tasks (image modelling, speech synthesis, ...) does not.
TEXT_TASKS = frozenset(
    {
        "CAUSAL_LM",
        "MASKED_LM",
        "SEQUENCE_CLASSIFICATION",
        "TOKEN_CLASSIFICATION",
        "QUESTION_ANSWERING",
        "MULTIPLE_CHOICE",
        "NEXT_SENTENCE_PREDICTION",
        "TEXT_ENCODING",
    }
)
# Sub-configs that describe another modality's tower.
OTHER_MODALITY_SUBCONFIG = re.compile(
    r"vision|audio|image|video|speech|codec|vocoder|protein|flow_head|depth_decoder"
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model class of the installed transformers and whether the zoo runs it."""

    model_type: str
    class_name: str
    config_name: str
    excluded: str | None  # the reason it is not applicable, None when the zoo runs it


def _task_mappings() -> dict[str, dict[str, Any]]:
    return {
        name.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES"): getattr(modeling_auto, name)
        for name in dir(modeling_auto)
        if name.startswith("MODEL_FOR_") and name.endswith("_MAPPING_NAMES")
    }


def _first(name: str | Sequence[str]) -> str:
    return name if isinstance(name, str) else name[0]


def _exclusion(model_type: str, cls: Any, config_cls: Any) -> str | None:
    """The first applicability rule the class fails, as the table's reason."""
    params = list(inspect.signature(cls.forward).parameters)
    if "input_ids" not in params:
        first = next((p for p in params[1:] if p != "kwargs"), "nothing")
        return f"no text input (its forward takes {first})"
    try:
        config = config_cls()
    except Exception:  # its default config does not build in this transformers version: the
        return None  # zoo runs it, and the build reports it "not built", saying why
    if config.is_encoder_decoder:
        return "encoder-decoder (cross-attention: not a self-attention prefill)"
    if cls.__name__ in NEEDS:
        return f"multimodal (its forward needs {NEEDS[cls.__name__]})"
    other = [p for p in params if p in OTHER_MODALITY_INPUTS]
    if other:
        return f"multimodal (its forward also takes {other[0]})"
    tasks = [t for t, m in _task_mappings().items() if model_type in m]
    if tasks and not TEXT_TASKS.intersection(tasks):
        return f"not a text model (transformers lists it for {tasks[0]}, no text task)"
    subs = [s for s in (config_cls.sub_configs or {}) if OTHER_MODALITY_SUBCONFIG.search(s)]
    if subs:
        return f"multimodal (its config has the sub-config {subs[0]})"
    if not _has_heads(config):
        return (
            "no attention layer (no attention heads in its config: state-space, recurrent or "
            "Fourier mixing)"
        )
    return None


def _has_heads(config: Any) -> bool:
    """Whether the config or one of its sub-configs declares attention heads."""
    try:
        if config.num_attention_heads is not None:
            return True
    except AttributeError:
        pass
    except Exception:  # transformers' per-layer attributes refuse a global read: heads vary
        return True
    subs = [getattr(config, name, None) for name in config.sub_configs or {}]
    return any(sub is not None and _has_heads(sub) for sub in subs)


@functools.cache
def entries() -> tuple[Entry, ...]:
    """Every base model class of the installed transformers, once, sorted by class name."""
    found: dict[str, Entry] = {}
    for model_type, names in modeling_auto.MODEL_MAPPING_NAMES.items():
        class_name = _first(names)
        config_name = ""
        try:
            config_cls = CONFIG_MAPPING[model_type]
            config_name = config_cls.__name__
            cls = getattr(transformers, class_name)
            own_type = cls.config_class.model_type
            excluded = _exclusion(model_type, cls, config_cls)
        except ImportError as e:  # a class whose optional dependency is missing here
            own_type = model_type
            excluded = "cannot be imported here: " + _first_line(str(e))
        except AttributeError:  # listed in the Auto mapping but not exported
            own_type = model_type
            excluded = f"transformers lists {class_name} but does not export it"

        if class_name in found and own_type != model_type:
            continue
        found[class_name] = Entry(model_type, class_name, config_name, excluded)
    return tuple(sorted(found.values(), key=lambda e: e.class_name))


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def config_class(entry: Entry) -> Any:
    return CONFIG_MAPPING[entry.model_type]


def zoo() -> tuple[Entry, ...]:
    """The classes the zoo runs."""
    return tuple(e for e in entries() if e.excluded is None)
