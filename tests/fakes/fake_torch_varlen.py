"""A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn``: real parameter lists, the flash
kernel's argument checks, SDPA math per sequence.

``torch-varlen`` isolates the kernel call in ``load_varlen``; a test replaces that function with
`FakeVarlen` and runs the backend on CPU tensors. Each call is bound to the parameter list of one
torch release (``SIGNATURES``; the installed torch's is compared with ``2.13`` in the tests), so a
keyword that release lacks raises ``TypeError`` as the real function would, then checked as
``mha_varlen_fwd`` checks it (16-bit dtype, unit last-dim stride, int32 offsets, head dim a
multiple of 8 up to 256, K/V heads equal to Q's unless ``enable_gqa``). ``window_size`` must be a
tuple: torch decides causality by ``window_size == (-1, 0)``, which a list never equals.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# Parameter lists only; bodies are never run. 2.11 and 2.13 as their varlen_attn reads
# (2.11 on the H200, 2.13 here); 2.10 as its documentation gives it.


def _sig_2_10(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    return_aux: Any = None,
    scale: float | None = None,
) -> Any: ...


def _sig_2_11(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> Any: ...


def _sig_2_13(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> Any: ...


SIGNATURES: dict[str, Callable[..., Any]] = {
    "2.10": _sig_2_10,
    "2.11": _sig_2_11,
    "2.13": _sig_2_13,
}


def _visible(length: int, window: tuple[int, int], causal: bool) -> torch.Tensor:
    """Bool ``[L, L]``: keys ``j`` in ``[i - left, i + right]``, -1 an unbounded side."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    left, right = window
    if causal:
        right = 0
    seen = torch.ones(length, length, dtype=torch.bool)
    if left >= 0:
        seen &= i - j <= left
    if right >= 0:
        seen &= j - i <= right
    return seen


@dataclass
class FakeVarlen:
    """``varlen_attn`` of torch ``release``, computing with float32 SDPA per sequence."""

    release: str = "2.13"
    calls: list[dict[str, Any]] = field(default_factory=list)
    """Every call's arguments by parameter name, defaults filled in."""

    @property
    def signature(self) -> inspect.Signature:
        return inspect.signature(SIGNATURES[self.release])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        self.calls.append(a)
        q, k, v = a["query"], a["key"], a["value"]
        cu_q, cu_k = a["cu_seq_q"], a["cu_seq_k"]
        for t in (q, k, v):
            assert t.dtype in (torch.float16, torch.bfloat16), t.dtype
            assert t.dtype == q.dtype and t.dim() == 3
            assert t.stride(-1) == 1, "Input tensor must have contiguous last dimension"
        for cu in (cu_q, cu_k):
            assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device
        head_dim = q.shape[-1]
        assert head_dim % 8 == 0 and head_dim <= 256, head_dim
        assert torch.equal(cu_q, cu_k), "self-attention: one set of offsets"
        hq, hkv = q.shape[1], k.shape[1]
        gqa = bool(a.get("enable_gqa", False))
        assert hq == hkv or (gqa and hq % hkv == 0), (hq, hkv, gqa)
        window = a.get("window_size", (-1, -1))
        assert isinstance(window, tuple) and len(window) == 2, window
        causal = bool(a.get("is_causal", False))
        offsets = cu_q.tolist()
        lengths = [e - s for s, e in itertools.pairwise(offsets)]
        assert max(lengths) == a["max_q"] == a["max_k"], (lengths, a["max_q"], a["max_k"])
        assert min(lengths) > 0, "no empty sequence reaches the kernel"
        out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
        lse = torch.full((hq, q.shape[0]), float("nan"), dtype=torch.float32)
        scale = a["scale"] if a["scale"] is not None else head_dim**-0.5
        for start, length in zip(offsets, lengths, strict=False):
            rows = slice(start, start + length)
            mask = _visible(length, window, causal)
            qs = q[rows].transpose(0, 1).float()
            ks = k[rows].transpose(0, 1).float().repeat_interleave(hq // hkv, dim=0)
            vs = v[rows].transpose(0, 1).float().repeat_interleave(hq // hkv, dim=0)
            result = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[rows] = result.transpose(0, 1).to(q.dtype)
            # the flash kernel's varlen log-sum-exp: float32 [heads, tokens], natural log
            scores = (qs @ ks.transpose(1, 2)) * scale
            lse[:, rows] = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
        aux = a.get("return_aux")
        if aux is not None and aux.lse:
            return out, lse
        return out
