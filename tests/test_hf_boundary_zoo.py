"""The transformers boundary on the model families the whole-zoo run found crashing or wrong.

Each case: the model computes exactly its own attention through the integration, or the call
raises a named attn_backends error that names the model class and what to do instead.

1. models that read the attention mask outside the attention function (Doge's dynamic mask,
   the DeepSeek-V3.2 sparse-attention indexer): the hook hands them a guard tensor that
   refuses any use but the attention function's;
2. models that pick an attention module from their own table by implementation name (Falcon,
   GPT-Neo): refused at load instead of transformers' ``KeyError``;
3. hybrid models whose linear-attention, convolution or recurrent layers ignore packed
   boundaries: packed input refused before any layer runs (``config.layer_types``), and by
   counting the attention calls where the config does not say; padded batches served;
4. Sam3-LiteText, whose RepMixer convolutions read the padded positions: padded batches
   refused, one sequence served;
5. BERT copies that build an extended ``[B, 1, 1, S]`` padding mask themselves (LayoutLM):
   served when it is exactly padding, refused when it is a bias;
6. attention modules that declare no causal flag (Splinter): the model's own mask decides.

Tiny configs, seeded random weights, no downloads; every model is loaded under each
attention implementation with the same weights.
"""

from __future__ import annotations

import copy
import importlib
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attn_backends.errors import IntegrationError  # noqa: E402
from attn_backends.integrations import _hf_mask, _hf_models, _packed  # noqa: E402
from attn_backends.integrations import transformers as abt  # noqa: E402
from attn_backends.integrations.transformers import MaskMismatchError  # noqa: E402
from tests import hf_support as hf  # noqa: E402

NAME = abt.register()
VOCAB = 64
LENGTHS = (5, 9, 2)


def _load(cls: Any, config: Any, impl: str) -> Any:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(copy.deepcopy(config), attn_implementation=impl).eval()


def _pair(cls: Any, config: Any) -> tuple[Any, Any]:
    """The model under eager attention and under attn_backends, with the same weights."""
    eager = _load(cls, config, "eager")
    hf.randomize(eager)
    served = _load(cls, config, NAME)
    served.load_state_dict(eager.state_dict())
    return eager, served


def _sequences(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _padded(left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = _sequences()
    width = max(LENGTHS)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s)
        mask[i, cols] = 1
    return ids, mask


def _hidden(model: Any, **inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(**inputs).last_hidden_state
    return out


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest per-token error, relative to the mean per-token norm of the reference."""
    scale = want.norm(dim=-1).mean()
    return float(((got - want).norm(dim=-1) / scale).max())


def _assert_padded_matches(eager: Any, served: Any, left: bool = False, tol: float = 2e-5) -> None:
    ids, mask = _padded(left)
    valid = mask.bool()
    want = _hidden(eager, input_ids=ids, attention_mask=mask)[valid]
    got = _hidden(served, input_ids=ids, attention_mask=mask)[valid]
    assert _error(got, want) <= tol


# --- 1. the mask read outside the attention function ---------------------------------------


def test_guard_allows_the_plumbing_and_refuses_any_other_use_by_model_name():
    token = torch.ones(2, 5, dtype=torch.bool)
    guard = _hf_mask.guard(token, "SomeModel")
    assert guard.to("cpu") is guard  # a no-op move is plumbing
    assert guard.device == token.device
    assert "MaskGuard" in repr(guard)
    uses = (
        lambda: guard.dtype,
        lambda: guard.shape,
        lambda: guard[:, None],
        lambda: guard.to(torch.float32),
        lambda: guard + 1,
        lambda: torch.where(guard, 0.0, -1.0),
    )
    for use in uses:
        with pytest.raises(IntegrationError, match=r"SomeModel reads its attention mask outside"):
            use()


def _doge() -> tuple[Any, Any]:
    config = transformers.DogeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        keep_window_size=4,
    )
    return _pair(transformers.DogeModel, config)


def test_case1_a_model_that_reads_its_mask_before_attention_is_refused_by_name():
    eager, served = _doge()
    ids, mask = _padded()
    _hidden(eager, input_ids=ids, attention_mask=mask)  # the model itself runs
    with pytest.raises(IntegrationError, match=r"DogeModel reads its attention mask outside"):
        _hidden(served, input_ids=ids, attention_mask=mask)
    with pytest.raises(IntegrationError, match=r"DogeModel reads its attention mask outside"):
        _hidden(served, input_ids=ids[:1, :5])


# --- 2. attention modules picked from the model's own table --------------------------------


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (
            "FalconModel",
            {
                "vocab_size": VOCAB,
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
        ),
        (
            "GPTNeoModel",
            {
                "vocab_size": VOCAB,
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "attention_types": [[["global"], 1]],
            },
        ),
    ],
)
def test_case2_models_with_their_own_attention_table_are_refused_at_load(cls, config):
    """Refused at load while the model builds its attention from a table of its own; a
    release that moved it onto transformers' attention registry (Falcon in 5.25) has it
    served through the hook, exactly."""
    model_cls = getattr(transformers, cls)
    cfg = model_cls.config_class(**config)
    modeling = importlib.import_module(model_cls.__module__)
    if not any(name.endswith("_ATTENTION_CLASSES") for name in vars(modeling)):
        eager, served = _pair(model_cls, cfg)
        _assert_padded_matches(eager, served)
        return
    with pytest.raises(IntegrationError, match=rf"{cls} picks its attention module"):
        _load(model_cls, cfg, NAME)
    _load(model_cls, cfg, "eager")  # the table still serves its own names


# --- 3. hybrid models and packed input -------------------------------------------------------


def _lfm3(**extra: Any) -> Any:
    return transformers.Lfm3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        **extra,
    )


def _packed_run(model: Any) -> list[torch.Tensor]:
    packed = abt.pack_sequences(_sequences())
    hidden = _hidden(model, **packed)
    return abt.unpack_hidden(hidden, packed["cu_seq_lens_q"])


def test_case3_hybrid_layer_types_refuse_packed_input_before_any_layer_runs(monkeypatch):
    config = _lfm3()
    assert "'conv'" in _hf_models.token_mixers_outside_attention(config)
    eager, served = _pair(transformers.Lfm3Model, config)
    ran: list[str] = []
    for name, module in served.named_modules():
        if type(module).__name__.endswith("ShortConv"):
            module.register_forward_pre_hook(lambda *_, n=name: ran.append(n))
    with pytest.raises(IntegrationError, match=r"Lfm3Model is given packed sequences.*'conv'"):
        _packed_run(served)
    assert ran == []  # refused in the mask hook, before the first layer
    _assert_padded_matches(eager, served)
    _assert_padded_matches(eager, served, left=True)


def test_case3_packing_the_mask_hook_cannot_see_is_refused_at_the_first_attention_layer():
    """With a 2-D mask given (or cu_seq_lens alone), transformers does not mark the packing in
    the mask: the first attention layer that reads the boundaries refuses them."""
    _, served = _pair(transformers.Lfm3Model, _lfm3())
    packed = abt.pack_sequences(_sequences())
    ones = torch.ones_like(packed["input_ids"])
    for extra in ({"attention_mask": ones}, {"position_ids": None}):
        with pytest.raises(IntegrationError, match=r"Lfm3Model \(Lfm3Attention\) is given packed"):
            _hidden(served, **{**packed, **extra})


def test_case3_qwen3_next_packed_is_a_named_refusal_not_transformers_error():
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    _, served = _pair(transformers.Qwen3NextModel, config)
    with pytest.raises(IntegrationError, match=r"Qwen3NextModel is given packed sequences"):
        _packed_run(served)


def test_case3_packed_rows_read_by_fewer_attention_calls_than_layers_are_refused(monkeypatch):
    """A hybrid whose config does not list its layer kinds: counted at unpack_hidden."""
    config = _lfm3()
    _, served = _pair(transformers.Lfm3Model, config)
    monkeypatch.setattr(_hf_models, "token_mixers_outside_attention", lambda _: ())
    monkeypatch.setattr(_hf_models, "attention_layers", lambda c: c.num_hidden_layers)
    monkeypatch.setattr(_hf_models, "_facts", {})  # the facts of this config, read again
    with pytest.raises(IntegrationError, match=r"attention calls of the model's 4 attention"):
        _packed_run(served)


def test_case3_calls_are_counted_per_forward_across_mask_kinds():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    hidden = torch.zeros(1, 5, 3)
    newest = _hf_mask.newest_serial()
    # one forward, two mask kinds (serials newest+1, newest+2), four layers
    for serial in (newest + 1, newest + 2, newest + 1, newest + 2):
        _packed.mark_served(cu, request=serial, newest=newest + 2, expected=4)
    assert len(abt.unpack_hidden(hidden, cu)) == 2
    # the next forward (a newer serial) starts counting again: one call of four is refused
    _packed.mark_served(cu, request=newest + 3, newest=newest + 3, expected=4)
    with pytest.raises(IntegrationError, match=r"only 1 attention calls of the model's 4"):
        abt.unpack_hidden(hidden, cu)


def test_case3_full_attention_models_still_serve_packed_input():
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
    )
    eager, served = _pair(transformers.Gemma2Model, config)
    got = torch.cat(_packed_run(served))
    want = torch.cat(
        [
            _hidden(
                eager,
                input_ids=torch.tensor([s]),
                position_ids=torch.arange(len(s))[None],
                use_cache=False,
            )[0]
            for s in _sequences()
        ]
    )
    assert _error(got, want) <= 2e-5


# --- 4. token mixers that read padded positions ----------------------------------------------


def _sam3_lite_text(repmixer: bool) -> tuple[Any, Any]:
    config = transformers.Sam3LiteTextTextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        projection_dim=16,
        max_position_embeddings=16,
        use_repmixer_blocks=repmixer,
    )
    return _pair(transformers.Sam3LiteTextTextModel, config)


def test_case4_padding_read_by_repmixer_convolutions_is_refused_one_sequence_served():
    eager, served = _sam3_lite_text(repmixer=True)
    ids, mask = _padded()
    with pytest.raises(IntegrationError, match=r"Sam3LiteTextTextModel is given a padded batch"):
        _hidden(served, input_ids=ids, attention_mask=mask)
    one = ids[1:2, : LENGTHS[1]]
    assert _error(_hidden(served, input_ids=one), _hidden(eager, input_ids=one)) <= 2e-5


def test_case4_without_repmixer_blocks_padded_batches_are_served():
    eager, served = _sam3_lite_text(repmixer=False)
    _assert_padded_matches(eager, served)


# --- 5. an extended [B, 1, 1, S] padding mask built by the model ----------------------------


def _layoutlm() -> tuple[Any, Any]:
    config = transformers.LayoutLMConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    return _pair(transformers.LayoutLMModel, config)


def test_case5_an_extended_padding_mask_is_served():
    eager, served = _layoutlm()
    _assert_padded_matches(eager, served)
    _assert_padded_matches(eager, served, left=True)


def test_case5_an_extended_mask_that_is_a_bias_or_not_padding_is_refused():
    q = torch.randn(2, 2, 6, 8)
    layer = torch.nn.Module()
    bias = torch.zeros(2, 1, 1, 6)
    bias[0, ..., 3] = -5.0  # a bias on the scores, not a mask
    with pytest.raises(MaskMismatchError, match=r"values other than 0 and -inf"):
        abt.attention_forward(layer, q, q, q, bias)
    with pytest.raises(IntegrationError, match=r"dtype torch.int64"):
        abt.attention_forward(layer, q, q, q, torch.zeros(2, 1, 1, 6, dtype=torch.long))
    padding = torch.zeros(2, 1, 1, 6)
    padding[1, ..., 4:] = torch.finfo(torch.float32).min
    # a causal layer: the key-only mask lets queries see later keys
    with pytest.raises(MaskMismatchError, match=r"lets query column 0 of row 0 see key column 1"):
        abt.attention_forward(layer, q, q, q, padding, is_causal=True)


# --- 6. no causal flag on the attention module ------------------------------------------------


def test_case6_a_module_without_a_causal_flag_follows_the_models_mask():
    config = transformers.SplinterConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    eager, served = _pair(transformers.SplinterModel, config)
    assert not hasattr(served.encoder.layer[0].attention.self, "is_causal")
    _assert_padded_matches(eager, served)
    _assert_padded_matches(eager, served, left=True)
    one = torch.tensor([_sequences()[1]])
    assert _error(_hidden(served, input_ids=one), _hidden(eager, input_ids=one)) <= 2e-5
