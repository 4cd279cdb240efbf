"""vLLM serves its encoder-only attention (BERT, XLM-R/BGE-M3, ModernBERT...) through this
library.

vLLM loads this module's `register` at startup in every process (entry point group
``vllm.general_plugins``). It registers one attention backend, ``ATTN_BACKENDS``, which vLLM
picks when told to::

    vllm serve BAAI/bge-m3 --attention-backend ATTN_BACKENDS
    # or only for the encoder-only layers of a model that has others:
    vllm serve ... -ac '{"backend_per_kind": {"encoder_only_attention": "ATTN_BACKENDS"}}'

The backend (`attn_backends.integrations._vllm_backend`) serves layers of type
``ENCODER_ONLY``: vLLM gives them no KV cache, bidirectional attention over each request's
tokens, which is this library's no-cache prefill. Every other attention type keeps a paged KV
cache (decoder layers, Qwen3-Embedding's included) or reads another sequence (cross-attention)
and is refused through vLLM's own ``validate_configuration`` with this library's reasons.

Registration never breaks vLLM: an untested vLLM release, a missing vLLM, or an error while
registering is logged and recorded (``attn-backends list`` shows it), and vLLM keeps its own
backends.
"""

from __future__ import annotations

from ._engine_plugins import ENGINES, guarded

__all__ = ["BACKEND_CLASS", "BACKEND_NAME", "register"]

BACKEND_NAME = ENGINES["vllm"].backend_name
"""The name vLLM's ``--attention-backend`` takes."""
BACKEND_CLASS = "attn_backends.integrations._vllm_backend.AttnBackendsBackend"
"""Where vLLM finds the backend class (it imports it only when the backend is asked for)."""


def register() -> None:
    """vLLM's plugin entry point: add ``ATTN_BACKENDS`` to vLLM's attention-backend registry.
    Safe to call more than once."""
    guarded("vllm", _register)


def _register() -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    existing = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if existing is not None:
        path = existing.get_path()
        if path != BACKEND_CLASS:
            raise RuntimeError(
                f"vLLM already has an attention backend named {BACKEND_NAME} ({path})"
            )
        return f"{BACKEND_NAME} -> {BACKEND_CLASS} (already registered)"
    register_backend(BACKEND_NAME, BACKEND_CLASS)
    return f"{BACKEND_NAME} -> {BACKEND_CLASS}"
