"""``headwise``: rtp-llm's per-head prefill masks for long causal sequences, on FlexAttention.

Semantics (`HeadwiseConfig`): retrieval heads attend causally to the whole sequence; every
other head lets the query at position ``p`` see key ``j <= p`` only when ``j < sink_token_num``
or ``p - j <= swa_token_num``, all in one softmax. A sequence shorter than ``seqlen_threshold``
(or than ``sink_token_num``) is full causal on every head; the rule is decided per sequence.

Kernel: ``torch.nn.attention.flex_attention`` over the packed batch as one sequence, with a
mask function that also keeps tokens inside their own sequence. The block mask is built once
per batch in ``prepare``; flex skips fully masked blocks, so the window heads cost about
``(sink + window) / length`` of full attention on long sequences. On CUDA the kernel is
``torch.compile``-d (compiled once per process and per shape class); on CPU it runs eagerly,
which materialises the scores and serves tests and small inputs.

Q, K and V are handed over as dense tensors (``needs_contiguous``) so that every batch has the
same memory layout and no layout change forces a recompilation. flex allocates its own output
(and log-sum-exp); this backend is not held to the "output only" allocation rule.
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
    HeadwiseConfig,
    Platform,
    PluginManifest,
    PrefillBackend,
    PrefillPlan,
    PriorityRule,
    QKVViews,
    Reason,
    hookimpl,
)
from attn_backends_builtin._flex_kernel import (
    CompileState,
    MaskMod,
    build_flex_block_mask,
    document_ids,
    flex_missing_reasons,
    run_packed,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

API_VERSION = "1.0"


@dataclass(frozen=True, eq=False)
class HeadwisePlan:
    block_mask: BlockMask
    windowed_sequences: int
    """Sequences at or above the threshold, where the window heads are restricted."""


COMPILE_STATE = CompileState()
"""The compiled kernel's health in this process; after a failure the eager kernel serves."""


def headwise_mask(
    doc: torch.Tensor,
    pos: torch.Tensor,
    windowed_token: torch.Tensor,
    windowed_head: torch.Tensor,
    sink: int,
    window: int,
) -> MaskMod:
    """The flex mask: same sequence, causal, and sink-or-window where head and sequence ask."""

    def mask(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        same = doc[q_idx] == doc[kv_idx]
        causal = kv_idx <= q_idx
        q_pos = pos[q_idx]
        k_pos = pos[kv_idx]
        local = (k_pos < sink) | (q_pos - k_pos <= window)
        restricted = windowed_head[h] & windowed_token[q_idx]
        return same & causal & (local | ~restricted)

    return mask


def build_block_mask(
    spec: AttentionSpec, config: HeadwiseConfig, params: FMHAParams
) -> HeadwisePlan:
    device = params.device
    lengths = params.input_lengths
    counts = torch.tensor(lengths, dtype=torch.int64)
    windowed = [not config.is_full_for(n) for n in lengths]
    windowed_token = torch.repeat_interleave(torch.tensor(windowed, dtype=torch.bool), counts)
    windowed_head = torch.tensor(
        [h not in config.retrieval_heads for h in range(spec.num_heads)], dtype=torch.bool
    )
    mask = headwise_mask(
        document_ids(lengths, device),
        params.positions,
        windowed_token.to(device),
        windowed_head.to(device),
        config.sink_token_num,
        config.swa_token_num,
    )
    block_mask = build_flex_block_mask(mask, spec.num_heads, params.token_q_num, device)
    return HeadwisePlan(block_mask, sum(windowed))


class HeadwiseBackend(PrefillBackend):
    name = "headwise"
    capabilities = Capabilities(
        platforms=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=frozenset({64, 128}),
        min_sm=80,
        bidirectional=False,
        needs_contiguous=True,
        headwise=True,
        priority=(
            PriorityRule("cpu", 50, note="the only backend implementing headwise masks"),
            PriorityRule(
                "cuda", 50, min_sm=80, note="the only backend implementing headwise masks"
            ),
        ),
    )

    def extra_reasons(self, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return flex_missing_reasons()

    def describe(self, platform: Platform) -> dict[str, str]:
        spec = self.bound_spec()
        config = spec.headwise
        retrieval = len(config.retrieval_heads) if config is not None else 0
        return {
            **super().describe(platform),
            "kernel": "torch.nn.attention.flex_attention",
            "flex_mode": "compiled" if platform.kind == "cuda" else "eager",
            "retrieval_heads": f"{retrieval}/{spec.num_heads}",
        }

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> HeadwisePlan:
        if spec.headwise is None:
            raise BackendFailure(f"{self.name} needs a HeadwiseConfig on the spec")
        return build_block_mask(spec, spec.headwise, params)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, HeadwisePlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        spec = plan.spec
        return run_packed(
            views.q,
            views.k,
            views.v,
            kernel.block_mask,
            spec.scale,
            spec.is_gqa,
            state=COMPILE_STATE,
            backend=self.name,
        )


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[HeadwiseBackend()])
