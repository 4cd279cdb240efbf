"""Adapters that let model frameworks run their attention through this library.

Each submodule imports its framework lazily, so ``import attn_backends`` never needs it:
``attn_backends.integrations.transformers`` for Hugging Face transformers,
``attn_backends.integrations.sentence_transformers`` on top of it. Reading a `RopeSpec` from a
transformers config needs no transformers install, so it lives here, beside them.
"""

from __future__ import annotations

from .._values._rope_hf import rope_spec_from_hf, rope_spec_from_hf_config
from .._values._rope_scaling import ROPE_TYPES

__all__ = ["ROPE_TYPES", "rope_spec_from_hf", "rope_spec_from_hf_config"]
