"""``example-matmul``: attention as two plain matmuls and a softmax, one sequence at a time.

It is slow and exists to be read: everything a backend must write is
here and nothing else. The base class (`PrefillBackend`) runs the capability checks, validates
the packed QKV, applies RoPE/logn in place, trims the padding rows and checks the output shape,
so ``attend`` only sees ``[tokens, heads, D]`` views of valid rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_backends import AttentionSpec, FMHAParams, PrefillPlan
from attn_backends.plugin import Capabilities, PrefillBackend, QKVViews


@dataclass(frozen=True, eq=False)
class MatmulPlan:
    """Per-batch work done once in ``prepare``: row spans and causal masks on the device."""

    spans: tuple[tuple[int, int], ...]
    """``(start, end)`` rows of each non-empty sequence."""
    masks: dict[int, torch.Tensor]
    """Sequence length -> ``[L, L]`` bool, True where a key is hidden (causal specs only)."""


class MatmulSoftmaxBackend(PrefillBackend):
    """Plain ``softmax(Q K^T * scale) V`` in float32 per sequence; GQA by repeating K/V heads."""

    name = "example-matmul"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        # It runs only when chosen by name (select(spec, backend="example-matmul")).
    )

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> MatmulPlan:
        spans: list[tuple[int, int]] = []
        start = 0
        for length in params.input_lengths:
            if length:
                spans.append((start, start + length))
            start += length
        masks: dict[int, torch.Tensor] = {}
        if spec.causal:
            for length in {end - begin for begin, end in spans}:
                ones = torch.ones(length, length, dtype=torch.bool, device=params.device)
                masks[length] = ones.triu(diagonal=1)
        return MatmulPlan(tuple(spans), masks)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        spec = plan.spec
        kernel = plan.kernel
        assert isinstance(kernel, MatmulPlan)  # made by plan_kernel above
        out = torch.empty(views.q.shape, dtype=spec.output_dtype, device=views.q.device)
        for begin, end in kernel.spans:
            q = views.q[begin:end].transpose(0, 1).float()  # [Hq, L, D]
            k = views.k[begin:end].transpose(0, 1).float().repeat_interleave(spec.group_size, 0)
            v = views.v[begin:end].transpose(0, 1).float().repeat_interleave(spec.group_size, 0)
            scores = (q @ k.transpose(1, 2)) * spec.scale
            if spec.causal:
                scores = scores.masked_fill(kernel.masks[end - begin], float("-inf"))
            out[begin:end] = (scores.softmax(dim=-1) @ v).transpose(0, 1).to(spec.output_dtype)
        return out
