"""ALiBi against BLOOM's own attention, layer by layer.

BLOOM and MPT compute attention inside their own modules (no call through transformers'
attention-function registry), so `attn_backends.integrations.transformers` cannot intercept
them. The proof is therefore per layer: a tiny BLOOM runs its own eager forward on a padded
batch (its ALiBi from ``build_alibi_tensor``, its causal and padding mask); each layer's
input hidden states and its attention context (before the output projection) are recorded.
The same layer's q/k/v, projected by BLOOM's own ``query_key_value`` and ``_reshape``, then
go through ``select``/``prepare``/``forward`` with ``causal=True, alibi=AlibiSpec()``, per
sequence on the valid tokens.

Tolerance: the float64 reference on the same q/k/v is the truth; HF's own error against it,
times a small factor, plus a floor of one unit in the last place, bounds the distance allowed
between HF and the backend. Six heads: BLOOM's slopes for a head count that is not a power of
two take the interleaved extra slopes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn_backends as ab  # noqa: E402
import attn_backends.plugin as abp  # noqa: E402
import attn_backends.reference  # noqa: E402

HEADS = 6
HEAD_DIM = 16
LENGTHS = (5, 11, 1, 8)
VOCAB = 120
SPREAD_FACTOR = 3.0


@dataclasses.dataclass
class Layer:
    module: Any
    hidden_in: torch.Tensor
    context: torch.Tensor  # [B, S, H * D], HF's attention output before its dense projection


def _bloom(dtype: torch.dtype) -> Any:
    cfg = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, n_layer=2, n_head=HEADS, use_cache=False
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="eager")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * (1.5 / math.sqrt(p.shape[-1])) if p.dim() >= 2 else 1 + 0.1 * noise)
    return model.to(dtype).eval()


def _padded(left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[row, cols] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, cols] = 1
    return ids, mask


def _recorded_layers(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> list[Layer]:
    """Run BLOOM's own forward; record each attention layer's input and context."""
    layers: list[Layer] = []
    handles = []
    for block in model.h:
        attn = block.self_attention
        merge = attn._merge_heads

        def record_context(x: torch.Tensor, _attn: Any = attn, _merge: Any = merge) -> Any:
            out = _merge(x)
            layers[-1].context = out.detach().clone()
            return out

        def record_input(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            layers.append(Layer(_m, hidden.detach().clone(), torch.empty(0)))

        attn._merge_heads = record_context
        handles.append(attn.register_forward_pre_hook(record_input, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
        for block in model.h:
            del block.self_attention._merge_heads
    return layers


def _spec(dtype: torch.dtype, scale: float, **features: Any) -> ab.AttentionSpec:
    return ab.AttentionSpec(
        num_heads=HEADS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        causal=True,
        softmax_scale=scale,
        **features,
    )


def _errors(layer: Layer, valid: torch.Tensor, spec: ab.AttentionSpec) -> tuple[float, float]:
    """(backend vs HF, HF vs the float64 reference) over the valid tokens of the batch."""
    with torch.no_grad():
        q, k, v = layer.module._reshape(layer.module.query_key_value(layer.hidden_in))
    rows = [x.transpose(1, 2)[valid] for x in (q, k, v)]  # [tokens, H, D] each
    params = ab.FMHAParams.from_lengths(valid.sum(1).tolist(), device="cpu")
    backend = ab.select(spec, device="cpu").backend
    got = backend.forward(tuple(rows), backend.prepare(params))
    packed = torch.cat([r.reshape(r.shape[0], -1) for r in rows], dim=1)
    truth = ab.reference_attention(packed, dataclasses.replace(spec, dtype=packed.dtype), params)
    hf = layer.context[valid]
    return ab.reference.relative_error(
        got.reshape(hf.shape), hf.double()
    ), ab.reference.relative_error(hf, truth)


@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bloom_layers_match_causal_alibi_with_bloom_slopes(dtype, left):
    model = _bloom(dtype)
    ids, mask = _padded(left)
    valid = mask.bool()
    layers = _recorded_layers(model, ids, mask)
    assert len(layers) == 2
    for layer in layers:
        spec = _spec(dtype, layer.module.inv_norm_factor, alibi=ab.AlibiSpec())
        error, hf_spread = _errors(layer, valid, spec)
        tolerance = SPREAD_FACTOR * hf_spread + torch.finfo(dtype).eps
        assert error <= tolerance, (error, tolerance)


@pytest.mark.parametrize(
    "wrong",
    [
        None,
        ab.AlibiSpec(tuple(reversed(abp.bloom_alibi_slopes(HEADS)))),
        ab.AlibiSpec(tuple(2 * s for s in abp.bloom_alibi_slopes(HEADS))),
    ],
    ids=["no-alibi", "slopes-reversed", "slopes-doubled"],
)
def test_wrong_alibi_fails_far_above_tolerance(wrong):
    model = _bloom(torch.float32)
    ids, mask = _padded(False)
    valid = mask.bool()
    layer = _recorded_layers(model, ids, mask)[0]
    scale = layer.module.inv_norm_factor
    _, hf_spread = _errors(layer, valid, _spec(torch.float32, scale, alibi=ab.AlibiSpec()))
    tolerance = SPREAD_FACTOR * hf_spread + torch.finfo(torch.float32).eps
    error, _ = _errors(layer, valid, _spec(torch.float32, scale, alibi=wrong))
    assert error > 10 * tolerance, (error, tolerance)


def test_bloom_does_not_call_the_attention_registry():
    """Why this file exists: the integration cannot see BLOOM's attention."""
    from transformers.models.bloom import modeling_bloom

    assert not hasattr(modeling_bloom, "ALL_ATTENTION_FUNCTIONS")
