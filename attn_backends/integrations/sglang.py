"""SGLang serves its encoder-only attention (BERT, XLM-R/BGE-M3 embedding models) through this
library.

SGLang calls this module's `register` at startup in every process (entry point group
``sglang.srt.plugins``, before the server parses its arguments). It registers one attention
backend, ``attn_backends``, and adds it to the choices of SGLang's attention flags::

    python -m sglang.launch_server --model BAAI/bge-m3 --is-embedding \\
        --attention-backend attn_backends --disable-radix-cache

The backend (`attn_backends.integrations._sglang_backend`) serves ``RadixAttention`` layers of
type ``ENCODER_ONLY`` in extend (prefill) batches without reading or writing SGLang's KV pool:
such a layer attends only to its own batch's tokens, bidirectionally. Decode batches, decoder
layers, cross-attention and batches that reuse cached prefix tokens (the radix cache) read a KV
cache and are refused with a named error.

Registration never breaks SGLang: an untested release, a missing SGLang, or an error while
registering is logged and recorded (``attn-backends list`` shows it), and SGLang keeps its own
backends.
"""

from __future__ import annotations

from typing import Any

from ._engine_plugins import ENGINES, guarded

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = ENGINES["sglang"].backend_name
"""The name SGLang's ``--attention-backend`` (and ``--prefill-attention-backend``) takes."""


def register() -> None:
    """SGLang's plugin entry point: add ``attn_backends`` to SGLang's attention-backend
    registry and to its flags' choices. Safe to call more than once."""
    guarded("sglang", _register)


def _create(model_runner: Any) -> Any:
    """SGLang's backend factory: called with the model runner, after the arguments are read."""
    from ._sglang_backend import AttnBackendsSGLangBackend

    return AttnBackendsSGLangBackend(model_runner)


def _register() -> str:
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    existing = ATTENTION_BACKENDS.get(BACKEND_NAME)
    if existing is not None and existing is not _create:
        raise RuntimeError(f"SGLang already has an attention backend named {BACKEND_NAME}")
    register_attention_backend(BACKEND_NAME)(_create)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    return f"{BACKEND_NAME} -> {__name__}._create"
