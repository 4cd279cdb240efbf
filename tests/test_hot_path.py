"""The integration's per-layer path, each shortcut proven equal to what it replaces: token rows
made by one strided view (against transpose and reshape), and a forward's lane that still
refuses what `refuse_unsupported_call` refuses, layer by layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attn_backends.errors
from attn_backends.integrations import _hf_mask, _layout

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


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), scale=scale
    ).transpose(1, 2)


def test_calls_of_other_strides_in_one_forward_take_lanes_of_their_own():
    """The lane key holds each input's strides and offset (what the bound forward's checks
    read): a call whose q/k/v are laid out otherwise than an earlier one of the same shapes
    resolves a lane of its own, and both compute their own attention."""
    from transformers.masking_utils import bidirectional_mask_function

    model = _bert(dropout=0.0)
    layer = _attention_modules(model)[0]
    mask = abt.padding_mask(2, 5, 5, config=model.config, mask_function=bidirectional_mask_function)
    request = _hf_mask.request_of(mask)
    assert request is not None
    g = torch.Generator().manual_seed(4)
    projected = torch.randn(2, 5, 3, 2, 16, generator=g)  # a fused projection, transposed
    views = [projected[:, :, i].transpose(1, 2) for i in range(3)]
    dense = [torch.randn(2, 2, 5, 16, generator=g) for _ in range(3)]
    for q, k, v in (views, dense, views):
        out, _ = abt.attention_forward(layer, q, k, v, mask, scaling=0.25)
        want = _sdpa(q, k, v, 0.25)
        assert hf_support.relative_error(out, want) < 1e-6
    assert len(request.lanes) == 2


def _bert_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the class-level steps of a call's resolution run (spied)."""
    from attn_backends.integrations import _hf_call, _hf_proof

    counts = {"refuse": 0, "spec": 0, "selection": 0, "proof": 0}
    for name, owner, attribute in (
        ("refuse", _hf_call, "refuse_unsupported_call"),
        ("spec", _hf_call, "layer_spec"),
        ("selection", _hf_call, "layer_selection"),
        ("proof", _hf_proof, "mask_proof"),
    ):
        real = getattr(owner, attribute)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, attribute, spy)
    return counts


def test_a_class_of_call_is_resolved_once_across_forwards(monkeypatch):
    """Whole-row batches of new shapes reuse their class's spec, selection and mask proof
    (refusals included): only the first forward resolves them; each batch still gets its own
    layout and plan, and computes transformers' own attention."""
    model = _bert(dropout=0.0)
    reference = hf_support.from_config(model.config, "sdpa")
    reference.load_state_dict(model.state_dict())
    counts = _bert_calls(monkeypatch)
    for rows, cols in ((2, 6), (1, 9), (3, 4)):
        ids = torch.randint(3, 50, (rows, cols), generator=torch.Generator().manual_seed(cols))
        got = hf_support.run(model, abt.DEFAULT_NAME, input_ids=ids)
        want = hf_support.run(reference, "sdpa", input_ids=ids)
        assert hf_support.relative_error(got, want) < 1e-5
        if (rows, cols) == (2, 6):
            first = dict(counts)
            assert first["refuse"] == first["spec"] == 1, "one resolution per forward"
    assert counts == first, "later forwards of the class resolved nothing of it again"


def test_a_class_is_resolved_again_for_another_dtype_and_a_padded_batch_is_proved_per_batch(
    monkeypatch,
):
    model = _bert(dropout=0.0)
    ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(5))
    counts = _bert_calls(monkeypatch)
    hf_support.run(model, abt.DEFAULT_NAME, input_ids=ids)
    before = dict(counts)
    model.to(torch.bfloat16)
    hf_support.run(model, abt.DEFAULT_NAME, input_ids=ids)
    assert counts["spec"] == 2 * before["spec"], "bfloat16 calls are another class"
    padded = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    proofs = counts["proof"]
    hf_support.run(model, abt.DEFAULT_NAME, input_ids=ids, attention_mask=padded)
    hf_support.run(model, abt.DEFAULT_NAME, input_ids=ids, attention_mask=padded)
    assert counts["proof"] == proofs + 2, "a padded batch's rows are proved per batch"


def test_a_packed_lane_keeps_its_row_views_and_later_layers_compute_their_own_attention(
    monkeypatch,
):
    """A packed batch's q, k and v are strided views of token rows: the lane keeps those views'
    arguments (fixed by the geometry its key holds), so only the layer that resolves the lane
    reads the tensors' strides; every layer still attends its own tensors, each sequence
    exactly as it does alone on transformers' sdpa."""
    model = _bert(dropout=0.0)
    reference = hf_support.from_config(model.config, "sdpa")
    reference.load_state_dict(model.state_dict())
    sequences = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    cut: list[None] = []
    real = abt._kernel_input

    def spy(*args: Any) -> Any:
        cut.append(None)
        return real(*args)

    monkeypatch.setattr(abt, "_kernel_input", spy)
    packed = dict(abt.pack_sequences(sequences))
    got = hf_support.run(model, abt.DEFAULT_NAME, **packed)
    assert len(cut) == 1, "the two later layers viewed their rows from the lane's arguments"
    boundaries = packed["cu_seq_lens_q"]
    assert isinstance(boundaries, torch.Tensor)
    parts = abt.unpack_hidden(got, boundaries)
    for sequence, part in zip(sequences, parts, strict=True):
        want = hf_support.run(reference, "sdpa", input_ids=torch.tensor([sequence]))[0]
        assert hf_support.relative_error(part, want) < 1e-5
