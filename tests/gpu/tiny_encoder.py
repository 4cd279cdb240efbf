"""A small whole encoder on the library's attention, for graph-mode checks and timings.

Each layer (pre-norm, so values stay bounded through many layers): the fused QKV projection
(one GEMM), attention through ``backend.forward`` on the
packed QKV, the output projection, a GELU MLP, residuals. Shapes follow a spec; weights are
seeded random bf16. The same object runs eagerly on any plan and inside a CUDA graph on a
bucket's `GraphPlan`: the code path is identical, only the plan differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attn_backends as ab


@dataclass
class TinyEncoder:
    backend: ab.CudaGraphPrefill
    spec: ab.AttentionSpec
    qkv_weights: list[torch.Tensor]
    out_weights: list[torch.Tensor]
    up_weights: list[torch.Tensor]
    down_weights: list[torch.Tensor]
    hidden: int

    @classmethod
    def build(
        cls, spec: ab.AttentionSpec, layers: int, hidden: int, device: torch.device, seed: int = 0
    ) -> TinyEncoder:
        sel = ab.select(spec, device=device, cuda_graph=True)
        backend = sel.backend
        assert isinstance(backend, ab.CudaGraphPrefill), sel.explain()
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, device=device, generator=gen)
            return (w / math.sqrt(rows)).to(spec.dtype)

        return cls(
            backend,
            spec,
            [weight(hidden, spec.qkv_width) for _ in range(layers)],
            [weight(spec.q_width, hidden) for _ in range(layers)],
            [weight(hidden, 2 * hidden) for _ in range(layers)],
            [weight(2 * hidden, hidden) for _ in range(layers)],
            hidden,
        )

    def __call__(self, h: torch.Tensor, plan: ab.PrefillPlan | ab.GraphPlan) -> torch.Tensor:
        """``h``: ``[rows, hidden]``; returns the same rows (the plan's output rows)."""
        for wqkv, wo, up, down in zip(
            self.qkv_weights, self.out_weights, self.up_weights, self.down_weights, strict=True
        ):
            qkv = F.layer_norm(h, (self.hidden,)) @ wqkv
            attn = self.backend.forward(qkv, plan)
            h = h[: attn.shape[0]] + attn @ wo
            h = h + F.gelu(F.layer_norm(h, (self.hidden,)) @ up) @ down
        return h


def embeddings(
    lengths: tuple[int, ...], rows: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Seeded token embeddings for a batch, ``rows`` rows (padding rows hold large values that
    would show if they leaked into a real token)."""
    gen = torch.Generator(device=device).manual_seed(sum(lengths) * 7919 + len(lengths))
    h = torch.randn(rows, hidden, device=device, generator=gen)
    h[sum(lengths) :] = 1.0e3
    return h.to(dtype)
