"""Hugging Face transformers models run their attention through this library.

``register()`` adds an attention function (and a matching mask function) to transformers'
registries; a model loaded with ``attn_implementation="attn_backends"`` then calls it in every
layer with Q/K/V ``[B, H, S, D]``, already rotated by the model. The function builds an
`AttentionSpec` from the call (``rope=None``: nothing left to rotate), lets `select` pick a
backend once per spec, prepares one plan per batch for all layers, and runs the backend on
``[tokens, H, D]`` views.

Two input forms:

- **packed** (no padding anywhere): one row holding every sequence back to back, with
  ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs (see `pack_sequences`) or ``position_ids`` that
  restart per sequence;
- **padded**: ``[B, S]`` rows with a 2-D attention mask (right or left padding). The valid
  tokens are gathered per layer with indices found once per batch; padded output rows are 0.

Sliding windows and logit soft-capping become spec fields (`_hf_features` is the mapping);
a model that alternates local and global layers gets one plan per distinct spec per batch.
What the library cannot serve is refused with `IntegrationError` (dropout while training,
``output_attentions``, a 4-D mask that is not a padding/causal mask, cross-attention or a KV
cache) or `FeatureNotSupportedError` (attention sinks, a learned position bias).

Each new decision is logged (logger ``attn_backends``, INFO) with the layer class, the spec
and the backend; `decisions()` returns them all.

transformers is imported only inside `register`: ``import attn_backends`` never needs it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch

from .._errors import IntegrationError
from .._selector import Selection, select
from .._spec import AttentionSpec
from . import _hf_features, _layout
from ._batch_cache import cached_layout, new_forward_pass
from ._layout import BatchLayout

DEFAULT_NAME = "attn_backends"

__all__ = [
    "DEFAULT_NAME",
    "PackedBatch",
    "attention_forward",
    "decisions",
    "pack_sequences",
    "padding_mask",
    "register",
    "unpack_hidden",
]

_selections: dict[tuple[AttentionSpec, torch.device, str | None], Selection] = {}
_selections_lock = threading.Lock()
logger = logging.getLogger("attn_backends")


def register(name: str = DEFAULT_NAME, *, backend: str | None = None) -> str:
    """Register the attention and mask functions under ``name`` and return it, for
    ``AutoModel.from_pretrained(..., attn_implementation=name)``.

    ``backend`` names the backend to use (refused with its reasons when it does not fit, never
    swapped); ``None`` lets `select` choose per spec and device.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attend = (
        attention_forward
        if backend is None
        else functools.partial(attention_forward, backend=backend)
    )
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def decisions() -> list[Selection]:
    """The backend decisions the attention function has made so far (one per spec, device and
    requested backend): ``[s.name for s in decisions()]`` says which backend served a model."""
    with _selections_lock:
        return list(_selections.values())


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor | None:
    """transformers' mask hook: the 2-D padding mask as given (a new view object), or None.

    No ``[B, 1, S, S]`` mask is built: causality is the spec's ``causal`` flag and the padding
    becomes sequence lengths. A model builds its masks once per forward, before its first
    layer, so this is also where the per-batch layouts of the previous forward expire.
    """
    new_forward_pass()
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


def _refuse_unsupported_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    kwargs: Mapping[str, Any],
) -> None:
    name = type(module).__name__
    if dropout > 0 and module.training:
        raise IntegrationError(
            f"{name} runs attention dropout {dropout} in training; attn_backends serves "
            "inference only: call model.eval() or set the attention dropout to 0"
        )
    if kwargs.get("output_attentions"):
        raise IntegrationError(
            "output_attentions=True needs the attention weights, which attn_backends never "
            "materialises; use attn_implementation='eager' for that call"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise IntegrationError(
            f"{name} passed q/k/v of shapes {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}; expected [batch, heads, seq, head_dim]"
        )
    if key.shape[2] != query.shape[2] or key.shape[0] != query.shape[0]:
        raise IntegrationError(
            f"{name} attends {query.shape[2]} queries to {key.shape[2]} keys: cross-attention "
            "or a KV cache, which the no-cache prefill path does not serve; call the model "
            "with use_cache=False on self-attention models"
        )
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise IntegrationError(
            f"{name} has q/k/v head dims {query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]}; "
            "attn_backends needs one head_dim for all three"
        )


def _spec_for(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    is_causal: bool | None,
    kwargs: Mapping[str, Any],
) -> AttentionSpec:
    # transformers' own rule for its attention modules (untyped, not all define ``is_causal``):
    # the call's flag, else the module's, else causal, as its sdpa path reads it.
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    features = _hf_features.hf_features(module, kwargs, causal=causal)
    return AttentionSpec(
        num_heads=int(query.shape[1]),
        num_kv_heads=int(key.shape[1]),
        head_dim=int(query.shape[-1]),
        dtype=query.dtype,
        causal=causal,
        rope=None,  # the model rotated q and k before calling attention
        softmax_scale=None if scaling is None else float(scaling),
        **features,  # type: ignore[arg-type]
    )


def _selection(
    spec: AttentionSpec, device: torch.device, backend: str | None, module: torch.nn.Module
) -> Selection:
    key = (spec, device, backend)
    found = _selections.get(key)
    if found is None:
        found = select(spec, device=device, backend=backend)
        with _selections_lock:
            _selections[key] = found
        logger.info(
            "attn_backends: %s on %s served by %s (causal=%s, window=%s, logit_softcap=%s, "
            "%d/%d heads, head_dim %d, %s)",
            type(module).__name__,
            device,
            found.name,
            spec.causal,
            spec.window.describe() if spec.window is not None else None,
            spec.logit_softcap,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            str(spec.dtype).removeprefix("torch."),
        )
    return found


def _batch_layout(
    attention_mask: torch.Tensor | None,
    batch: int,
    seq: int,
    device: torch.device,
    spec: AttentionSpec,
    kwargs: Mapping[str, Any],
) -> BatchLayout:
    """The layout from the first source that describes the batch: the mask, then the
    ``cu_seq_lens_q`` kwarg, then 2-D ``position_ids``; otherwise each row is one sequence."""
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            return cached_layout(
                "mask4d",
                attention_mask,
                (spec.causal,),
                lambda: _layout.from_padding_mask(_padding_of_4d(attention_mask, spec.causal)),
            )
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seq):
            raise IntegrationError(
                f"attention mask of shape {tuple(attention_mask.shape)} for a batch of {batch} x "
                f"{seq} tokens; pass the 2-D [batch, seq] padding mask"
            )
        return cached_layout(
            "mask", attention_mask, (), lambda: _layout.from_padding_mask(attention_mask)
        )
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        cu_k = kwargs.get("cu_seq_lens_k")
        return cached_layout(
            "cu_seqlens",
            cu,
            (batch, seq, id(cu_k)),
            lambda: _layout.from_cu_seqlens(_same_keys(cu, cu_k), batch, seq),
        )
    positions = kwargs.get("position_ids")
    if (
        isinstance(positions, torch.Tensor)
        and positions.dim() == 2
        and positions.shape[-1] == seq
        and positions.shape[0] in (1, batch)
    ):
        return cached_layout(
            "positions",
            positions,
            (batch, seq),
            lambda: _layout.from_position_ids(positions, batch, seq),
        )
    return cached_layout(
        "full", None, (batch, seq, device), lambda: _layout.full_rows(batch, seq, device)
    )


def _same_keys(cu_q: torch.Tensor, cu_k: object) -> torch.Tensor:
    """``cu_seq_lens_q``, once checked (per batch) to equal ``cu_seq_lens_k`` when given."""
    if isinstance(cu_k, torch.Tensor) and cu_k is not cu_q and not torch.equal(cu_k, cu_q):
        raise IntegrationError(
            "cu_seq_lens_k differs from cu_seq_lens_q: keys of other lengths than the "
            "queries mean a KV cache or cross-attention; pass equal prefix sums"
        )
    return cu_q


def _padding_of_4d(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    padding = _layout.padding_of_4d(mask, causal=causal)
    if padding is None:
        kind = "causal" if causal else "bidirectional"
        raise IntegrationError(
            f"the 4-D attention mask of shape {tuple(mask.shape)} is not a {kind} padding mask; "
            "attn_backends takes masks that only hide padding (and the future, for causal "
            "layers): pass the 2-D [batch, seq] padding mask, or use attn_implementation="
            "'sdpa' for custom masks"
        )
    return padding


def _token_rows(x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
    """``x [B, H, S, D]`` as ``[tokens, H, D]``: a view when the memory allows, else a copy."""
    per_token = x.transpose(1, 2)  # [B, S, H, D]
    if layout.cells is not None:
        rows, cols = layout.cells
        return per_token[rows, cols]
    flat = per_token.reshape(-1, x.shape[1], x.shape[3])
    if flat.stride(-1) != 1 or (x.shape[1] > 1 and flat.stride(1) != x.shape[3]):
        flat = flat.contiguous()
    return flat


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    backend: str | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: ``(out [B, S, Hq, D], None)``.

    Padded rows of the output are zeros (the model ignores them, as it ignores any value
    there). The spec's ``causal`` flag is ``is_causal`` when given, else ``module.is_causal``.
    """
    _refuse_unsupported_call(module, query, key, value, dropout, kwargs)
    spec = _spec_for(module, query, key, scaling, is_causal, kwargs)
    selection = _selection(spec, query.device, backend, module)
    batch, _, seq, head_dim = query.shape
    layout = _batch_layout(attention_mask, batch, seq, query.device, spec, kwargs)
    plan = layout.plans.get(spec)
    if plan is None:
        plan = selection.backend.prepare(layout.params)
        layout.plans[spec] = plan
    q_rows = _token_rows(query, layout)
    out = selection.backend.forward(
        (q_rows, _token_rows(key, layout), _token_rows(value, layout)),
        plan,  # type: ignore[arg-type]
    )
    heads = spec.num_heads
    if layout.cells is None:
        return out.view(batch, seq, heads, head_dim), None
    full = out.new_zeros(batch, seq, heads, head_dim)
    full[layout.cells] = out.view(-1, heads, head_dim)
    return full, None


class PackedBatch(TypedDict):
    """Keyword arguments of one packed forward: ``model(**packed)``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_q: int
    max_length_k: int


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    *,
    device: torch.device | str | None = None,
    position_offset: int = 0,
) -> PackedBatch:
    """One packed model input: every sequence back to back in a single row, no padding.

    Returns ``input_ids``/``position_ids`` ``[1, T]`` (positions restart at
    ``position_offset`` per sequence: 0 for most models, ``pad_token_id + 1`` for RoBERTa-style
    embeddings), ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 prefix sums) and
    ``max_length_q``/``max_length_k``; pass them all as keyword arguments to the model.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise IntegrationError("pack_sequences needs at least one sequence, none of them empty")
    lengths = [len(s) for s in sequences]
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]) + position_offset
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)  # one tensor for q and k: equal by construction
    return PackedBatch(
        input_ids=ids[None],
        position_ids=positions[None].to(device),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
    )


def unpack_hidden(hidden: torch.Tensor, cu_seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """The per-sequence ``[n_i, C]`` slices (views) of a packed output ``hidden [1, T, C]``."""
    if hidden.dim() != 3 or hidden.shape[0] != 1:
        raise IntegrationError(
            f"unpack_hidden takes a packed [1, tokens, channels] output, got {tuple(hidden.shape)}"
        )
    bounds = [int(x) for x in cu_seq_lens.tolist()]
    return [hidden[0, a:b] for a, b in itertools.pairwise(bounds)]
