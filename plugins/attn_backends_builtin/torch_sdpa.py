"""``torch-sdpa``: the reference backend. Runs wherever torch runs; the CPU default and the
last resort on GPUs.

Consecutive sequences of equal length form one ``[n, L, H, D]`` view of the packed rows, so a
batch of equal-length sequences (BERT-style) is a single SDPA call and no gather is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from attn_backends import (
    AttentionSpec,
    Capabilities,
    FMHAParams,
    PluginManifest,
    PrefillBackend,
    PrefillPlan,
    PriorityRule,
    QKVViews,
    hookimpl,
)

API_VERSION = "1.0"


@dataclass(frozen=True)
class _Run:
    """``count`` consecutive sequences of ``length`` tokens starting at row ``start``."""

    start: int
    count: int
    length: int


def _runs(lengths: tuple[int, ...]) -> tuple[_Run, ...]:
    runs: list[_Run] = []
    start = 0
    for length in lengths:
        last = runs[-1] if runs else None
        if last is not None and last.length == length:
            runs[-1] = _Run(last.start, last.count + 1, length)
        else:
            runs.append(_Run(start, 1, length))
        start += length
    return tuple(r for r in runs if r.length > 0)


class TorchSdpaBackend(PrefillBackend):
    name = "torch-sdpa"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        priority=(
            PriorityRule("cpu", 100, note="default on CPU"),
            PriorityRule("cuda", 0, note="last resort"),
            PriorityRule("rocm", 0, note="last resort"),
        ),
    )

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> tuple[_Run, ...]:
        return _runs(params.input_lengths)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        spec = plan.spec
        runs = cast(tuple[_Run, ...], plan.kernel)
        q, k, v = views.q, views.k, views.v
        out = torch.empty(q.shape, dtype=spec.output_dtype, device=q.device)
        for run in runs:
            rows = slice(run.start, run.start + run.count * run.length)
            n, length = run.count, run.length
            result = F.scaled_dot_product_attention(
                q[rows].view(n, length, *q.shape[1:]).transpose(1, 2),
                k[rows].view(n, length, *k.shape[1:]).transpose(1, 2),
                v[rows].view(n, length, *v.shape[1:]).transpose(1, 2),
                is_causal=spec.causal,
                scale=spec.scale,
                enable_gqa=spec.is_gqa,
            )
            out[rows].view(n, length, *out.shape[1:]).copy_(result.transpose(1, 2))
        return out


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[TorchSdpaBackend()])
