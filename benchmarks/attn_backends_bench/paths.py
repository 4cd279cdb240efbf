"""Every way the benchmark computes a workload's attention, each built once per batch.

A builder does the per-batch host work (selection, ``prepare``, index tensors, masks, RoPE
tables) and returns a `PreparedPath` whose ``run(qkv)`` is the per-layer step that gets timed.
``run`` takes the packed ``[tokens, (Hq + 2*Hkv) * D]`` buffer an engine's QKV projection
produces and returns ``[tokens, Hq * D]``. Every path computes the same function, RoPE
included when the spec has it, so every path is checked against the same float64 reference.

The public-API paths and the raw kernel rotate the caller's buffer in place (that is the
contract). The timed calls therefore rotate their input again on each call: the values change,
the work does not. The other paths leave their input untouched.

This module holds the shared pieces, the public API, padded SDPA and ``varlen_attn``; the
legacy path is in `legacy`, the raw kernel in `raw` (flashinfer's ragged kernel, which both
call, in `ragged`), graph replay in `graphs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attn_backends import AttentionSpec, FMHAParams, NoBackendError, select

from .timing import synchronize, time_host

Run = Callable[[torch.Tensor], torch.Tensor]
TORCH_OUT_OF_PLACE = "torch ops, out of place (Hugging Face style)"


@dataclass(frozen=True)
class PreparedPath:
    run: Run
    backend: str | None = None
    details: dict[str, str] = field(default_factory=dict)
    prepare_ms: float | None = None
    select_ms: float | None = None


@dataclass(frozen=True)
class Skip:
    """The path cannot run here (library missing, backend refuses the spec); not an error."""

    reason: str


@dataclass(frozen=True)
class Unsupported:
    """Graph mode is not served here (the backend or its RoPE pass cannot be replayed)."""

    reason: str


def qkv_views(
    packed: torch.Tensor, spec: AttentionSpec, tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V as ``[tokens, heads, D]`` views of the first ``tokens`` packed rows (no copy)."""
    rows = packed[:tokens].view(tokens, spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim)
    q, k, v = rows.split_with_sizes((spec.num_heads, spec.num_kv_heads, spec.num_kv_heads), 1)
    return q, k, v


def refusal_text(exc: NoBackendError, backend: str | None) -> str:
    """The reasons ``backend`` gave (all of the message for an automatic choice)."""
    if backend is None:
        return str(exc)
    reasons = [str(r) for name, rs in exc.reasons if name == backend for r in rs]
    return "; ".join(reasons) if reasons else str(exc)


# --- RoPE the way an engine without the contract does it: torch ops on Q/K copies ----------


@dataclass(frozen=True, eq=False)
class RopeTables:
    """cos/sin of every token's angles, float32 ``[tokens, 1, rotary_dim / 2]``."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    interleaved: bool


def rope_tables(spec: AttentionSpec, params: FMHAParams) -> RopeTables | None:
    """Per-batch RoPE tables from the positions (restarting at 0 in each sequence)."""
    if spec.rope is None:
        return None
    r = spec.rotary_dim
    pos = params.positions.to(torch.float64)
    exponent = torch.arange(r // 2, dtype=torch.float64, device=pos.device) * 2.0 / r
    angles = pos[:, None] * (spec.rope.theta ** (-exponent))[None, :]
    return RopeTables(
        cos=angles.cos().to(torch.float32)[:, None, :],
        sin=angles.sin().to(torch.float32)[:, None, :],
        rotary_dim=r,
        interleaved=spec.rope.interleaved,
    )


def _rotated_head(x: torch.Tensor, t: RopeTables) -> torch.Tensor:
    """The rotated leading ``rotary_dim`` dims of ``x [T, H, D]``, float32 math, x's dtype."""
    head = x[..., : t.rotary_dim].to(torch.float32)
    if t.interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        rot = torch.stack((a * t.cos - b * t.sin, b * t.cos + a * t.sin), dim=-1).flatten(-2)
    else:
        a, b = head.chunk(2, dim=-1)
        rot = torch.cat((a * t.cos - b * t.sin, b * t.cos + a * t.sin), dim=-1)
    return rot.to(x.dtype)


def rotated(x: torch.Tensor, t: RopeTables) -> torch.Tensor:
    """A new, rotated copy of ``x [T, H, D]`` (Hugging Face style, out of place)."""
    head = _rotated_head(x, t)
    if t.rotary_dim == x.shape[-1]:
        return head
    return torch.cat((head, x[..., t.rotary_dim :]), dim=-1)


def rotate_(x: torch.Tensor, t: RopeTables) -> None:
    """Rotate ``x [T, H, D]`` in place."""
    x[..., : t.rotary_dim].copy_(_rotated_head(x, t))


# --- (a), (b), (c): the public API ---------------------------------------------------------


def with_batch_preprocess(details: dict[str, str], batch_mode: str) -> dict[str, str]:
    """The record with ``preprocess`` set to what this batch runs; a per-batch policy (fused
    RoPE up to some length) moves to ``preprocess_policy``."""
    policy = details.get("preprocess")
    if policy == batch_mode:
        return details
    out = {**details, "preprocess": batch_mode}
    if policy is not None:
        out["preprocess_policy"] = policy
    return out


def build_public(
    spec: AttentionSpec,
    params: FMHAParams,
    *,
    backend: str | None,
    prepare_iters: int = 10,
) -> PreparedPath | Skip:
    """``select`` (auto when ``backend`` is None) + ``prepare``; ``run`` is ``forward``.

    One plan serves every timed call, as an engine's plan serves every layer of its batch: the
    timed calls rotate a few input buffers past the L2, as the layers of an engine get their
    QKV from a few allocator blocks in turn, and the plan checks each buffer once.

    An explicitly named backend that refuses the spec is a `Skip` carrying its reasons; the
    automatic choice failing is an error.
    """
    t0 = time.perf_counter()
    try:
        # strict=False: a start-up canary is the engine's choice, not part of what is timed.
        selection = select(spec, device=params.device, backend=backend, strict=False)
    except NoBackendError as exc:
        if backend is None:
            raise
        return Skip(refusal_text(exc, backend))
    select_ms = (time.perf_counter() - t0) * 1e3
    impl = selection.backend
    details = dict(selection.details)
    details["selected_by"] = selection.source
    impl.prepare(params)  # the first plan may load or build kernels: not what is timed
    synchronize(params.device)
    prepare_ms = time_host(lambda: impl.prepare(params), iters=prepare_iters, device=params.device)
    plan = impl.prepare(params)
    details = with_batch_preprocess(details, plan.preprocess)
    forward = impl.forward

    def run(qkv: torch.Tensor) -> torch.Tensor:
        return forward(qkv, plan)

    return PreparedPath(run, selection.name, details, prepare_ms, select_ms)


# --- (e): Hugging Face style padded SDPA --------------------------------------------------


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, Hkv, L, D] -> [B, Hkv * group, L, D]``, query head h reading KV head h // group."""
    if group == 1:
        return x
    b, h, length, d = x.shape
    return x[:, :, None].expand(b, h, group, length, d).reshape(b, h * group, length, d)


def build_padded_sdpa(
    spec: AttentionSpec, params: FMHAParams, tables: RopeTables | None
) -> PreparedPath:
    """Pad to ``[B, maxlen, H, D]``, SDPA with a ``[B, 1, L, L]`` boolean mask, unpad.

    RoPE is applied out of place on the tokens and GQA by repeating K/V, as Hugging Face
    models do when they pass an attention mask to SDPA.
    """
    lengths = params.input_lengths
    batch, longest = len(lengths), params.max_seqlen_q
    tokens, dev = params.token_q_num, params.device
    index = torch.cat(
        [torch.arange(n, dtype=torch.int64) + b * longest for b, n in enumerate(lengths)]
    ).to(dev)
    pos = torch.arange(longest, device=dev)
    valid = pos[None, :] < torch.tensor(lengths, device=dev)[:, None]
    mask = valid[:, None, None, :].expand(batch, 1, longest, longest)
    if spec.causal:
        mask = mask & (pos[None, :] <= pos[:, None])
    mask = mask.contiguous()
    d = spec.head_dim

    def pad(x: torch.Tensor, heads: int) -> torch.Tensor:
        padded = x.new_zeros(batch * longest, heads, d)
        padded.index_copy_(0, index, x)
        return padded.view(batch, longest, heads, d).transpose(1, 2)

    def run(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv_views(qkv, spec, tokens)
        if tables is not None:
            q, k = rotated(q, tables), rotated(k, tables)
        out = F.scaled_dot_product_attention(
            pad(q, spec.num_heads),
            _repeat_kv(pad(k, spec.num_kv_heads), spec.group_size),
            _repeat_kv(pad(v, spec.num_kv_heads), spec.group_size),
            attn_mask=mask,
            scale=spec.scale,
        )
        return out.transpose(1, 2).reshape(batch * longest, spec.q_width).index_select(0, index)

    return PreparedPath(
        run,
        details={
            "mask": f"bool [{batch}, 1, {longest}, {longest}]",
            "rope": TORCH_OUT_OF_PLACE if tables is not None else "none",
        },
    )


# --- (f): torch.nn.attention.varlen.varlen_attn -------------------------------------------


def build_varlen(
    spec: AttentionSpec, params: FMHAParams, tables: RopeTables | None
) -> PreparedPath | Skip:
    """torch's varlen flash attention on the views; K/V expanded for GQA, RoPE out of place."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return Skip(f"torch.nn.attention.varlen.varlen_attn is missing: {exc}")
    tokens = params.token_q_num
    cu = params.cu_seqlens_q
    longest = params.max_seqlen_q
    window = (-1, 0) if spec.causal else (-1, -1)
    group = spec.group_size

    def run(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv_views(qkv, spec, tokens)
        if tables is not None:
            q, k = rotated(q, tables), rotated(k, tables)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=spec.scale, window_size=window)
        assert isinstance(out, torch.Tensor)  # a tuple only when return_aux asks for the LSE
        return out.reshape(tokens, spec.q_width)

    return PreparedPath(
        run,
        details={
            "window_size": str(window),
            "rope": TORCH_OUT_OF_PLACE if tables is not None else "none",
        },
    )
