"""Attention sinks (transformers' ``s_aux``) through the integration, against the model's own
eager attention: GPT-OSS, whose layers alternate a sliding window of 4 and full attention and
each carry one sink logit per head.

The sinks are set well away from zero (``randomize`` would leave them near 0.1, where a dropped
sink changes the output little), so the negative controls (no sinks, the sinks of another
layer) land far above the tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn_backends as ab  # noqa: E402
import attn_backends.errors  # noqa: E402
from attn_backends.integrations import _hf_features  # noqa: E402
from attn_backends.integrations import transformers as abt  # noqa: E402
from tests import hf_support as hf  # noqa: E402

NAME = abt.register()
LENGTHS = (5, 11, 1, 8)
VOCAB = 120
FP32_TOLERANCE = 2e-5
"""Rounding alone (measured 1e-7)."""
BF16_FACTOR = 1.5
"""In bf16 both paths are judged against fp32 eager on the same weights: the library may be
off by at most this factor times the model's own bf16 eager error (measured: 0.019 against
eager's 0.028; the library keeps the sink terms in float32)."""


def _model(dtype: torch.dtype, head_dim: int = 16) -> tuple[Any, Any]:
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        use_cache=False,
        pad_token_id=0,
    )
    model = hf.from_config(cfg, "eager", seed=3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(torch.randn(sinks.shape, generator=g) * 2.0 + 1.0)
    return model.to(dtype).eval(), cfg


def _batch() -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    ids, mask = hf.padded(seqs, 0)
    return seqs, ids, mask


def _valid(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.cat([hidden[i][mask[i].bool()] for i in range(hidden.shape[0])]).float()


def _served(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _valid(hf.run(model, NAME, input_ids=ids, attention_mask=mask), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_oss_sinks_match_eager(dtype):
    model, _ = _model(dtype)
    _, ids, mask = _batch()
    eager = _valid(hf.run(model, "eager", input_ids=ids, attention_mask=mask), mask)
    if dtype == torch.float32:
        err = hf.relative_error(_served(model, ids, mask), eager)
        assert err <= FP32_TOLERANCE, err
    else:
        anchor_model, _ = _model(torch.float32)
        anchor = _valid(hf.run(anchor_model, "eager", input_ids=ids, attention_mask=mask), mask)
        own = hf.relative_error(eager, anchor)
        err = hf.relative_error(_served(model, ids, mask), anchor)
        assert err <= BF16_FACTOR * own, (err, own)
    served = [s for s in abt.decisions() if s.spec.attention_sinks and s.spec.num_heads == 4]
    assert {s.spec.window for s in served} == {None, ab.SlidingWindow(3, 0)}


def test_gpt_oss_packed_rows_are_refused_by_name():
    """GPT-OSS builds its mask without ``position_ids``, so its own mask reads a packed row as
    one sequence: the check against that mask refuses the batch rather than run another
    attention than the model's."""
    model, _ = _model(torch.float32)
    seqs, _, _ = _batch()
    with pytest.raises(abt.MaskMismatchError, match="GptOssModel"):
        hf.run(model, NAME, **abt.pack_sequences(seqs))


@pytest.mark.parametrize("wrong", ["none", "other-layer"])
def test_wrong_sinks_fail_far_above_tolerance(wrong, monkeypatch):
    """Negative controls: the sinks dropped (the spec without them) or another layer's."""
    model, _ = _model(torch.float32)
    _, ids, mask = _batch()
    eager = _valid(hf.run(model, "eager", input_ids=ids, attention_mask=mask), mask)
    real_fields = _hf_features.hf_features
    real_sinks = _hf_features.sinks_from_hf
    if wrong == "none":
        monkeypatch.setattr(
            _hf_features,
            "hf_features",
            lambda *a, **k: {
                key: v for key, v in real_fields(*a, **k).items() if key != "attention_sinks"
            },
        )
        monkeypatch.setattr(_hf_features, "sinks_from_hf", lambda *a, **k: None)
    else:
        other = {
            id(a.self_attn.sinks): b.self_attn.sinks
            for a, b in zip(model.layers, reversed(model.layers), strict=True)
        }
        assert len(other) == 2

        def swapped(module: Any, kwargs: Any, heads: int) -> torch.Tensor | None:
            sinks = real_sinks(module, kwargs, heads)
            return None if sinks is None else other[id(sinks)]

        monkeypatch.setattr(_hf_features, "sinks_from_hf", swapped)
    got = _served(model, ids, mask)
    err = hf.relative_error(got, eager)
    assert err > 1000 * FP32_TOLERANCE, err


@pytest.mark.parametrize(
    "value", [torch.zeros(3), torch.zeros(4, dtype=torch.long), torch.zeros(1, 4), "sinks"]
)
def test_s_aux_of_another_shape_or_dtype_is_refused_by_name(value):
    q = torch.randn(1, 4, 3, 16, generator=torch.Generator().manual_seed(5))
    layer = torch.nn.Module()
    with pytest.raises(ab.errors.IntegrationError, match="s_aux"):
        abt.attention_forward(layer, q, q, q, None, is_causal=True, s_aux=value)


def test_s_aux_with_a_backend_without_sinks_is_refused_by_name():
    q = torch.randn(1, 4, 3, 16, generator=torch.Generator().manual_seed(5))
    layer = torch.nn.Module()
    with pytest.raises(ab.NoBackendError, match="attention_sinks"):
        abt.attention_forward(
            layer, q, q, q, None, is_causal=True, s_aux=torch.zeros(4), backend="flex"
        )
