"""``flex``: sliding windows (both sides), logit soft-capping and ALiBi (any slopes, causal or
bidirectional, with or without soft-capping) on torch FlexAttention, on CPU and CUDA.

It exists for the specs no fused kernel serves on a platform: soft-capping on CPU (Gemma 2),
and on CUDA the windows and ALiBi forms flashinfer refuses (right-reaching windows, the
bidirectional bias, custom slopes, ALiBi with soft-capping) and soft-capping, which torch-sdpa
cannot express.

Kernel: ``torch.nn.attention.flex_attention`` over the packed batch as one sequence. The mask
function keeps each token in its own sequence and applies the causal rule and the window
(within a sequence, packed-index distance is position distance); the score function applies
the soft-cap and then the ALiBi bias. flex multiplies ``q @ k^T`` by ``scale`` before the
score function, so the score function sees the scaled score, exactly the order of the spec:
scale, soft-cap, bias, mask, softmax. Compiled on CUDA, eager on CPU (`_flex_kernel`).

Priority: on CUDA above torch-sdpa for windowed and ALiBi specs, measured on an H200
(`scripts/gpu/feature_backends.py`, docs/hardware-verification.md: 5-11x torch-sdpa's speed,
which builds a mask per sequence length and runs SDPA per length), below flashinfer, which
serves the causal forms. Elsewhere policy, not measured: below torch-sdpa on plain specs and on
CPU, where flex runs eagerly and materialises the scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attn_backends import (
    AttentionSpec,
    BackendFailure,
    Capabilities,
    FMHAParams,
    Platform,
    PluginManifest,
    PrefillBackend,
    PrefillPlan,
    PriorityRule,
    QKVViews,
    Reason,
    SlidingWindow,
    hookimpl,
)
from attn_backends_builtin._flex_kernel import (
    CompileState,
    MaskMod,
    ScoreMod,
    build_flex_block_mask,
    document_ids,
    flex_missing_reasons,
    run_packed,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

API_VERSION = "1.0"


COMPILE_STATE = CompileState()
"""The compiled kernel's health in this process; after a failure the eager kernel serves."""


def sequence_mask(doc: torch.Tensor, causal: bool, window: SlidingWindow | None) -> MaskMod:
    """Same sequence, the causal rule if asked, and ``i - left <= j <= i + right``."""
    left = window.left if window is not None else None
    right = window.right if window is not None else None

    def mask(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        visible = doc[q_idx] == doc[kv_idx]
        if causal:
            visible = visible & (kv_idx <= q_idx)
        if left is not None and right is not None:
            visible = visible & (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)
        return visible

    return mask


def feature_score(
    softcap: float | None, slopes: torch.Tensor | None, causal: bool
) -> ScoreMod | None:
    """``cap * tanh(s / cap)`` then ``+ slope_h * (j - i)`` (causal) or ``- slope_h * |i - j|``
    on the already scaled score ``s``; ``None`` when neither feature is on."""
    if softcap is None and slopes is None:
        return None

    def score(
        s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            distance = kv_idx - q_idx
            if not causal:
                distance = -distance.abs()
            s = s + slopes[h] * distance
        return s

    return score


@dataclass(frozen=True, eq=False)
class FlexPlan:
    """The batch's block mask; the score function is per spec and built in ``attend``."""

    block_mask: BlockMask
    slopes: torch.Tensor | None
    """float32 ``[Hq]`` ALiBi slopes on the batch's device, or ``None`` without ALiBi."""


class FlexBackend(PrefillBackend):
    name = "flex"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        min_sm=80,
        needs_contiguous=True,
        sliding_window=True,
        window_right=True,
        logit_softcap=True,
        alibi=True,
        alibi_bidirectional=True,
        alibi_custom_slopes=True,
        alibi_with_softcap=True,
        priority=(
            PriorityRule(
                "cpu",
                10,
                note="policy, not measured: below torch-sdpa (100), so it serves what SDPA "
                "cannot express (soft-capping)",
            ),
            PriorityRule(
                "cuda",
                50,
                min_sm=80,
                masked=True,
                note="measured on H200 (scripts/gpu/feature_backends.py): 5-11x torch-sdpa's "
                "speed on windowed and ALiBi specs; below flashinfer (100), which serves "
                "causal windows and causal ALiBi",
            ),
            PriorityRule(
                "cuda",
                -10,
                min_sm=80,
                note="policy, not measured: below flashinfer (100) and torch-sdpa (0) on "
                "plain specs; serves the soft-capped ones flashinfer refuses (float32, no "
                "flashinfer installed)",
            ),
        ),
    )

    def extra_reasons(self, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return flex_missing_reasons()

    def describe(self, platform: Platform) -> dict[str, str]:
        return {
            **super().describe(platform),
            "kernel": "torch.nn.attention.flex_attention",
            "flex_mode": "compiled" if platform.kind == "cuda" else "eager",
        }

    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> FlexPlan:
        device = params.device
        mask = sequence_mask(document_ids(params.input_lengths, device), spec.causal, spec.window)
        block_mask = build_flex_block_mask(mask, None, params.token_q_num, device)
        slopes = None
        if spec.alibi is not None:
            values = spec.alibi.slopes_for(spec.num_heads)
            slopes = torch.tensor(values, dtype=torch.float32, device=device)
        return FlexPlan(block_mask, slopes)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, FlexPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        spec = plan.spec
        score = feature_score(spec.logit_softcap, kernel.slopes, spec.causal)
        out = run_packed(
            views.q,
            views.k,
            views.v,
            kernel.block_mask,
            spec.scale,
            spec.is_gqa,
            state=COMPILE_STATE,
            backend=self.name,
            score_mod=score,
        )
        return out.to(spec.output_dtype)


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[FlexBackend()])
