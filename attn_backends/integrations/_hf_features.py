"""The one place that turns what a transformers layer asks of attention into spec fields.

transformers hands its attention function the layer's features as keyword arguments; the
model has already applied RoPE, so only the score-side features arrive here:

- ``sliding_window=W`` (an int, or None on global layers). Every family that passes it means
  "distance below W": HF's masks keep key ``j`` for query ``i`` when ``i - W < j`` (Mistral,
  Qwen2, Gemma 2, Gemma 3 causal), ``|i - j| < W`` (Gemma 3 with
  ``use_bidirectional_attention``, whose config stores ``S // 2 + 1`` for config.json's S)
  and ``|i - j| <= local_attention // 2`` with ``W = local_attention // 2 + 1`` (ModernBERT).
  HF's flash path reads it the same way, as ``window_size=(W - 1, W - 1)`` with causality on
  top. The kwarg alone does not say which side is open: the layer's causal flag does, so a
  causal layer gets ``left = W - 1, right = 0`` and a bidirectional one ``W - 1`` both ways.
- ``softcap=C`` (Gemma 2's ``attn_logit_softcapping``): ``C * tanh(scaled scores / C)``, which
  is the spec's ``logit_softcap``.
- ``s_aux`` (attention sinks: GPT-OSS, Granite SWA, Flint, ...): a float ``[Hq]`` tensor of
  per-head logits that every one of those families adds to the softmax's denominator (a
  concatenated column dropped after the softmax, or the same through ``sigmoid(lse - s)``).
  That is the spec's ``attention_sinks``; the tensor itself goes to ``forward`` per layer
  (`sinks_from_hf`), and a backend without sinks refuses the spec by name.
- ``position_bias`` (a learned bias tensor) has no spec field and is refused by name.

ALiBi never arrives here: BLOOM and MPT compute their attention inside their own modules
without transformers' attention-function registry, so no registered function sees them.

Some features reach only the mask hook: Llama 4's chunked attention (``attention_chunk_size``)
is a mask (``create_chunked_causal_mask``), never a kwarg. transformers hands the hook
``local_size=attention_chunk_size`` for it (and ``local_size=sliding_window`` for window masks),
and the chunked layers get that mask: `chunk_from_hf` reads it as the spec's ``chunk_size``,
which the attention function takes from the mask its layer was handed. transformers measures
chunks from each row's first valid token (``column - left padding``) and, on packed rows, over
the restarting ``position_ids``: that is the spec's rule (positions restart per sequence)
wherever a row's valid tokens are contiguous. Both readings are proven, never assumed: the
model's own mask function is evaluated against the spec (`_hf_mask`), so a chunked mask
mistaken for a window (or a padding hole, where the two measures differ) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._values._errors import FeatureNotSupportedError, IntegrationError
from .._values._features import SlidingWindow

__all__ = ["chunk_from_hf", "hf_features", "sinks_from_hf", "window_from_hf"]

_REFUSED = {
    "position_bias": "position_bias (a learned attention bias)",
}


def window_from_hf(sliding_window: int, *, causal: bool) -> SlidingWindow:
    """The spec window for transformers' ``sliding_window`` kwarg on a causal or
    bidirectional layer: keys closer than ``sliding_window`` positions stay visible."""
    reach = sliding_window - 1
    return SlidingWindow(left=reach, right=0 if causal else reach)


def hf_features(
    module: torch.nn.Module, kwargs: Mapping[str, Any], *, causal: bool
) -> dict[str, object]:
    """`AttentionSpec` fields (``window``, ``logit_softcap``, ``attention_sinks``) for one
    attention call of ``module``; features without a spec field are refused with
    `FeatureNotSupportedError`."""
    name = type(module).__name__
    for key, feature in _REFUSED.items():
        if kwargs.get(key) is not None:
            raise FeatureNotSupportedError(
                f"{name} asks for {feature}={_short(kwargs[key])}, which attn_backends does "
                "not support yet; load this model with attn_implementation='sdpa' or 'eager'"
            )
    fields: dict[str, object] = {}
    window = kwargs.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise IntegrationError(
                f"{name} passed sliding_window={_short(window)}; attn_backends reads it as "
                "transformers does, a positive int (keys closer than it stay visible)"
            )
        fields["window"] = window_from_hf(window, causal=causal)
    cap = kwargs.get("softcap")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise IntegrationError(
                f"{name} passed softcap={_short(cap)}; expected a positive float, the "
                "config's attn_logit_softcapping"
            )
        fields["logit_softcap"] = float(cap)
    if kwargs.get("s_aux") is not None:
        fields["attention_sinks"] = True
    return fields


def sinks_from_hf(
    module: torch.nn.Module, kwargs: Mapping[str, Any], num_heads: int
) -> torch.Tensor | None:
    """The layer's sink logits from ``s_aux``, checked to be what every family passes: a
    float tensor of one logit per query head of this call (None: the layer has none)."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        return None
    if (
        not isinstance(sinks, torch.Tensor)
        or not sinks.dtype.is_floating_point
        or tuple(sinks.shape) != (num_heads,)
    ):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else None
        raise IntegrationError(
            f"{type(module).__name__} passed s_aux={_short(sinks)} (shape {shape}); "
            f"attn_backends reads it as transformers' models do, a float tensor of "
            f"{num_heads} logits, one per query head of the call"
        )
    return sinks


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return repr(value)


def chunk_from_hf(config: Any, local_size: object, model_name: str) -> int | None:
    """The spec's ``chunk_size`` for the mask the hook is asked for: the config's
    ``attention_chunk_size`` when ``local_size`` is it (transformers' chunked mask), else None.
    A chunk that is not a positive int is refused with `IntegrationError`."""
    if local_size is None:  # transformers names no local size: not a chunked mask
        return None
    # the config is transformers' untyped object; only chunked models carry this attribute
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None or local_size != chunk:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise IntegrationError(
            f"{model_name} asks for chunked attention with attention_chunk_size="
            f"{_short(chunk)}; attn_backends reads it as transformers does, a positive int "
            "(positions per chunk)"
        )
    return chunk
