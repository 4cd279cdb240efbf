"""A fake ``flash_attn.cute`` (FlashAttention-4) for CPU tests: the real signature, the real input
rules, torch math.

It stands in for flash-attn-4 4.0.0b36 and offers what the ``fa4`` backend calls,
``flash_attn_varlen_func``. A call is bound to a stub with the real parameter list
(`SIGNATURE`; ``test_fake_signature_matches_real_fa4`` compares it with an installed
flash-attn-4), so a wrong keyword raises ``TypeError`` as it would there, then checked by the
rules ``_flash_attn_fwd`` asserts (an ``AssertionError``, as there):

* the varlen layout: ``q [total_q, H, D]``, ``k [total_k, Hkv, D]``, ``v [total_k, Hkv, Dv]``,
  ``cu_seqlens_q``/``cu_seqlens_k`` of shape ``[batch + 1]``, ``H`` a multiple of ``Hkv``;
* dtypes: ``v`` float16, bfloat16 or FP8 (FP8 on sm100 only), ``q`` and ``k`` the same as ``v``;
  offsets int32 with unit stride; ``learnable_sink`` ``[H]`` in float16, bfloat16 or float32;
* head dims per architecture (``_validate_head_dims``): on sm90 8..256, on sm100/sm110 8..128
  or 256 (and the DeepSeek shapes), multiples of ``16 // element size``; sm80 and sm120 are not
  checked, as there;
* ``softcap`` and ``score_mod`` never together (``softcap=0.0`` is no cap);
* windows as ``_resolve_causal_local_window`` reads them: both sides negative is no window,
  ``causal`` forces ``right = 0``, ``None`` is an unbounded side; query ``i`` sees keys
  ``i + off - left .. i + off + right`` with ``off = len_k - len_q``.

Left out: the real one asserts that every tensor is on CUDA; the fake wants them all on one
device, whichever. It also refuses what it does not compute (MLA ``qv``, paged or gathered KV,
``seqused``, user score and mask modifiers, block sparsity, splits). Besides the rules, it
refuses offsets past the tensors or a ``max_seqlen_q`` below the longest sequence (the kernel
would read out of bounds or leave rows unwritten), and records which of Q, K, V the real one
would copy first (``maybe_contiguous``: a base or a stride that is not 16-byte aligned). Rows
no sequence covers stay NaN, as uninitialised memory would be garbage.
"""

from __future__ import annotations

import inspect
import itertools
import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

FA4_VERSION = "4.0.0b36"
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALIGN = 16


def _sig_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    min_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    gather_kv_indices: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    score_mod: Any = None,
    score_mod_bwd: Any = None,
    mask_mod: Any = None,
    block_sparse_tensors: Any = None,
    aux_tensors: list[Any] | None = None,
    aux_scalars: tuple[Any, ...] | None = None,
    return_lse: bool = False,
    scheduler_metadata: Any = None,
    seqlen_k_per_split: int | None = None,
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: int | None = None,
) -> Any: ...


SIGNATURE = _sig_flash_attn_varlen_func
"""``flash_attn.cute.flash_attn_varlen_func`` of 4.0.0b36 (interface.py:4214): only the names,
their order and the defaults matter; the body never runs."""

NOT_COMPUTED = (
    "qv",
    "seqused_q",
    "seqused_k",
    "gather_kv_indices",
    "page_table",
    "score_mod",
    "score_mod_bwd",
    "mask_mod",
    "block_sparse_tensors",
    "aux_tensors",
    "aux_scalars",
    "scheduler_metadata",
    "seqlen_k_per_split",
)


@dataclass(frozen=True)
class Call:
    """One recorded call: its arguments by parameter name, and which of ``q``, ``k``, ``v``
    the real interface would have copied before the kernel (misaligned)."""

    args: dict[str, Any]
    copied: tuple[str, ...]


def _aligned(t: torch.Tensor) -> bool:
    """What ``maybe_contiguous`` keeps as it is: a 16-byte aligned base and, unless dense,
    a unit last stride with every other non-zero stride 16-byte aligned."""
    if t.data_ptr() % ALIGN:
        return False
    if t.is_contiguous():
        return True
    step = max(1, ALIGN // t.element_size())
    return t.stride(-1) == 1 and all(s == 0 or s % step == 0 for s in t.stride()[:-1])


def validate_head_dims(head_dim: int, head_dim_v: int, arch: int, alignment: int) -> None:
    """``_validate_head_dims``, from its rules: sm90 8..256; sm100/sm110 8..128, (192, 128),
    (64 or equal, 512) or (256, 256); both multiples of ``alignment``."""
    aligned = head_dim % alignment == 0 and head_dim_v % alignment == 0
    family = arch // 10
    if family == 9:
        ok = 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256
    elif family in (10, 11):
        ok = (
            (8 <= head_dim <= 128 and 8 <= head_dim_v <= 128)
            or (head_dim, head_dim_v) in ((192, 128), (256, 256))
            or (head_dim_v == 512 and head_dim in (64, head_dim_v))
        )
    else:
        return
    assert ok and aligned, (
        f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) not served on sm{arch}"
    )


def resolve_window(
    causal: bool, left: int | None, right: int | None
) -> tuple[bool, bool, int | None, int | None]:
    """``(causal, local, left, right)`` as ``_resolve_causal_local_window`` reads them."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is None and right is None:
        return causal, False, None, None
    if left is None and right == 0:
        return True, False, None, None
    return False, True, left, right


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int],
    scale: float,
    window: tuple[bool, bool, int | None, int | None],
    softcap: float | None,
    sink: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Float32 varlen attention into ``out`` (and ``lse [H, total_q]``): scale, soft-cap, the
    causal or local mask (bottom-right aligned), softmax with the sink logit as one more column
    that has no value; a row that sees nothing gets zeros (its LSE the sink, or -inf)."""
    causal, local, left, right = window
    hq, hk = q.shape[1], k.shape[1]
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=True):
        if q1 == q0:
            continue
        qs = q[q0:q1].to(torch.float32)
        ks = k[k0:k1].to(torch.float32).repeat_interleave(hq // hk, dim=1)
        vs = v[k0:k1].to(torch.float32).repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        device = q.device
        i = torch.arange(q1 - q0, device=device)[:, None] + ((k1 - k0) - (q1 - q0))
        j = torch.arange(k1 - k0, device=device)[None, :]
        seen = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=device)
        if causal:
            seen &= j <= i
        if local:
            if left is not None:
                seen &= j >= i - left
            if right is not None:
                seen &= j <= i + right
        scores = scores.masked_fill(~seen, float("-inf"))
        if sink is not None:
            column = sink.to(torch.float32)[:, None, None].expand(hq, q1 - q0, 1)
            scores = torch.cat((scores, column), dim=-1)
            vs = torch.cat((vs, torch.zeros_like(vs[:1])), dim=0)
        total = torch.logsumexp(scores, dim=-1, keepdim=True)
        # A row that sees nothing: every term exp(-inf) = 0, not NaN.
        weights = torch.exp(scores - total.clamp_min(torch.finfo(torch.float32).min))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", weights, vs).to(out.dtype)
        if lse is not None:
            lse[:, q0:q1] = total[..., 0]


def _offsets(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


@dataclass
class FakeFlashAttnCute:
    """One installed fake: the architecture it pretends to run on, and every call made to it."""

    arch: int = 90
    calls: list[Call] = field(default_factory=list)

    def flash_attn_varlen_func(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        bound = inspect.signature(SIGNATURE).bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        q, k, v = a["q"], a["k"], a["v"]
        cu_q, cu_k = a["cu_seqlens_q"], a["cu_seqlens_k"]
        copied = tuple(n for n, t in (("q", q), ("k", k), ("v", v)) if not _aligned(t))
        self.calls.append(Call(a, copied))
        if cu_q is None or cu_k is None:
            raise NotImplementedError("the fake computes the varlen form (cu_seqlens_q and _k)")

        # The rules of _flash_attn_fwd, in its order.
        num_heads, head_dim = q.shape[-2:]
        batch = cu_q.shape[0] - 1
        total_k, num_kv_heads, head_dim_v = v.shape[-3], v.shape[-2], v.shape[-1]
        assert q.dim() == 3, "varlen q is [total_q, heads, head_dim]"
        assert k.shape == (total_k, num_kv_heads, head_dim), "k shape differs from q and v"
        assert v.shape == (total_k, num_kv_heads, head_dim_v), "v is [total_k, heads_kv, dim_v]"
        assert cu_k.shape == (batch + 1,), "cu_seqlens_k must be [batch + 1]"
        assert cu_q.shape == (batch + 1,), "cu_seqlens_q must be [batch + 1]"
        assert v.dtype in INPUT_DTYPES, "inputs must be float16, bfloat16 or FP8"
        assert q.dtype == v.dtype and k.dtype == v.dtype, "q, k and v must share a dtype"
        for t in (cu_q, cu_k):
            assert t.dtype == torch.int32, "cu_seqlens must be int32"
            assert t.stride(0) == 1, "cu_seqlens must be contiguous"
        sink = a["learnable_sink"]
        if sink is not None:
            assert sink.shape == (num_heads,), "learnable_sink must be [heads]"
            assert sink.dtype in SINK_DTYPES, "learnable_sink must be float16, bfloat16 or float32"
        tensors = [t for t in (q, k, v, cu_q, cu_k, sink) if t is not None]
        assert all(t.device == q.device for t in tensors), "all inputs on one device"
        assert self.arch // 10 in (8, 9, 10, 11, 12), f"sm{self.arch} not served"
        assert num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads"
        if self.arch // 10 not in (8, 12):
            validate_head_dims(head_dim, head_dim_v, self.arch, ALIGN // v.element_size())
        scale = a["softmax_scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        softcap = a["softcap"] if a["softcap"] != 0.0 else None
        is_fp8 = v.dtype in INPUT_DTYPES[2:]
        if is_fp8:
            assert self.arch // 10 == 10, "FP8 runs on sm100 only"
        if softcap is not None:
            assert a["score_mod"] is None, "softcap and score_mod are exclusive"
        for name in NOT_COMPUTED:
            if a[name] is not None:
                raise NotImplementedError(f"the fake computes no {name}")
        if a["num_splits"] != 1:
            raise NotImplementedError("the fake computes no split-KV")

        # What the kernel would read out of bounds, or leave unwritten.
        offsets_q, offsets_k = _offsets(cu_q), _offsets(cu_k)
        for name, offsets, rows, limit in (
            ("q", offsets_q, q.shape[0], a["max_seqlen_q"]),
            ("k", offsets_k, total_k, a["max_seqlen_k"]),
        ):
            steps = [end - start for start, end in itertools.pairwise(offsets)]
            if offsets[0] != 0 or min(steps, default=0) < 0 or offsets[-1] > rows:
                raise RuntimeError(f"cu_seqlens_{name} {offsets} reaches past {rows} rows")
            if limit is not None and limit < max(steps, default=0):
                raise RuntimeError(f"max_seqlen_{name}={limit} is below the longest sequence")

        left, right = a["window_size"]
        window = resolve_window(a["causal"], left, right)
        out_dtype = torch.bfloat16 if is_fp8 else q.dtype
        shape = (q.shape[0], num_heads, head_dim_v)
        out = torch.full(shape, float("nan"), dtype=out_dtype, device=q.device)
        lse = None
        if a["return_lse"]:
            lse = torch.full((num_heads, q.shape[0]), float("nan"), device=q.device)
        attention(q, k, v, offsets_q, offsets_k, scale, window, softcap, sink, out, lse)
        return out, lse

    def modules(self) -> tuple[types.ModuleType, types.ModuleType]:
        root = types.ModuleType("flash_attn")
        cute = types.ModuleType("flash_attn.cute")
        cute.__version__ = FA4_VERSION  # type: ignore[attr-defined]
        cute.flash_attn_varlen_func = self.flash_attn_varlen_func  # type: ignore[attr-defined]
        root.cute = cute  # type: ignore[attr-defined]
        return root, cute


def install(monkeypatch: pytest.MonkeyPatch, arch: int = 90) -> FakeFlashAttnCute:
    """Put a fresh fake at ``sys.modules["flash_attn.cute"]`` for one test (monkeypatch undoes
    it), running as on an ``sm{arch}`` device."""
    fake = FakeFlashAttnCute(arch=arch)
    root, cute = fake.modules()
    monkeypatch.setitem(sys.modules, "flash_attn", root)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return fake
