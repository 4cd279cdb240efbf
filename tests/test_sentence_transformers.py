"""sentence-transformers on packed batches: equal to its own padded sdpa output, and packed.

Every model is built here with seeded random weights and a word-level tokenizer saved with
``save_pretrained`` (no download), saved as a sentence-transformers model, then loaded twice
from the same directory: with ``attn_implementation="sdpa"`` (sentence-transformers' padded
path, the reference) and with `abst.load` (this library, packed). Packing is proven by what the
attention function received, per call: one row, exactly the batch's tokens, no padding, and
the sequence boundaries of the batch's texts.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

from sentence_transformers import CrossEncoder, SentenceTransformer  # noqa: E402
from sentence_transformers.base.modules.transformer import Transformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402
from transformers import AttentionInterface, PreTrainedTokenizerFast  # noqa: E402

from attn_backends.errors import IntegrationError  # noqa: E402
from attn_backends.integrations import _hf_mask  # noqa: E402
from attn_backends.integrations import sentence_transformers as abst  # noqa: E402
from attn_backends.integrations import transformers as abt  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
MAX_TOKENS = 24  # the tokenizer truncates: some texts below are longer
HIDDEN = 64
COMMON = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2}
TOL = 1e-5
"""fp32, on unit-norm embeddings: HF's own eager-vs-sdpa spread here is ~1e-7, and the
negative controls below miss by 1e-2 and more."""


@dataclass(frozen=True)
class Vocab:
    specials: tuple[str, ...]
    pad: str
    single: str
    pair: str
    padding_side: str = "right"
    token_types: bool = False

    def ids(self) -> dict[str, int]:
        return {t: i for i, t in enumerate((*self.specials, *WORDS))}


BERT_VOCAB = Vocab(
    ("[PAD]", "[UNK]", "[CLS]", "[SEP]"),
    "[PAD]",
    "[CLS] $A [SEP]",
    "[CLS] $A [SEP] $B:1 [SEP]:1",
    token_types=True,
)
ROBERTA_VOCAB = Vocab(  # <pad> = 1 = config.pad_token_id: positions start at 2
    ("<s>", "<pad>", "</s>", "<unk>"), "<pad>", "<s> $A </s>", "<s> $A </s> </s> $B </s>"
)
DECODER_VOCAB = Vocab(  # Qwen3-Embedding: the last token is the end token, left padding
    ("<|endoftext|>", "<unk>"), "<|endoftext|>", "$A <|endoftext|>", "$A $B <|endoftext|>", "left"
)
GEMMA_VOCAB = Vocab(("<pad>", "<eos>", "<bos>", "<unk>"), "<pad>", "<bos> $A <eos>", "$A $B")


def _tokenizer(vocab: Vocab) -> PreTrainedTokenizerFast:
    ids = vocab.ids()
    unk = next(t for t in vocab.specials if "unk" in t.lower())
    tok = Tokenizer(models.WordLevel(ids, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    used = [t for t in vocab.specials if t in vocab.single or t in vocab.pair]
    tok.post_processor = processors.TemplateProcessing(
        single=vocab.single, pair=vocab.pair, special_tokens=[(t, ids[t]) for t in used]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=vocab.pad,
        unk_token=unk,
        model_max_length=MAX_TOKENS,
        padding_side=vocab.padding_side,
        model_input_names=[
            "input_ids",
            *(["token_type_ids"] if vocab.token_types else []),
            "attention_mask",
        ],
    )


@dataclass(frozen=True)
class Case:
    vocab: Vocab
    config: Callable[[int], Any]
    pooling: str
    model_class: str = "AutoModel"


def _cases() -> dict[str, Case]:
    t = transformers
    gqa = {**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    two_kinds = ["sliding_attention", "full_attention"]
    return {
        "bert-mean": Case(
            BERT_VOCAB,
            lambda v: t.BertConfig(
                vocab_size=v, num_attention_heads=4, max_position_embeddings=64, **COMMON
            ),
            "mean",
        ),
        "xlmr-cls": Case(
            ROBERTA_VOCAB,
            lambda v: t.XLMRobertaConfig(
                vocab_size=v,
                num_attention_heads=4,
                max_position_embeddings=64,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                **COMMON,
            ),
            "cls",
        ),
        # layer 0 global, layer 1 local with |i - j| <= 2: the window bites on these texts
        "modernbert-mean": Case(
            BERT_VOCAB,
            lambda v: t.ModernBertConfig(
                vocab_size=v,
                num_attention_heads=4,
                local_attention=4,
                global_attn_every_n_layers=2,
                pad_token_id=0,
                cls_token_id=2,
                sep_token_id=3,
                bos_token_id=2,
                eos_token_id=3,
                **COMMON,
            ),
            "mean",
        ),
        "qwen3-lasttoken": Case(
            DECODER_VOCAB,
            # use_cache left at its default (True), as the published Qwen3-Embedding config has it
            lambda v: t.Qwen3Config(vocab_size=v, pad_token_id=0, **gqa),
            "lasttoken",
        ),
        # EmbeddingGemma's layout: bidirectional, a window on every other layer
        "gemma3-bidirectional-mean": Case(
            GEMMA_VOCAB,
            lambda v: t.Gemma3TextConfig(
                vocab_size=v,
                pad_token_id=0,
                eos_token_id=1,
                bos_token_id=2,
                sliding_window=6,
                layer_types=two_kinds,
                use_bidirectional_attention=True,
                use_cache=False,
                **gqa,
            ),
            "mean",
        ),
    }


CASES = _cases()


def _save_hf(case: Case, path: Path, seed: int, model_class: str = "AutoModel") -> None:
    tokenizer = _tokenizer(case.vocab)
    config = case.config(len(tokenizer))
    torch.manual_seed(seed)
    model = getattr(transformers, model_class).from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def st_dirs(tmp_path_factory) -> dict[str, Path]:
    """One saved sentence-transformers model per case (Transformer, Pooling, Normalize)."""
    dirs = {}
    for seed, (name, case) in enumerate(CASES.items()):
        root = tmp_path_factory.mktemp(name)
        _save_hf(case, root / "hf", seed)
        st = SentenceTransformer(
            modules=[
                Transformer(str(root / "hf")),
                Pooling(HIDDEN, case.pooling),
                Normalize(),
            ],
            prompts={"query": "w1 w2 w3 ", "document": "w4 "},
        )
        st.save(str(root / "st"))
        dirs[name] = root / "st"
    return dirs


def _texts(seed: int, n: int = 11) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 30))) for _ in range(n)]


@dataclass
class Call:
    rows: int
    tokens: int
    padding: int
    """Cells of the layout the mask marks as padding."""
    cu_seq_lens: list[int] | None


@contextlib.contextmanager
def attention_calls(name: str = abt.DEFAULT_NAME) -> Iterator[list[Call]]:
    """Record the layout of every call of the attention function registered as ``name``."""
    inner: Any = AttentionInterface._global_mapping[name]
    calls: list[Call] = []

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        padding = 0
        hooked = _hf_mask.request_of(attention_mask)  # the mask hook's guard: its padding
        if hooked is not None:
            padding = 0 if hooked.padding is None else int((~hooked.padding).sum())
        elif attention_mask is not None:
            padding = -1  # a 4-D mask: not the packed form
        calls.append(
            Call(
                int(query.shape[0]),
                int(query.shape[2]),
                padding,
                None if cu is None else [int(x) for x in cu.tolist()],
            )
        )
        return inner(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface._global_mapping[name] = spy
    try:
        yield calls
    finally:
        AttentionInterface._global_mapping[name] = inner


def _token_counts(model: SentenceTransformer, texts: list[str], prompt: str = "") -> list[int]:
    tok = model.tokenizer
    return [len(tok(prompt + t, truncation=True)["input_ids"]) for t in texts]


def _assert_packed(calls: list[Call], counts: list[int], layers: int = 2) -> None:
    """Every attention call saw one row of a batch's tokens, no padding, its boundaries; the
    batches together hold every text once."""
    assert calls, "the attention function never ran"
    assert len(calls) % layers == 0
    batches: list[list[int]] = []
    for first in calls[::layers]:
        assert first.rows == 1, f"{first.rows} rows: padded, not packed"
        assert first.padding == 0
        assert first.cu_seq_lens is not None and first.cu_seq_lens[-1] == first.tokens
        cu = first.cu_seq_lens
        batches.append([b - a for a, b in itertools.pairwise(cu)])
    for call in calls:
        assert (call.rows, call.padding) == (1, 0)
    assert sorted(n for b in batches for n in b) == sorted(counts)


def _reference(path: Path) -> SentenceTransformer:
    return SentenceTransformer(str(path), model_kwargs={"attn_implementation": "sdpa"})


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_encode_is_packed_and_equals_the_padded_sdpa_output(st_dirs, name):
    path = st_dirs[name]
    texts = _texts(seed=len(name))
    ref = _reference(path)
    ours = abst.load(str(path))
    assert ours[0].can_flatten_inputs
    # the collator that builds transformers' flattening output in tensor ops (test_st_collator)
    assert type(ours[0].data_collator).__name__ == "FlatteningCollator"
    for method, prompt in (
        ("encode", ""),
        ("encode_query", "w1 w2 w3 "),
        ("encode_document", "w4 "),
    ):
        expected = getattr(ref, method)(texts, batch_size=4, convert_to_tensor=True)
        with attention_calls() as calls:
            got = getattr(ours, method)(texts, batch_size=4, convert_to_tensor=True)
        assert _err(got, expected) < TOL, f"{name} {method}"
        _assert_packed(calls, _token_counts(ours, texts, prompt))
    assert min(_token_counts(ours, texts)) < MAX_TOKENS == max(_token_counts(ours, texts)), (
        "the texts are of mixed lengths and some are truncated"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_token_embeddings_and_every_output_equal_the_padded_path(st_dirs, name):
    """sentence-transformers cuts these outputs by the padding mask, which a flattened batch
    lacks; the packed model serves them from padded batches through the same attention, while
    sentence embeddings of the same model stay packed."""
    path = st_dirs[name]
    texts = _texts(seed=7)
    ref, ours = _reference(path), abst.load(str(path))
    want = ref.encode(texts, output_value="token_embeddings", batch_size=4)
    got = ours.encode(texts, output_value="token_embeddings", batch_size=4)
    assert [t.shape for t in got] == [t.shape for t in want]
    for g, w in zip(got, want, strict=True):
        assert _err(g, w) < TOL
    want_all = ref.encode_query(texts, output_value=None, batch_size=4)
    got_all = ours.encode_query(texts, output_value=None, batch_size=4)
    for g, w in zip(got_all, want_all, strict=True):
        # the batches are ordered differently (interleaved lengths), so padding widths differ:
        # each text's own rows are what must be equal
        assert g.keys() == w.keys()
        rows_g = g["token_embeddings"][g["attention_mask"].bool()]
        rows_w = w["token_embeddings"][w["attention_mask"].bool()]
        assert rows_g.shape == rows_w.shape and _err(rows_g, rows_w) < TOL
        assert _err(g["sentence_embedding"], w["sentence_embedding"]) < TOL
    with attention_calls() as calls:
        ours.encode(texts, batch_size=4)
    _assert_packed(calls, _token_counts(ours, texts))


def test_a_config_that_keeps_use_cache_is_served_packed(st_dirs):
    """sentence-transformers before 6.3 kept the config's ``use_cache=True`` (Qwen3-Embedding's
    published config has it); with a cache transformers reads a packed row as one sequence.
    `packed` runs the prefill without one."""
    path = st_dirs["qwen3-lasttoken"]
    texts = _texts(seed=11)
    expected = _reference(path).encode(texts, batch_size=4, convert_to_tensor=True)
    model = SentenceTransformer(
        str(path), model_kwargs={"attn_implementation": abst.attention_name()}
    )
    transformer: Any = model[0]
    transformer.model.config.use_cache = True
    abst.packed(model)
    assert transformer.model.config.use_cache is False
    with attention_calls() as calls:
        got = model.encode(texts, batch_size=4, convert_to_tensor=True)
    assert _err(got, expected) < TOL
    _assert_packed(calls, _token_counts(model, texts))


def test_a_prompt_left_out_of_mean_pooling_stays_left_out(st_dirs):
    path = st_dirs["bert-mean"]
    texts = _texts(seed=3)
    ref, ours = _reference(path), abst.load(str(path))
    for model in (ref, ours):
        pooling: Any = model[1]
        pooling.include_prompt = False
    expected = ref.encode_query(texts, batch_size=5, convert_to_tensor=True)
    got = ours.encode_query(texts, batch_size=5, convert_to_tensor=True)
    assert _err(got, expected) < TOL
    with_prompt = ref.encode(["w1 w2 w3 " + t for t in texts], convert_to_tensor=True)
    assert _err(got, with_prompt) > 100 * TOL, "the prompt really is excluded"


def test_roberta_positions_are_offset_and_the_test_would_see_it_otherwise(st_dirs):
    """Negative control: packed positions from 0 (no ``padding_idx + 1``) miss by far."""
    path = st_dirs["xlmr-cls"]
    texts = _texts(seed=5)
    expected = _reference(path).encode(texts, convert_to_tensor=True)
    ours = abst.load(str(path))
    transformer: Any = ours[0]
    assert transformer._flatten_position_offset == 2
    transformer._flatten_position_offset = 0
    assert _err(ours.encode(texts, convert_to_tensor=True), expected) > 100 * TOL


def test_packed_model_matches_on_one_text_and_on_equal_lengths(st_dirs):
    path = st_dirs["qwen3-lasttoken"]
    ref, ours = _reference(path), abst.load(str(path))
    for texts in (["w1 w2"], ["w1 w2 w3", "w4 w5 w6", "w7 w8 w9"]):
        expected = ref.encode(texts, convert_to_tensor=True)
        assert _err(ours.encode(texts, convert_to_tensor=True), expected) < TOL


def test_a_batch_of_one_text_runs_unflattened_and_equals_the_padded_path(st_dirs):
    """One text has no padding to drop: its batch runs as one whole row, without the
    collator's prefix sums, and equals the padded path; two texts are flattened."""
    for name in ("bert-mean", "xlmr-cls", "qwen3-lasttoken"):
        path = st_dirs[name]
        ref, ours = _reference(path), abst.load(str(path))
        for texts in (["w1 w2 w3 w4"], ["w1 w2 w3 w4", "w5 w6"]):
            expected = ref.encode(texts, convert_to_tensor=True)
            with attention_calls() as calls:
                got = ours.encode(texts, convert_to_tensor=True)
            assert _err(got, expected) < TOL, name
            if len(texts) == 1:
                assert calls and all(c.rows == 1 and c.cu_seq_lens is None for c in calls)
                assert all(c.padding == 0 for c in calls)
            else:
                _assert_packed(calls, _token_counts(ours, texts))


# -- CrossEncoder ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ce_dirs(tmp_path_factory) -> dict[str, Path]:
    """Cross-encoders: BERT (pooler + classifier, token types), XLM-R (head on the first
    token, offset positions), Qwen3 (score on the last real token, left padding)."""
    cases = {
        "bert": (CASES["bert-mean"], "BertForSequenceClassification"),
        "xlmr": (CASES["xlmr-cls"], "XLMRobertaForSequenceClassification"),
        "qwen3": (CASES["qwen3-lasttoken"], "Qwen3ForSequenceClassification"),
    }
    dirs = {}
    for seed, (name, (case, cls)) in enumerate(cases.items()):
        root = tmp_path_factory.mktemp(f"ce-{name}")
        tokenizer = _tokenizer(case.vocab)
        config = case.config(len(tokenizer))
        config.num_labels = 1
        config.initializer_range = 0.3  # tokens mix strongly, so the first token's state varies
        torch.manual_seed(100 + seed)
        model = getattr(transformers, cls)(config)
        with torch.no_grad():  # a head of unit-scale weights: scores far apart
            for param_name, param in model.named_parameters():
                if not param_name.startswith(model.base_model_prefix):
                    param.normal_(0.0, 1.0)
        model.save_pretrained(root)
        tokenizer.save_pretrained(root)
        dirs[name] = root
    return dirs


def _pairs(seed: int, n: int = 9) -> list[tuple[str, str]]:
    a, b = _texts(seed, n), _texts(seed + 1, n)
    return [(x[:40], y) for x, y in zip(a, b, strict=True)]


@pytest.mark.parametrize("name", ["bert", "xlmr", "qwen3"])
def test_cross_encoder_predict_is_packed_and_equals_the_padded_sdpa_scores(ce_dirs, name):
    path = str(ce_dirs[name])
    pairs = _pairs(seed=7)
    ref = CrossEncoder(path, model_kwargs={"attn_implementation": "sdpa"})
    ours = abst.load_cross_encoder(path)
    expected = ref.predict(pairs, batch_size=4, convert_to_tensor=True, activation_fn=None)
    with attention_calls() as calls:
        got = ours.predict(pairs, batch_size=4, convert_to_tensor=True, activation_fn=None)
    scale = float(expected.abs().max())
    assert _err(got, expected) < TOL * max(scale, 1.0), name
    tok = ours.tokenizer
    counts = [len(tok(a, b, truncation=True)["input_ids"]) for a, b in pairs]
    _assert_packed(calls, counts)
    spread = float(expected.max() - expected.min())
    assert spread > 100 * TOL, "the scores differ between pairs, so a mix-up would show"


def test_cross_encoder_token_types_reach_the_packed_backbone(ce_dirs):
    """Negative control: BERT's second segment embeds with token type 1; dropping the token
    types (all zeros) changes the scores, so the equality above depends on carrying them."""
    path = str(ce_dirs["bert"])
    pairs = _pairs(seed=8)
    ours = abst.load_cross_encoder(path)
    expected = ours.predict(pairs, convert_to_tensor=True, activation_fn=None)
    bert: Any = ours[0].model.base_model  # type: ignore[union-attr]
    zero = bert.embeddings.token_type_embeddings.weight
    with torch.no_grad():
        zero[1:] = zero[0]
    assert _err(ours.predict(pairs, convert_to_tensor=True, activation_fn=None), expected) > TOL


# -- what is refused ----------------------------------------------------------------------------


def test_a_model_on_another_attention_is_refused(st_dirs):
    model = _reference(st_dirs["bert-mean"])
    with pytest.raises(IntegrationError, match="attn_implementation='sdpa'"):
        abst.packed(model)


def test_load_refuses_a_conflicting_attention_implementation(st_dirs):
    with pytest.raises(IntegrationError, match="model_kwargs asks for"):
        abst.load(str(st_dirs["bert-mean"]), model_kwargs={"attn_implementation": "eager"})


def test_packed_twice_packs_once(st_dirs):
    ours = abst.load(str(st_dirs["bert-mean"]))
    hooks = len(ours[0]._forward_hooks)
    assert abst.packed(ours) is ours
    assert len(ours[0]._forward_hooks) == hooks


def test_a_model_the_integration_refuses_is_refused_with_the_same_error(tmp_path):
    """MPNet computes attention in its own modules; the transformers integration refuses it
    (at its first forward), and so does the packed sentence-transformers path, word for word."""
    tokenizer = _tokenizer(ROBERTA_VOCAB)
    config = transformers.MPNetConfig(
        vocab_size=len(tokenizer), num_attention_heads=4, max_position_embeddings=64, **COMMON
    )
    torch.manual_seed(0)
    transformers.MPNetModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    name = abst.attention_name()
    plain = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation=name).eval()
    batch = tokenizer(["w1 w2 w3", "w4"], padding=True, return_tensors="pt")
    with pytest.raises(IntegrationError) as direct:
        plain(**batch)
    st = SentenceTransformer(
        modules=[
            Transformer(str(tmp_path), model_kwargs={"attn_implementation": name}),
            Pooling(HIDDEN, "mean"),
        ]
    )
    with pytest.raises(IntegrationError) as through_st:
        abst.packed(st).encode(["w1 w2 w3", "w4"])
    assert str(through_st.value) == str(direct.value)
