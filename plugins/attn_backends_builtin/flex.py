"""``flex``: sliding windows (both sides), chunked attention, logit soft-capping, ALiBi (any
slopes, causal or bidirectional, with or without soft-capping) and rtp-llm's headwise masks on
torch FlexAttention, on CPU and CUDA.

It exists for the specs no fused kernel serves on a platform: soft-capping on CPU (Gemma 2),
and on CUDA the windows and ALiBi forms flashinfer refuses (right-reaching windows, the
bidirectional bias, custom slopes, ALiBi with soft-capping), soft-capping, which torch-sdpa
cannot express, and headwise masks, which only it serves (also under its former name,
``headwise``: `attn_backends_builtin.headwise`).

Kernel: ``torch.nn.attention.flex_attention`` over the packed batch as one sequence. The mask
and score functions are the built-ins' one elementwise definition (`_masks`): each token in its
own sequence, the causal rule, the window (within a sequence, packed-index distance is position
distance), the chunk (by position in the sequence) and the headwise sink-or-window term; then the
soft-cap and the ALiBi bias. flex
multiplies ``q @ k^T`` by ``scale`` before the score function, so the score function sees the
scaled score, exactly the order of the spec: scale, soft-cap, bias, mask, softmax. The block
mask is built once per batch in ``prepare``; flex skips fully masked blocks, so headwise window
heads cost about ``(sink + window) / length`` of full attention on long sequences. Compiled on
CUDA, eager on CPU (`_flex_kernel`). Q, K and V are handed over as dense tensors
(``needs_contiguous``) so that no layout change forces a recompilation; flex allocates its own
output (and log-sum-exp), so this backend is not held to the "output only" allocation rule.

Priority: on CUDA above torch-sdpa for windowed and ALiBi specs, measured on an H200
(`benchmarks/gpu/feature_backends.py`, docs/hardware-verification.md: 5-11x torch-sdpa's speed,
which builds a mask per sequence length and runs SDPA per length), below flashinfer, which
serves the causal forms. Elsewhere policy, not measured: below torch-sdpa on plain specs and on
CPU, where flex runs eagerly and materialises the scores. Headwise specs: the only backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attn_backends import AttentionSpec, FMHAParams, Platform, PrefillPlan
from attn_backends.errors import BackendFailure
from attn_backends.plugin import (
    AlibiSupport,
    Capabilities,
    ChunkSupport,
    HeadwiseSupport,
    PluginManifest,
    PrefillBackend,
    QKVViews,
    Reason,
    SoftcapSupport,
    WindowSupport,
    hookimpl,
)
from attn_backends_builtin._flex_kernel import (
    CompileState,
    build_flex_block_mask,
    flex_missing_reasons,
    run_packed,
)
from attn_backends_builtin._masks import alibi_slopes, mask_terms, score, visible

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

API_VERSION = "2.0"


COMPILE_STATE = CompileState()
"""The compiled kernel's health in this process; after a failure the eager kernel serves."""


def clear_caches() -> None:
    """Reset this plugin's process-wide state: the compiled kernel's health (shared with
    ``headwise``), so the next CUDA batch tries the compiled kernel again."""
    COMPILE_STATE.reset()


@dataclass(frozen=True, eq=False)
class FlexPlan:
    """The batch's block mask; the score function is per spec and built in ``attend``."""

    block_mask: BlockMask
    slopes: torch.Tensor | None
    """float32 ``[Hq]`` ALiBi slopes on the batch's device, or ``None`` without ALiBi."""
    windowed_sequences: int = 0
    """Headwise: sequences at or above the threshold, where the window heads are restricted."""


class FlexBackend(PrefillBackend):
    name = "flex"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        min_sm=80,
        needs_contiguous=True,
        features=(
            WindowSupport(),
            SoftcapSupport(),
            AlibiSupport(),
            HeadwiseSupport(),
            ChunkSupport(),
        ),
    )

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return flex_missing_reasons()

    def describe(self, platform: Platform) -> dict[str, str]:
        details = {
            **super().describe(platform),
            "kernel": "torch.nn.attention.flex_attention",
            "flex_mode": "compiled" if platform.kind == "cuda" else "eager",
        }
        spec = self.spec
        if spec.headwise is not None:
            retrieval = len(spec.headwise.retrieval_heads)
            details["retrieval_heads"] = f"{retrieval}/{spec.num_heads}"
        return details

    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> FlexPlan:
        device = params.device
        lengths = params.input_lengths
        terms = mask_terms(spec, lengths, device)
        per_head = spec.num_heads if spec.headwise is not None else None
        block_mask = build_flex_block_mask(
            visible(spec, terms), per_head, params.token_q_num, device
        )
        config = spec.headwise
        windowed = sum(not config.is_full_for(n) for n in lengths) if config is not None else 0
        return FlexPlan(block_mask, alibi_slopes(spec, device), windowed)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, FlexPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        spec = plan.spec
        modify = score(spec, kernel.slopes)
        out = run_packed(
            views.q,
            views.k,
            views.v,
            kernel.block_mask,
            spec.scale,
            spec.is_gqa,
            state=COMPILE_STATE,
            backend=self.name,
            score_mod=modify,
        )
        return out.to(spec.output_dtype)


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[FlexBackend])
