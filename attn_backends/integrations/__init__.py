"""Adapters that let model frameworks run their attention through this library.

Each submodule imports its framework lazily, so ``import attn_backends`` never needs it:
``attn_backends.integrations.transformers`` for Hugging Face transformers.
"""
