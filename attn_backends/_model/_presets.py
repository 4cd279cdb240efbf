"""Attention specs of the embedding/reranker models this path serves, by name.

Public (`attn_backends.PRESETS`, read-only): the CLI's ``--preset``, `warmup`'s spec names and
the benchmark's workloads all read this one table, so they talk about the same shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from ._spec import AttentionSpec, RopeSpec

PRESETS: Mapping[str, AttentionSpec] = MappingProxyType(
    {
        "bert-base": AttentionSpec(12, 12, 64, torch.bfloat16, causal=False),
        "bge-m3": AttentionSpec(16, 16, 64, torch.bfloat16, causal=False),
        "qwen3-embedding-0.6b": AttentionSpec(
            16, 8, 128, torch.bfloat16, causal=True, rope=RopeSpec(theta=1e6)
        ),
        "gte-qwen2-7b": AttentionSpec(28, 4, 128, torch.bfloat16, causal=True, rope=RopeSpec(1e6)),
        "short": AttentionSpec(16, 8, 128, torch.bfloat16, causal=True, rope=RopeSpec(theta=1e6)),
    }
)
"""Model name -> spec (bf16). BGE-M3 is XLM-R large-like in head shape; GTE-Qwen2-7B runs
bidirectional in some serving stacks, here causal as in its reference implementation."""
