"""``torch-sdpa``: the reference backend. Runs wherever torch runs; the CPU default and the
last resort on GPUs.

Consecutive sequences of equal length form one ``[n, L, H, D]`` view of the packed rows, so a
batch of equal-length sequences (BERT-style) is a single SDPA call and no gather is needed.

Sliding windows, chunks and ALiBi become one explicit mask per distinct sequence length, built in
``prepare`` (positions restart per sequence, so every sequence of a length shares it) from the same
elementwise definition flex runs (`_masks.dense_mask`): boolean ``[L, L]`` for a window or chunks,
additive ``[H, L, L]`` with ALiBi. Soft-capping acts between the two matmuls inside SDPA and cannot
be expressed, so it is not declared.

Attention sinks are one more key per sequence: K and V gain a zero row and the mask a column
holding each head's sink logit, so SDPA's softmax has exactly the sink's extra denominator term
and the zero value adds nothing. That run is computed in float32 (the mask column keeps the
logit unrounded; a 16-bit mask would round it to 8 bits) from a float32 additive mask per
length built in ``prepare``; it copies Q/K/V per layer, which the reference backend may.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attn_backends import AttentionSpec, FMHAParams, PrefillPlan
from attn_backends.errors import BackendFailure
from attn_backends.plugin import (
    AlibiSupport,
    Capabilities,
    ChunkSupport,
    PluginManifest,
    PrefillBackend,
    QKVViews,
    SinkSupport,
    WindowSupport,
    hookimpl,
)
from attn_backends_builtin._masks import dense_mask

API_VERSION = "2.0"


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
    """Length -> mask for SDPA's ``attn_mask``; empty when ``is_causal`` says it all. With
    sinks: float32 additive ``[H or 1, L, L]`` for every length (0 visible, -inf hidden)."""


class TorchSdpaBackend(PrefillBackend):
    name = "torch-sdpa"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda", "rocm"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        features=(WindowSupport(), AlibiSupport(), ChunkSupport(), SinkSupport()),
    )

    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> SdpaPlan:
        runs = _runs(params.input_lengths)
        masks: dict[int, torch.Tensor] = {}
        if spec.attention_sinks:
            for length in sorted({run.length for run in runs}):
                masks[length] = _additive_mask(spec, length, params.device)
        elif spec.window is not None or spec.chunk_size is not None or spec.alibi is not None:
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
            qs = q[rows].view(n, length, *q.shape[1:]).transpose(1, 2)
            ks = k[rows].view(n, length, *k.shape[1:]).transpose(1, 2)
            vs = v[rows].view(n, length, *v.shape[1:]).transpose(1, 2)
            if views.sinks is not None:
                assert mask is not None  # built for every length of a spec with sinks
                result = _attend_with_sinks(spec, qs, ks, vs, mask, views.sinks)
            else:
                result = F.scaled_dot_product_attention(
                    qs,
                    ks,
                    vs,
                    attn_mask=mask,
                    is_causal=spec.causal and mask is None,
                    scale=spec.scale,
                    enable_gqa=spec.is_gqa,
                )
            out[rows].view(n, length, *out.shape[1:]).copy_(result.transpose(1, 2))
        return out


def _additive_mask(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    """float32 additive ``[H or 1, L, L]`` of one sequence: 0 where visible (plus the ALiBi
    bias), -inf where hidden; the same `dense_mask` terms, or the causal rule alone."""
    if spec.window is not None or spec.chunk_size is not None or spec.alibi is not None:
        mask = dense_mask(spec, length, device)
    else:
        idx = torch.arange(length, device=device)
        mask = idx[None, :] <= idx[:, None] if spec.causal else idx[None, :] >= 0
    if mask.dtype == torch.bool:
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        mask = zeros.masked_fill(~mask, float("-inf"))
    mask = mask.float()
    return mask if mask.dim() == 3 else mask[None]


def _attend_with_sinks(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``[n, Hq, L, D]`` attention with one sink key per sequence (see the module), float32."""
    n, heads, length, _ = q.shape
    f32 = torch.float32
    zero = k.new_zeros(n, k.shape[1], 1, k.shape[3], dtype=f32)
    k = torch.cat((k.to(f32), zero), dim=2)
    v = torch.cat((v.to(f32), zero), dim=2)
    column = sinks.to(f32)[:, None, None].expand(heads, length, 1)
    bias = torch.cat((mask.expand(heads, length, length), column), dim=-1)
    out = F.scaled_dot_product_attention(
        q.to(f32), k, v, attn_mask=bias, scale=spec.scale, enable_gqa=spec.is_gqa
    )
    return out.to(spec.output_dtype)


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[TorchSdpaBackend])
