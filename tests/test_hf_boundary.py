"""The transformers boundary: a model computes exactly its own attention, or the call raises.

One test (or one parametrised family) per case where the integration once computed another
attention than the model's, or crashed, without an error of its own:

1. models whose attention modules bypass transformers' registry (and packed input that a
   model ignores);
2. mask rules beyond padding, causality and a window (chunks, sequence ids);
3. a padding hole under a sliding window;
4. a 4-D mask rewritten in place under ``inference_mode``;
5. two models pinned to different backends sharing one mask;
6. ``pack_sequences``/``unpack_hidden`` bounds;
7. a prefill with ``use_cache=True``;
8. the backend selection following the registry and the environment.

Tiny configs, seeded random weights, no downloads. Served cases are compared with the model's
own eager attention within a small multiple of HF's own sdpa-vs-eager spread (the method of
``tests/test_hf_parity.py``).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn_backends as ab  # noqa: E402
import attn_backends.deploy  # noqa: E402
import attn_backends.errors  # noqa: E402
import attn_backends.reference  # noqa: E402
from attn_backends.integrations import _hf_call, _hf_mask, _hf_models  # noqa: E402
from attn_backends.integrations import transformers as abt  # noqa: E402
from tests import hf_support as hf  # noqa: E402

NAME = abt.register()
VOCAB = 100
SPREAD_FACTOR = 3.0
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


def _qwen3(**extra: Any) -> Any:
    return hf.from_config(
        transformers.Qwen3Config(**SMALL, num_key_value_heads=1, head_dim=16, **extra)
    )


def _mistral(window: int) -> Any:
    return hf.from_config(
        transformers.MistralConfig(
            **SMALL, num_key_value_heads=1, sliding_window=window, use_cache=False
        )
    )


def _bert() -> Any:
    return hf.from_config(transformers.BertConfig(**SMALL, max_position_embeddings=64))


def _tolerance(model: Any, valid: torch.Tensor, **inputs: Any) -> float:
    """HF's own sdpa-vs-eager spread on these inputs, times a small factor, plus a floor."""
    _, spread = hf.eager_and_sdpa_spread(model, valid, **inputs)
    return hf.spread_tolerance(spread, factor=SPREAD_FACTOR)


def _ids(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return hf.random_ids(rows, cols, vocab=VOCAB, seed=seed)


def _served_matches_eager(model: Any, **inputs: Any) -> None:
    valid = hf.valid_positions(inputs)
    tolerance = _tolerance(model, valid, **inputs)
    error = hf.relative_error(
        hf.run(model, NAME, **inputs)[valid], hf.run(model, "eager", **inputs)[valid]
    )
    assert error <= tolerance, (error, tolerance)


# --- 1. models that bypass the attention registry --------------------------------------------

_SMALL_ENC = {**SMALL, "max_position_embeddings": 64}
BYPASSING: dict[str, Callable[[], Any]] = {
    "MPNetModel": lambda: transformers.MPNetConfig(**_SMALL_ENC),
    "MegatronBertModel": lambda: transformers.MegatronBertConfig(**_SMALL_ENC),
    "RoFormerModel": lambda: transformers.RoFormerConfig(**_SMALL_ENC),
    "ConvBertModel": lambda: transformers.ConvBertConfig(**_SMALL_ENC),
    "IBertModel": lambda: transformers.IBertConfig(**_SMALL_ENC),
    "LukeModel": lambda: transformers.LukeConfig(
        **_SMALL_ENC, entity_vocab_size=10, entity_emb_size=16
    ),
    "BigBirdModel": lambda: transformers.BigBirdConfig(
        **_SMALL_ENC, attention_type="original_full"
    ),
    "SqueezeBertModel": lambda: transformers.SqueezeBertConfig(**_SMALL_ENC, embedding_size=32),
    "BloomModel": lambda: transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2
    ),
    "MptModel": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2),
}


@pytest.mark.parametrize("class_name", list(BYPASSING))
def test_case1_models_that_bypass_the_registry_are_refused_by_name(class_name):
    """Batch size equal to the padded length: the shape where the 2-D mask once broadcast
    silently into these models' scores; one unpadded sequence (BLOOM, MPT went wrong even
    there); and packed input."""
    model = hf.from_config(BYPASSING[class_name](), impl=NAME)
    assert type(model).__name__ == class_name
    mask = torch.ones(3, 3, dtype=torch.long)
    mask[1, 2] = 0
    inputs: list[dict[str, Any]] = [
        {"input_ids": _ids(3, 3), "attention_mask": mask},
        {"input_ids": _ids(1, 7)},
        dict(abt.pack_sequences([[5, 6, 7], [8, 9]])),
    ]
    for batch in inputs:
        with pytest.raises(ab.errors.IntegrationError, match=rf"{class_name}.*'sdpa' or 'eager'"):
            hf.run(model, NAME, **batch)


@pytest.mark.parametrize("class_name", list(BYPASSING))
def test_case1_the_signal_agrees_with_the_modeling_code(class_name):
    """transformers' signal (``_can_set_attn_implementation``) against the source: the module
    of a refused class never asks the registry for its attention function; Bert's does."""
    cls = getattr(transformers, class_name)
    source = inspect.getsource(sys.modules[cls.__module__])
    assert "ALL_ATTENTION_FUNCTIONS.get_interface(" not in source
    assert not cls._can_set_attn_implementation()
    assert _hf_models._bypassing(cls.config_class) is not None
    bert = transformers.BertModel
    bert_source = inspect.getsource(sys.modules[bert.__module__])
    assert "ALL_ATTENTION_FUNCTIONS.get_interface(" in bert_source
    assert _hf_models._bypassing(bert.config_class) is None


def test_case1_a_model_that_ignores_packed_boundaries_is_refused_at_unpack():
    """DeBERTa-v2 never calls the registered functions: padded it runs its own attention (the
    same numbers as eager); packed, its sequences attend to each other, so the packed output
    cannot be read back."""
    model = hf.from_config(transformers.DebertaV2Config(**_SMALL_ENC), impl=NAME)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    ids = _ids(2, 6)
    own = hf.run(model, NAME, input_ids=ids, attention_mask=mask)
    assert torch.equal(own, hf.run(model, "eager", input_ids=ids, attention_mask=mask))
    packed = abt.pack_sequences([[5, 6, 7], [8, 9]])
    hidden = hf.run(model, NAME, **packed)
    with pytest.raises(
        ab.errors.IntegrationError, match="no attention layer served these cu_seq_lens"
    ):
        abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])


def test_unpacking_with_a_copy_of_cu_seq_lens_on_another_device_names_the_copy():
    """The serving record is found by the tensors the model was called with: cu_seq_lens left
    on the CPU while the model ran on copies elsewhere are refused, and the message says why
    (not that the model ignored the boundaries)."""
    packed = abt.pack_sequences([[5, 6, 7], [8, 9]])
    hidden = torch.empty(1, 5, 4, device="meta")
    with pytest.raises(ab.errors.IntegrationError, match="on cpu and the hidden states on meta"):
        abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])


# --- 2. mask rules beyond padding, causality and a window -------------------------------------


@pytest.mark.parametrize("chunk", [4, 64], ids=["chunk-bites", "chunk-longer-than-batch"])
def test_case2_chunked_attention_is_the_models_own(chunk):
    """Llama 4's chunked attention: the chunk is the spec's ``chunk_size``, served exactly
    (more inputs and the negative controls: tests/test_hf_chunked.py)."""
    cfg = transformers.Llama4TextConfig(
        **SMALL,
        intermediate_size_mlp=64,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=1,
        attention_chunk_size=chunk,
        use_cache=False,
    )
    model = hf.from_config(cfg, impl=NAME)
    _served_matches_eager(model, input_ids=_ids(2, 9))
    assert chunk in {s.spec.chunk_size for s in abt.decisions()}


def _sequence_ids_mask(ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return ids[batch_idx, q_idx] == ids[batch_idx, kv_idx]

    return inner


def _layer_call(model: Any, mask: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention through the integration and through HF's eager function."""
    layer = model.layers[0].self_attn
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 2, 8, 16, generator=g)
    k = torch.randn(2, 1, 8, 16, generator=g)
    v = torch.randn(2, 1, 8, 16, generator=g)
    got, _ = abt.attention_forward(layer, q, k, v, mask, scaling=0.25, **kwargs)
    return got, q


def test_case2_a_mask_function_the_spec_cannot_express_is_refused():
    """Sequence ids within one row (an ``and_mask_function``) on a causal model: the model's
    mask differs from causal attention over the row, so the call is refused; an overlay that
    changes nothing is served."""
    from transformers.masking_utils import create_causal_mask

    model = _qwen3()
    model.set_attn_implementation(NAME)
    embeds = torch.zeros(2, 8, 32)
    mask_2d = torch.ones(2, 8, dtype=torch.long)
    seq_ids = torch.tensor([[0] * 4 + [1] * 4, [0] * 8])
    split = create_causal_mask(
        model.config, embeds, mask_2d, None, and_mask_function=_sequence_ids_mask(seq_ids)
    )
    with pytest.raises(abt.MaskMismatchError, match=r"Qwen3Model \(Qwen3Attention\).*row 0"):
        _layer_call(model, split)
    same = create_causal_mask(
        model.config,
        embeds,
        mask_2d,
        None,
        and_mask_function=_sequence_ids_mask(torch.zeros(2, 8, dtype=torch.long)),
    )
    _layer_call(model, same)  # served: the overlay keeps everything


# --- 3. a padding hole under a sliding window ------------------------------------------------


def test_case3_padding_hole_under_a_window_is_refused_and_contiguous_padding_served():
    model = _mistral(window=3)
    ids = _ids(2, 8)
    hole = torch.ones(2, 8, dtype=torch.long)
    hole[0, 3] = 0  # one masked token between valid ones
    with pytest.raises(abt.MaskMismatchError, match=r"MistralModel.*between valid ones"):
        hf.run(model, NAME, input_ids=ids, attention_mask=hole)
    for left in (False, True):
        padded = torch.ones(2, 8, dtype=torch.long)
        padded[1, :3] = 0 if left else 1
        padded[1, 5:] = 1 if left else 0
        _served_matches_eager(model, input_ids=ids, attention_mask=padded)


def test_case3_hole_without_a_window_is_served():
    """Causal attention counts the same keys over positions and over valid tokens."""
    model = _mistral(window=64)
    hole = torch.ones(2, 8, dtype=torch.long)
    hole[0, 3] = 0
    _served_matches_eager(model, input_ids=_ids(2, 8), attention_mask=hole)


# --- 4. a 4-D mask rewritten in place under inference_mode -----------------------------------


def test_case4_4d_mask_rewritten_in_place_is_not_served_the_old_layout():
    model = _bert()
    ids = _ids(3, 9)
    with torch.inference_mode():
        pad = torch.ones(3, 9, dtype=torch.bool)
        pad[0, 5:] = False
        four_d = pad[:, None, None, :].expand(-1, 1, 9, -1).clone()
        first = hf.run(model, NAME, input_ids=ids, attention_mask=four_d)
        pad2 = torch.ones(3, 9, dtype=torch.bool)
        pad2[1, 2:] = False
        four_d.copy_(pad2[:, None, None, :].expand(-1, 1, 9, -1))  # same buffer, new batch
        second = hf.run(model, NAME, input_ids=ids, attention_mask=four_d)
        want = hf.run(model, "eager", input_ids=ids, attention_mask=pad2.long())
        want_first = hf.run(model, "eager", input_ids=ids, attention_mask=pad.long())
    tolerance = _tolerance(model, pad2, input_ids=ids, attention_mask=pad2.long())
    assert hf.relative_error(first[pad], want_first[pad]) <= tolerance
    assert hf.relative_error(second[pad2], want[pad2]) <= tolerance, (
        hf.relative_error(second[pad2], want[pad2]),
    )


def test_case4_packed_boundaries_rewritten_in_place_without_the_mask_hook():
    """No mask (a direct call): the layout comes from ``cu_seq_lens_q``'s content on every
    call, so boundaries rewritten in place under inference_mode are the new ones."""
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(9, 3 * 2 * 16, generator=g)
    q, k, v = (x.reshape(1, 9, 2, 16).transpose(1, 2) for x in qkv.split(32, dim=1))
    spec = ab.AttentionSpec(
        num_heads=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, causal=True
    )
    layer = torch.nn.Module()
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        abt.attention_forward(layer, q, k, v, None, cu_seq_lens_q=cu)
        cu.copy_(torch.tensor([0, 2, 9], dtype=torch.int32))
        out, _ = abt.attention_forward(layer, q, k, v, None, cu_seq_lens_q=cu)
    want = ab.reference_attention(qkv, spec, ab.FMHAParams.from_lengths([2, 7], device="cpu"))
    assert ab.reference.relative_error(out.reshape(9, -1), want) < 1e-5


# --- 5. plans per backend and spec ------------------------------------------------------------


def test_case5_two_pinned_backends_sharing_one_mask_get_their_own_plans():
    flex = abt.register("attn_backends_pinned_flex", backend="flex")
    sdpa = abt.register("attn_backends_pinned_sdpa", backend="torch-sdpa")
    model = _bert()
    ids = _ids(3, 9)
    pad = torch.ones(3, 9, dtype=torch.bool)
    pad[2, 4:] = False
    four_d = pad[:, None, None, :].expand(-1, 1, 9, -1)  # one mask tensor for both models
    want = hf.run(model, "eager", input_ids=ids, attention_mask=pad.long())
    tolerance = _tolerance(model, pad, input_ids=ids, attention_mask=pad.long())
    for name in (flex, sdpa, flex):
        got = hf.run(model, name, input_ids=ids, attention_mask=four_d)
        assert hf.relative_error(got[pad], want[pad]) <= tolerance, name
    chosen = {s.name for s in abt.decisions() if s.spec.head_dim == 16 and not s.spec.causal}
    assert {"flex", "torch-sdpa"} <= chosen


def test_case4_a_4d_mask_that_hides_a_real_token_from_itself_is_refused():
    """The token stays a token (other queries see it), so the mask differs from the spec's
    and is refused; read from the diagonal alone it became padding and its output zeros."""
    model = _bert()
    ids = _ids(1, 6, seed=4)
    allowed = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    allowed[0, 0, 2, 2] = False
    want = hf.run(model, "eager", input_ids=ids, attention_mask=allowed)
    assert float(want[0, 2].abs().sum()) > 0, "eager computes an output for that token"
    with pytest.raises(abt.MaskMismatchError, match="query column 2"):
        hf.run(model, NAME, input_ids=ids, attention_mask=allowed)


# --- 6. pack_sequences / unpack_hidden bounds -------------------------------------------------


@pytest.mark.parametrize("mask", ["none", "all-ones"])
@pytest.mark.parametrize(
    "positions",
    [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5], [0] * 12],
    ids=["restarting", "all-zero"],
)
def test_case6_position_ids_pack_only_where_transformers_reads_them_so(mask, positions):
    """Restarting position_ids split a row only where transformers' own mask reads them so,
    and only without a 2-D mask: BERT's bidirectional mask packs by them from transformers
    5.25 on (before, it spans the whole row), never with a mask; a causal model given an
    explicit mask does not pack either. Each computes the model's own attention."""
    position_ids = torch.tensor([positions])
    ids = _ids(1, 12, seed=9)
    extra = {"attention_mask": torch.ones(1, 12, dtype=torch.long)} if mask == "all-ones" else {}
    models = {"bert": _bert()}
    if mask == "all-ones":
        models["qwen3"] = _qwen3(use_cache=False)
    for name, model in models.items():
        inputs = {"input_ids": ids, "position_ids": position_ids, **extra}
        want = hf.run(model, "eager", **inputs)
        got = hf.run(model, NAME, **inputs)
        assert hf.relative_error(got, want) <= 1e-5, name


def _served_packed(sequences: list[list[int]]) -> abt.PackedBatch:
    packed = abt.pack_sequences(sequences)
    tokens = sum(len(s) for s in sequences)
    q = torch.randn(1, 2, tokens, 16, generator=torch.Generator().manual_seed(1))
    layer = torch.nn.Module()
    abt.attention_forward(layer, q, q, q, None, cu_seq_lens_q=packed["cu_seq_lens_q"])
    return packed


@pytest.mark.parametrize(
    ("bounds", "tokens"),
    [([0, 3, 7], 5), ([0, 3, 4], 5), ([1, 3, 5], 5), ([0, 4, 3, 5], 5), ([0], 5)],
    ids=["ends-past", "ends-short", "not-from-0", "decreasing", "one-bound"],
)
def test_case6_unpack_hidden_validates_its_bounds(bounds, tokens):
    _served_packed([[5, 6, 7], [8, 9]])
    cu = torch.tensor(bounds, dtype=torch.int32)
    with pytest.raises(ab.errors.IntegrationError, match="do not split the"):
        abt.unpack_hidden(torch.zeros(1, tokens, 4), cu)


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        (torch.tensor([0.0, 2.7, 5.0]), "integer tensor"),  # int() would truncate 2.7 to 2
        (torch.tensor([0, 3, 5], dtype=torch.int32, device="meta"), "meta device"),
        (torch.tensor([[0, 3, 5]], dtype=torch.int32), "1-D"),
        (torch.tensor([True, False]), "integer tensor"),
    ],
    ids=["float", "meta", "2-d", "bool"],
)
def test_case6_cu_seq_lens_of_another_dtype_or_device_are_refused_by_name(cu, match):
    q = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ab.errors.IntegrationError, match=match):
        abt.attention_forward(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu)


def test_case6_one_packed_sequence_unpacks_through_the_model():
    """One sequence has no boundary to cross: its packed output unpacks, with the model's own
    numbers, although no attention layer marked its bounds as read."""
    model = _bert()
    packed = abt.pack_sequences([[5, 6, 7, 8, 9]])
    got = hf.run(model, NAME, **packed)
    (one,) = abt.unpack_hidden(got, packed["cu_seq_lens_q"])
    want = hf.run(model, "eager", input_ids=packed["input_ids"])
    assert one.shape == (5, got.shape[-1])
    assert hf.relative_error(one, want[0]) <= 1e-5


def test_case6_pack_and_unpack_refuse_bad_arguments():
    packed = _served_packed([[5, 6, 7], [8, 9]])
    cu = packed["cu_seq_lens_q"]
    assert [p.shape[0] for p in abt.unpack_hidden(torch.zeros(1, 5, 4), cu)] == [3, 2]
    with pytest.raises(ab.errors.IntegrationError, match="1-D integer tensor"):
        abt.unpack_hidden(torch.zeros(1, 5, 4), cu.float())
    with pytest.raises(ab.errors.IntegrationError, match=r"\[1, tokens, channels\]"):
        abt.unpack_hidden(torch.zeros(2, 5, 4), cu)
    bad_batches: list[Any] = [[[5, -1]], [[5, 2.0]], [[]], []]
    for bad in bad_batches:
        with pytest.raises(ab.errors.IntegrationError, match="pack_sequences"):
            abt.pack_sequences(bad)
    with pytest.raises(ab.errors.IntegrationError, match="position_offset"):
        abt.pack_sequences([[5]], position_offset=-1)


# --- 7. a prefill with use_cache=True ----------------------------------------------------------


def test_case7_packed_prefill_with_a_cache_is_refused():
    """With a cache transformers reads restarting position_ids as one sequence continuing;
    splitting it would compute another attention. pack_sequences asks for no cache, so its
    batch is served as written, on a config that keeps ``use_cache=True``."""
    model = _qwen3()
    packed = abt.pack_sequences([[5, 6, 7, 8], [9, 10, 11]])
    with pytest.raises(abt.MaskMismatchError, match=r"Qwen3Model.*use_cache=True"):
        hf.run(model, NAME, **{**packed, "use_cache": True})
    hidden = hf.run(model, NAME, **packed)
    abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])


def test_case7_the_readme_packed_example_serves_a_decoder_that_keeps_its_cache_flag():
    """The README's three lines on a Qwen3 whose config says ``use_cache=True`` (transformers'
    default, and Qwen3-Embedding's): each sequence as if alone, exactly."""
    config = transformers.Qwen3Config(**SMALL, num_key_value_heads=1, head_dim=16)
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation=NAME).eval()
    sequences = [[5, 6, 7, 8], [9, 10, 11], [12]]
    packed = abt.pack_sequences(sequences)
    with torch.inference_mode():
        hidden = model(**packed).last_hidden_state
        alone = [model(input_ids=torch.tensor([s]), use_cache=False)[0][0] for s in sequences]
    for got, want in zip(abt.unpack_hidden(hidden, packed["cu_seq_lens_q"]), alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_case7_padded_prefill_with_a_cache_is_served_and_decoding_refused():
    """A padded prefill with a cache means the same attention: served. The next step attends
    one query to the cached keys: refused."""
    model = _qwen3()
    ids = _ids(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    _served_matches_eager(model, input_ids=ids, attention_mask=mask, use_cache=True)
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = torch.ones(2, 7, dtype=torch.long)
        step[1, :2] = 0
        with pytest.raises(ab.errors.IntegrationError, match="KV cache"):
            model(
                input_ids=_ids(2, 1),
                attention_mask=step,
                cache=out.past_key_values,
                use_cache=True,
            )


# --- 8. the selection follows the registry and the environment ---------------------------------


def test_case8_a_backend_disabled_afterwards_is_not_served(monkeypatch):
    model = _qwen3()
    ids = _ids(2, 6)

    def served_by() -> set[str]:
        seen: set[str] = set()
        real = _hf_call.layer_selection

        def spy(*args: Any, **kwargs: Any) -> Any:
            found = real(*args, **kwargs)
            seen.add(found.name)
            return found

        monkeypatch.setattr(_hf_call, "layer_selection", spy)
        hf.run(model, NAME, input_ids=ids)
        monkeypatch.setattr(_hf_call, "layer_selection", real)
        return seen

    first = served_by()
    assert first == {"torch-sdpa"}
    monkeypatch.setenv("ATTN_BACKENDS_DISABLE", "torch-sdpa")
    assert "torch-sdpa" not in served_by()
    monkeypatch.delenv("ATTN_BACKENDS_DISABLE")
    ab.deploy.reset_registry()
    assert served_by() == first
    monkeypatch.setenv("ATTN_BACKEND", "flex")
    assert served_by() == {"flex"}
    assert {"torch-sdpa", "flex"} <= {s.name for s in abt.decisions()}


def test_the_mask_check_runs_once_per_class_of_call(monkeypatch):
    """The model's mask is checked once per (mask function as a value, spec, layout class),
    not per layer nor per batch: Mistral with a window has one kind on every layer, and
    batches of other lengths, padded contiguously on either side, are of the class the first
    one proved. A batch with a hole between valid tokens is of no provable class: it is
    checked in full (and refused: the window counts columns in the model, tokens here)."""
    model = _mistral(window=3)
    model.config.num_hidden_layers = 2
    calls: list[object] = []
    real = _hf_mask.check_mask

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(args[2])
        real(*args, **kwargs)

    monkeypatch.setattr(_hf_mask, "check_mask", counted)
    hf.run(model, NAME, input_ids=_ids(2, 8))
    assert len(calls) == 1
    hf.run(model, NAME, input_ids=_ids(2, 8))
    hf.run(model, NAME, input_ids=_ids(3, 6, seed=1))
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    _served_matches_eager(model, input_ids=_ids(2, 7, seed=2), attention_mask=left)
    assert len(calls) == 1, "batches of a proved class are not checked again"
    hole = torch.tensor([[1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(abt.MaskMismatchError):
        hf.run(model, NAME, input_ids=_ids(2, 7, seed=3), attention_mask=hole)
    assert len(calls) == 2
