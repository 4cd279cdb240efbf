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

import functools
import importlib.util
import logging
import warnings
from collections.abc import Callable
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
    ReasonCode,
    hookimpl,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

API_VERSION = "1.0"
logger = logging.getLogger("attn_backends")

FLEX_MODULE = "torch.nn.attention.flex_attention"
"""Imported lazily: it exists from torch 2.5 on, and the package allows older torch."""
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EAGER_MASK_LIMIT = 1 << 24
"""Above ``heads * tokens**2`` entries the block mask is built by a compiled kernel instead
of evaluating the mask over the whole grid (CUDA only)."""


@dataclass(frozen=True, eq=False)
class HeadwisePlan:
    block_mask: BlockMask
    windowed_sequences: int
    """Sequences at or above the threshold, where the window heads are restricted."""


@dataclass
class CompileState:
    """The compiled kernel's health in this process; a failed compilation is logged once and
    the eager kernel serves from then on."""

    failures: int = 0
    last_error: str | None = None


COMPILE_STATE = CompileState()


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
    from torch.nn.attention.flex_attention import create_block_mask

    device = params.device
    lengths = params.input_lengths
    counts = torch.tensor(lengths, dtype=torch.int64)
    windowed = [not config.is_full_for(n) for n in lengths]
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), counts)
    windowed_token = torch.repeat_interleave(torch.tensor(windowed, dtype=torch.bool), counts)
    windowed_head = torch.tensor(
        [h not in config.retrieval_heads for h in range(spec.num_heads)], dtype=torch.bool
    )
    mask = headwise_mask(
        doc.to(device),
        params.positions,
        windowed_token.to(device),
        windowed_head.to(device),
        config.sink_token_num,
        config.swa_token_num,
    )
    tokens = params.token_q_num
    compiled = device.type == "cuda" and spec.num_heads * tokens * tokens > EAGER_MASK_LIMIT
    block_mask = create_block_mask(
        mask, None, spec.num_heads, tokens, tokens, device=device, _compile=compiled
    )
    return HeadwisePlan(block_mask, sum(windowed))


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _eager_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        # Eager flex is the intended path off CUDA; its "not compiled" notice is noise here.
        warnings.filterwarnings("ignore", message=".*flex_attention.*compile.*")
        out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    if not isinstance(out, torch.Tensor):
        raise BackendFailure(f"flex_attention returned {type(out).__name__}, not a tensor")
    return out


def run_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    """flex on ``[1, heads, tokens, D]``: compiled on CUDA, eager elsewhere or after a failed
    compilation."""
    if q.device.type != "cuda" or COMPILE_STATE.failures:
        return _eager_flex(q, k, v, block_mask, scale, gqa)
    try:
        return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    except Exception as exc:  # a compiler failure must not take attention down with it
        COMPILE_STATE.failures += 1
        COMPILE_STATE.last_error = f"{type(exc).__name__}: {exc}"
        logger.warning("headwise: compiled flex_attention failed, running eager: %s", exc)
        return _eager_flex(q, k, v, block_mask, scale, gqa)


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
        if importlib.util.find_spec(FLEX_MODULE) is None:
            return [
                Reason(
                    ReasonCode.LIBRARY_MISSING,
                    f"needs {FLEX_MODULE} (torch >= 2.5)",
                    "torch",
                    torch.__version__,
                    ">= 2.5",
                )
            ]
        return []

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
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (views.q, views.k, views.v))
        out = run_flex(q, k, v, kernel.block_mask, spec.scale, spec.is_gqa)
        return out.squeeze(0).transpose(0, 1)


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[HeadwiseBackend()])
