"""The integration's per-layer path, each shortcut proven equal to what it replaces: token rows
made by one strided view (against transpose and reshape), and a forward's lane that still
refuses what `refuse_unsupported_call` refuses, layer by layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attn_backends.errors
from attn_backends.integrations import _layout

transformers = pytest.importorskip("transformers")

from attn_backends.integrations import transformers as abt  # noqa: E402
from tests import hf_support  # noqa: E402


def _geometries() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    b, h, s, d = 3, 4, 5, 8
    bshd = torch.randn(b, s, h, d, generator=g)
    wide = torch.randn(b, s, 3 * h * d, generator=g)  # a fused QKV projection's q columns
    return [
        ("[B, S, H, D] transposed", bshd.transpose(1, 2)),
        ("[B, H, S, D] contiguous", torch.randn(b, h, s, d, generator=g)),
        ("q columns of a fused projection", wide[..., : h * d].view(b, s, h, d).transpose(1, 2)),
        ("one row of a larger batch", bshd[1:2].transpose(1, 2)),
        ("one head", torch.randn(b, s, 1, d, generator=g).transpose(1, 2)),
        ("head dim strided", torch.randn(b, s, h, 2 * d, generator=g)[..., ::2].transpose(1, 2)),
        (
            "rows of the batch apart",
            torch.randn(b, 2 * s, h, d, generator=g)[:, :s].transpose(1, 2),
        ),
    ]


@pytest.mark.parametrize("case", range(len(_geometries())), ids=[n for n, _ in _geometries()])
def test_token_rows_equal_transpose_and_reshape(case: int):
    _, x = _geometries()[case]
    batch, heads, seq, dim = x.shape
    layout = _layout.full_rows(batch, seq, x.device)
    rows = abt._token_rows(x, layout)
    want = x.transpose(1, 2).reshape(-1, heads, dim)
    assert rows.shape == (batch * seq, heads, dim)
    assert torch.equal(rows, want)
    assert rows.stride(-1) == 1 and (heads == 1 or rows.stride(1) == dim), "dense heads"
    viewable = x.stride(-1) == 1 and (heads == 1 or x.stride(1) == dim)
    viewable = viewable and (batch == 1 or x.stride(0) == seq * x.stride(2))
    assert (rows.data_ptr() == x.data_ptr()) == viewable, "a view exactly when memory allows"


def test_token_rows_of_a_padded_layout_gather_the_valid_cells():
    x = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    rows = abt._token_rows(x, _layout.from_padding_mask(mask))
    assert torch.equal(rows, x.transpose(1, 2)[mask])


def _bert(dropout: float) -> Any:
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=32,
        attention_probs_dropout_prob=dropout,
        hidden_dropout_prob=0.0,
    )
    abt.register()
    return hf_support.from_config(config, abt.DEFAULT_NAME)


def _attention_modules(model: Any) -> list[torch.nn.Module]:
    assert isinstance(model, torch.nn.Module)
    return [m for m in model.modules() if type(m).__name__ == "BertSelfAttention"]


def test_a_layer_in_training_after_served_layers_is_refused():
    """The layers of one forward share a lane only while their calls are the same: a later
    layer with attention dropout in training is refused even though the first layers' calls
    were served."""
    model = _bert(dropout=0.1)
    ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    served: list[str] = []
    for module in _attention_modules(model):
        module.register_forward_hook(lambda m, a, o: served.append(type(m).__name__))
    with torch.no_grad():
        model(input_ids=ids)
    assert len(served) == 3
    served.clear()
    _attention_modules(model)[-1].train()
    with pytest.raises(attn_backends.errors.IntegrationError, match="dropout"), torch.no_grad():
        model(input_ids=ids)
    assert len(served) == 2, "the layers before it ran; the one in training did not"


def test_output_attentions_is_refused_after_a_served_call_of_the_same_forward():
    """A call that asks for the attention weights is refused although a call of the same
    shapes was served under the same mask a moment before (the lane it would share)."""
    from transformers.masking_utils import bidirectional_mask_function

    model = _bert(dropout=0.0)
    layer = _attention_modules(model)[0]
    mask = abt.padding_mask(1, 5, 5, config=model.config, mask_function=bidirectional_mask_function)
    q = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(2))
    out, _ = abt.attention_forward(layer, q, q, q, mask, scaling=0.25)
    assert out.shape == (1, 5, 2, 16)
    with pytest.raises(attn_backends.errors.IntegrationError, match="output_attentions"):
        abt.attention_forward(layer, q, q, q, mask, scaling=0.25, output_attentions=True)
