"""``torch-sdpa``: the reference backend. Runs wherever torch runs; the CPU default and the
last resort on GPUs.

Consecutive sequences of equal length form one ``[n, L, H, D]`` view of the packed rows, so a
batch of equal-length sequences (BERT-style) is a single SDPA call and no gather is needed.

Sliding windows, chunks and ALiBi become one explicit mask per distinct sequence length, built in
``prepare`` (positions restart per sequence, so every sequence of a length shares it) from the same
elementwise definition flex runs (`_masks.dense_mask`): boolean ``[L, L]`` for a window or chunks,
additive ``[H, L, L]`` with ALiBi. Soft-capping acts between the two matmuls inside SDPA and cannot
be expressed, so it is not declared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attn_backends import AttentionSpec, BackendFailure, FMHAParams, PrefillPlan
from attn_backends.plugin import (
    AlibiSupport,
    Capabilities,
    ChunkSupport,
    PluginManifest,
    PrefillBackend,
    PriorityRule,
    QKVViews,
    WindowSupport,
    hookimpl,
)
from attn_backends_builtin._masks import dense_mask

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


@dataclass(frozen=True, eq=False)
class SdpaPlan:
    """The batch's runs, and the explicit mask of each run length when the spec needs one."""

    runs: tuple[_Run, ...]
    masks: dict[int, torch.Tensor]
    """Length -> mask for SDPA's ``attn_mask``; empty when ``is_causal`` says it all."""


class TorchSdpaBackend(PrefillBackend):
    name = "torch-sdpa"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        features=(WindowSupport(), AlibiSupport(), ChunkSupport()),
        priority=(
            PriorityRule("cpu", 100, note="default on CPU"),
            PriorityRule("cuda", 0, note="last resort"),
            PriorityRule("rocm", 0, note="last resort"),
        ),
    )

    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> SdpaPlan:
        runs = _runs(params.input_lengths)
        masks: dict[int, torch.Tensor] = {}
        if spec.window is not None or spec.chunk_size is not None or spec.alibi is not None:
            for length in sorted({run.length for run in runs}):
                masks[length] = dense_mask(spec, length, params.device)
        return SdpaPlan(runs, masks)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        spec = plan.spec
        kernel = plan.kernel
        if not isinstance(kernel, SdpaPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        q, k, v = views.q, views.k, views.v
        out = torch.empty(q.shape, dtype=spec.output_dtype, device=q.device)
        for run in kernel.runs:
            mask = kernel.masks.get(run.length)
            rows = slice(run.start, run.start + run.count * run.length)
            n, length = run.count, run.length
            result = F.scaled_dot_product_attention(
                q[rows].view(n, length, *q.shape[1:]).transpose(1, 2),
                k[rows].view(n, length, *k.shape[1:]).transpose(1, 2),
                v[rows].view(n, length, *v.shape[1:]).transpose(1, 2),
                attn_mask=mask,
                is_causal=spec.causal and mask is None,
                scale=spec.scale,
                enable_gqa=spec.is_gqa,
            )
            out[rows].view(n, length, *out.shape[1:]).copy_(result.transpose(1, 2))
        return out


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[TorchSdpaBackend()])
