"""The one elementwise definition of the spec's mask and scores, for every built-in that
evaluates them itself.

`visible` is a FlexAttention ``mask_mod``: same sequence, the causal rule, the sliding window, the
chunk (same ``position // chunk_size``) and the headwise sink-or-window term. `score` is a
``score_mod``: the soft-cap, then the ALiBi bias, on the already scaled score. Both are plain tensor
expressions over the query and key indices, so the dense path (torch-sdpa's ``attn_mask``) is the
same functions evaluated on broadcast ``arange``s, as flex's own ``create_mask`` does. The float64
reference (`attn_backends.reference_attention`) is written separately on purpose: it checks this
code.

Windows compare index differences (``q - k <= left``), never ``q + right``: a side up to
2**31 - 1 (`SlidingWindow`'s bound) stays within int32 and int64 index math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_backends import AttentionSpec
from attn_backends_builtin._flex_kernel import MaskMod, ScoreMod, document_ids


@dataclass(frozen=True, eq=False)
class MaskTerms:
    """The per-batch tensors the mask indexes, all ``[tokens]`` on the batch's device except
    ``windowed_head``."""

    doc: torch.Tensor
    """The sequence each packed token belongs to."""
    pos: torch.Tensor
    """Each token's position in its sequence (chunks, headwise sinks)."""
    windowed_token: torch.Tensor | None = None
    """Headwise: the token's sequence is long enough for the window heads' rule."""
    windowed_head: torch.Tensor | None = None
    """Headwise: bool ``[Hq]``, the head follows the sink-or-window rule (not a retrieval
    head)."""


def mask_terms(spec: AttentionSpec, lengths: tuple[int, ...], device: torch.device) -> MaskTerms:
    """The terms of a packed batch of sequences of ``lengths`` tokens."""
    counts = torch.tensor(lengths, dtype=torch.int64)
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    windowed_token = windowed_head = None
    config = spec.headwise
    if config is not None:
        windowed = torch.tensor([not config.is_full_for(n) for n in lengths], dtype=torch.bool)
        windowed_token = torch.repeat_interleave(windowed, counts).to(device)
        heads = [h not in config.retrieval_heads for h in range(spec.num_heads)]
        windowed_head = torch.tensor(heads, dtype=torch.bool, device=device)
    return MaskTerms(document_ids(lengths, device), pos.to(device), windowed_token, windowed_head)


def visible(spec: AttentionSpec, terms: MaskTerms) -> MaskMod:
    """The ``mask_mod``: True where query ``q_idx`` may see key ``kv_idx`` (packed indices)."""
    causal = spec.causal
    window = spec.window
    chunk = spec.chunk_size
    config = spec.headwise

    def mask(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        seen = terms.doc[q_idx] == terms.doc[kv_idx]
        if causal:
            seen = seen & (kv_idx <= q_idx)
        if window is not None:
            seen = seen & (q_idx - kv_idx <= window.left) & (kv_idx - q_idx <= window.right)
        if chunk is not None:
            # Positions, not packed indices: chunks start again with every sequence.
            seen = seen & (terms.pos[q_idx] // chunk == terms.pos[kv_idx] // chunk)
        if config is not None:
            assert terms.windowed_token is not None and terms.windowed_head is not None
            local = (terms.pos[kv_idx] < config.sink_token_num) | (
                q_idx - kv_idx <= config.swa_token_num
            )
            restricted = terms.windowed_head[h] & terms.windowed_token[q_idx]
            seen = seen & (local | ~restricted)
        return seen

    return mask


def score(spec: AttentionSpec, slopes: torch.Tensor | None) -> ScoreMod | None:
    """The ``score_mod``: ``cap * tanh(s / cap)``, then ``+ slope_h * (j - i)`` (causal) or
    ``- slope_h * |i - j|`` on the already scaled score ``s``; ``None`` when neither is on.
    ``slopes``: float32 ``[Hq]`` (`alibi_slopes`) when the spec has ALiBi."""
    softcap = spec.logit_softcap
    causal = spec.causal
    if softcap is None and slopes is None:
        return None

    def modify(
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

    return modify


def alibi_slopes(spec: AttentionSpec, device: torch.device) -> torch.Tensor | None:
    """float32 ``[Hq]`` ALiBi slopes on ``device``, or ``None`` without ALiBi."""
    if spec.alibi is None:
        return None
    values = spec.alibi.slopes_for(spec.num_heads)
    return torch.tensor(values, dtype=torch.float32, device=device)


def dense_mask(spec: AttentionSpec, length: int, device: torch.device) -> torch.Tensor:
    """SDPA's ``attn_mask`` for one sequence of ``length`` tokens: `visible` and `score`
    evaluated on broadcast ``arange``s. Boolean ``[L, L]`` (``[H, L, L]`` with headwise) when
    only keys are hidden; with ALiBi an additive ``[H, L, L]`` in the spec's dtype (the bias
    is relative to the query, so the weights that matter, near keys, keep their precision in
    16-bit dtypes). The soft-cap acts on the scores inside SDPA and is not expressible here."""
    terms = mask_terms(spec, (length,), device)
    idx = torch.arange(length, device=device)
    q_idx, kv_idx, first = idx[:, None], idx[None, :], idx[:1]
    heads = torch.arange(spec.num_heads, device=device)[:, None, None]
    seen = visible(spec, terms)(first, heads, q_idx, kv_idx)
    slopes = alibi_slopes(spec, device)
    if slopes is None:
        return seen
    # The ALiBi term of `score` on zero scores (a soft-cap, never declared here, maps 0 to 0).
    modify = score(spec, slopes)
    assert modify is not None
    zeros = torch.zeros(length, length, dtype=torch.float32, device=device)
    bias = modify(zeros, first, heads, q_idx, kv_idx)
    return bias.masked_fill(~seen, float("-inf")).to(spec.dtype)
