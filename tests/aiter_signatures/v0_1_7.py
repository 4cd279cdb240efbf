# mypy: disable-error-code="empty-body"
"""amd-aiter 0.1.7.post2.dev18 (published wheel, built 2025-11-18).

Copied from aiter/ops/mha.py for the CPU tests: names, order, defaults and declared types of
the three entry points the aiter backends call, no bodies. ``Optional[X]`` is written
``X | None``; the comparison with the source normalises both.

Checked against the unpacked wheel; tag v0.1.7.post2 (2025-11-14) has the same file. No
sink_size, and the FP8 entry point takes no descales.
"""

from __future__ import annotations

import torch
from torch import Tensor

VERSION = "0.1.7.post2.dev18"
"""The release the fake reports as installed for these parameter lists."""

RELEASES = "0.1.7 (2025-11-10) to 0.1.7.post2 (2025-11-14), and the 0.1.7.post2.dev18 wheel"
"""Every release whose three parameter lists are exactly these."""


# aiter/ops/mha.py:455
def mha_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...


# aiter/ops/mha.py:546
def fmha_v3_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    how_v3_bf16_cvt: int,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...


# aiter/ops/mha.py:2730
def flash_attn_varlen_fp8_pertensor_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1),
    softmax_scale=None,
): ...
