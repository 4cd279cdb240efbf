"""sentence-transformers models on packed batches through this library's attention.

Loaded with ``attn_implementation="attn_backends"`` (`transformers.register`), a
sentence-transformers model already computes its attention here, but on padded batches: every
layer runs on the padding. `packed` removes it without changing what ``encode`` returns:

- **SentenceTransformer** (and any ``feature-extraction``/``fill-mask`` module): turns on
  sentence-transformers' own flattening (`_st_flatten`): its collator packs each text batch into
  one row with ``cu_seq_lens`` and restarting positions (RoBERTa-style offsets included), its
  pooling reads the flat output, and its prompts, truncation and normalisation stay as they
  are. ``encode``, ``encode_query`` and ``encode_document`` all take that path; a call for
  ``output_value="token_embeddings"`` or ``None`` runs padded (`_st_flatten.padded_batches`:
  sentence-transformers cuts those outputs by the padding mask), through the same attention.
- **CrossEncoder** (``sequence-classification``/``text-generation``): sentence-transformers
  never flattens these, because their heads read fixed positions; the backbone in front of the
  head runs packed instead (`_st_backbone`) and the head reads the hidden states back in their
  padded cells.

After each packed forward the boundaries are checked with `transformers.unpack_hidden`, so a
model that let its sequences attend to each other is refused with the integration's own error;
models the integration refuses are refused here with the same error, at their first batch.

sentence-transformers and transformers are imported only inside these functions.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .._values._errors import IntegrationError
from . import _st_flatten
from ._packed import check_served
from ._registered import require_ours
from ._st_backbone import BackbonePacking
from .transformers import DEFAULT_NAME, register

if TYPE_CHECKING:
    from sentence_transformers import CrossEncoder, SentenceTransformer

__all__ = ["attention_name", "load", "load_cross_encoder", "packed"]

Model = TypeVar("Model", bound=torch.nn.Module)

_BACKBONE_TASKS = ("sequence-classification", "text-generation")
_PACKED = "_attn_backends_packed"
"""Flag on a Transformer module whose hooks `packed` installed. Kept on the module itself, not
in a module-level set: it lives and dies with that model, and a copy of the module carries it
together with the hooks it stands for."""
_EXACT = "_attn_backends_exact_encode"
"""Flag on a SentenceTransformer whose ``encode`` `packed` already wrapped."""
_lock = threading.Lock()
"""Makes `packed`'s check-then-hook atomic when two threads pack one model."""


def attention_name(backend: str | None = None) -> str:
    """Register this library's attention and return its ``attn_implementation`` name: one name
    per pinned backend (``None``: `select` chooses per spec and device)."""
    name = DEFAULT_NAME if backend is None else f"{DEFAULT_NAME}_{backend}"
    return register(name, backend=backend)


def _with_attention(kwargs: dict[str, Any], backend: str | None) -> dict[str, Any]:
    model_kwargs = dict(kwargs.pop("model_kwargs", None) or {})
    asked = model_kwargs.get("attn_implementation")
    name = attention_name(backend)
    if asked is not None and asked != name:
        raise IntegrationError(
            f"model_kwargs asks for attn_implementation={asked!r}; load() runs the model on "
            f"{name!r}: drop the key, or load the model with sentence-transformers directly"
        )
    model_kwargs["attn_implementation"] = name
    return {**kwargs, "model_kwargs": model_kwargs}


def load(
    model_name_or_path: str, *, backend: str | None = None, **kwargs: Any
) -> SentenceTransformer:
    """``SentenceTransformer(model_name_or_path, **kwargs)`` on this library's attention, with
    packed batches (`packed`). ``backend`` pins a backend; other keywords go to
    sentence-transformers (``model_kwargs`` gets the ``attn_implementation``)."""
    from sentence_transformers import SentenceTransformer

    return packed(SentenceTransformer(model_name_or_path, **_with_attention(kwargs, backend)))


def load_cross_encoder(
    model_name_or_path: str, *, backend: str | None = None, **kwargs: Any
) -> CrossEncoder:
    """``CrossEncoder(model_name_or_path, **kwargs)`` on this library's attention, its backbone
    packed (`packed`)."""
    from sentence_transformers import CrossEncoder

    model: CrossEncoder = CrossEncoder(model_name_or_path, **_with_attention(kwargs, backend))
    return packed(model)


def packed(model: Model) -> Model:
    """Run ``model`` (a SentenceTransformer, CrossEncoder or SparseEncoder whose transformer
    was loaded with this library's ``attn_implementation``) on packed batches; returns it.

    Raises `IntegrationError` when a transformer module runs another attention implementation
    or cannot be packed. Calling it again on the same model changes nothing.
    """
    from sentence_transformers.base.modules.transformer import Transformer

    modules = [m for m in model.modules() if isinstance(m, Transformer)]
    if not modules:
        raise IntegrationError(
            f"{type(model).__name__} holds no sentence-transformers Transformer module; "
            "packed() serves models whose first module is a Hugging Face transformer"
        )
    for module in modules:
        require_ours(module.model, "packed()")
    for module in modules:
        with _lock:
            if getattr(module, _PACKED, False):
                continue
            _pack(module)
            setattr(module, _PACKED, True)
    with _lock:
        _encode_outputs_exactly(model)
    return model


def _encode_outputs_exactly(model: Any) -> None:
    """A SentenceTransformer's ``encode`` (which ``encode_query``/``encode_document`` call)
    asked for token embeddings or every output runs on padded batches: the only outputs that
    sentence-transformers cuts by the padding mask. Sentence embeddings stay packed."""
    from sentence_transformers import SentenceTransformer

    if not isinstance(model, SentenceTransformer) or getattr(model, _EXACT, False):
        return
    encode = model.encode

    @functools.wraps(encode)
    def encode_exactly(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("output_value", "sentence_embedding") == "sentence_embedding":
            return encode(*args, **kwargs)
        with _st_flatten.padded_batches():
            return encode(*args, **kwargs)

    # the instance attribute shadows the class's method; sentence-transformers' own
    # encode_query/encode_document reach it through self.encode
    model.encode = encode_exactly  # type: ignore[method-assign]
    setattr(model, _EXACT, True)


def _without_cache(config: Any) -> None:
    """``use_cache=False`` on a transformer's config and its sub-configs: an encoder's
    prefill never reads a cache, and with one transformers' mask reads a packed row as one
    sequence (sentence-transformers 6.3 does the same on load; 6.0-6.2 keep the config's)."""
    # the config is transformers' untyped object; not every config has use_cache
    if getattr(config, "use_cache", None):
        config.use_cache = False
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            _without_cache(sub)


def _pack(module: Any) -> None:
    _without_cache(module.model.config)
    task = module.transformer_task
    if task in _BACKBONE_TASKS:
        base = module.model.base_model
        if base is module.model:
            raise IntegrationError(
                f"{type(module.model).__name__} has no backbone separate from its head "
                "(base_model_prefix); attn_backends cannot pack it"
            )
        BackbonePacking(base, module._infer_flatten_position_offset()).attach()
        return
    _st_flatten.enable_flattening(module)
    module.register_forward_hook(_check_flattened)


def _check_flattened(module: torch.nn.Module, args: Any, features: Any) -> None:
    """After a flattened forward: refuse boundaries no attention layer read."""
    if isinstance(features, dict) and "cu_seq_lens_q" in features:
        # module_output_name: the key sentence-transformers writes the flat output under.
        check_served(features[module.module_output_name], features["cu_seq_lens_q"])
