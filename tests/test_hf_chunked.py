"""Llama 4's chunked attention through the transformers integration: the chunked mask's
``attention_chunk_size`` becomes the spec's ``chunk_size`` on the layers handed that mask, and
the model computes its own attention on right- and left-padded batches, one sequence and packed
rows; the model's mask function is still evaluated against the spec on every chunked layer.

Negative controls: a chunk one larger is refused by that check, and, with the check switched
off, fails the comparison with eager far above its tolerance. A padding hole (where transformers
counts chunks over columns and the spec over valid tokens) is refused, naming the chunks.

Tiny config (four layers: three chunked RoPE layers and a NoPE full-attention one), seeded
random weights, no download; tolerance is HF's own sdpa-vs-eager spread on the same input
(the method of ``tests/test_hf_boundary.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attn_backends as ab  # noqa: E402
import attn_backends.errors  # noqa: E402
from attn_backends.integrations import _hf_features, _hf_mask, _hf_proof  # noqa: E402
from attn_backends.integrations import transformers as abt  # noqa: E402
from tests import hf_support as hf  # noqa: E402

NAME = abt.register()
VOCAB = 100
CHUNK = 4
SPREAD_FACTOR = 3.0


def _model(chunk: int = CHUNK) -> Any:
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=1,
        attention_chunk_size=chunk,
        use_cache=False,
    )
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    return hf.from_config(cfg)


@pytest.fixture(scope="module")
def model() -> Any:
    return _model()


def _ids(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return hf.random_ids(rows, cols, vocab=VOCAB, seed=seed)


def _padded(left: bool, right: bool = True) -> dict[str, torch.Tensor]:
    """Rows of 13, 6 and 9 valid tokens in 13 columns (chunks of 4 split all of them), the
    padding after them, before them, or on both sides."""
    mask = torch.zeros(3, 13, dtype=torch.long)
    for row, n in enumerate((13, 6, 9)):
        start = (13 - n) // 2 if left and right else 13 - n if left else 0
        mask[row, start : start + n] = 1
    return {"input_ids": _ids(3, 13), "attention_mask": mask}


def _packed() -> dict[str, Any]:
    ids = _ids(1, 25, seed=1)[0].tolist()
    return dict(abt.pack_sequences([ids[:10], ids[10:15], ids[15:]]))


INPUTS = {
    "right-padded": lambda: _padded(left=False),
    "left-padded": lambda: _padded(left=True, right=False),
    "padded-both-sides": lambda: _padded(left=True),
    "one-sequence": lambda: {"input_ids": _ids(1, 14, seed=2)},
    "packed": _packed,
}


def _compare(model: Any, inputs: dict[str, Any]) -> tuple[float, float]:
    """(error of attn_backends against eager, HF's own sdpa-vs-eager spread as tolerance)."""
    valid = hf.valid_positions(inputs)
    eager, spread = hf.eager_and_sdpa_spread(model, valid, **inputs)
    tolerance = hf.spread_tolerance(spread, factor=SPREAD_FACTOR)
    return hf.relative_error(hf.run(model, NAME, **inputs)[valid], eager), tolerance


@pytest.fixture
def checks(model: Any, monkeypatch: pytest.MonkeyPatch) -> list[ab.AttentionSpec]:
    """The specs the mask check compared the model's own mask with, from a model that has
    proved no class of call yet (the module-scoped model would carry an earlier test's)."""
    for module in model.modules():
        _hf_proof.forget(module)
    seen: list[ab.AttentionSpec] = []
    real = _hf_mask.check_mask

    def counted(model: _hf_mask.ModelMask, layout: Any, spec: ab.AttentionSpec, **kw: Any) -> None:
        seen.append(spec)
        real(model, layout, spec, **kw)

    monkeypatch.setattr(_hf_mask, "check_mask", counted)
    return seen


@pytest.mark.parametrize("kind", INPUTS)
def test_chunked_layers_compute_the_models_own_attention(model, checks, kind):
    inputs = INPUTS[kind]()
    error, tolerance = _compare(model, inputs)
    assert error <= tolerance, (error, tolerance)
    # the model's chunked mask was evaluated against a chunked spec, the full one without
    assert {spec.chunk_size for spec in checks} == {CHUNK, None}
    served = {s.spec.chunk_size for s in abt.decisions() if s.spec.head_dim == 16}
    assert CHUNK in served


def test_a_chunk_longer_than_the_batch_matches_too():
    error, tolerance = _compare(_model(chunk=64), _padded(left=True, right=False))
    assert error <= tolerance, (error, tolerance)


def _chunk_one_larger(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _hf_features.chunk_from_hf

    def larger(config: Any, local_size: object, model_name: str) -> int | None:
        chunk = real(config, local_size, model_name)
        return None if chunk is None else chunk + 1

    monkeypatch.setattr(_hf_features, "chunk_from_hf", larger)


@pytest.mark.parametrize("kind", INPUTS)
def test_a_chunk_one_larger_is_refused_by_the_mask_check(model, monkeypatch, kind):
    _chunk_one_larger(monkeypatch)
    with pytest.raises(abt.MaskMismatchError, match=r"Llama4TextModel.*chunks of 5"):
        hf.run(model, NAME, **INPUTS[kind]())


@pytest.mark.parametrize("kind", INPUTS)
def test_a_chunk_one_larger_fails_the_comparison_without_the_check(model, monkeypatch, kind):
    """The check is not what makes the comparison pass: without it a wrong chunk runs, and
    its output is far from the model's own."""
    _chunk_one_larger(monkeypatch)
    monkeypatch.setattr(_hf_mask, "check_mask", lambda *args, **kwargs: None)
    error, tolerance = _compare(model, INPUTS[kind]())
    assert error > 100 * tolerance, (error, tolerance)


def test_a_padding_hole_under_chunks_is_refused_and_named(model):
    inputs = _padded(left=False)
    inputs["attention_mask"][0, 2] = 0  # one masked token between valid ones
    with pytest.raises(abt.MaskMismatchError, match=r"between valid ones.*measures the chunks"):
        hf.run(model, NAME, **inputs)


def test_a_chunk_the_spec_cannot_take_is_refused_by_name():
    config = transformers.Llama4TextConfig(attention_chunk_size=4)
    config.attention_chunk_size = 0
    with pytest.raises(ab.errors.IntegrationError, match=r"Llama4.*attention_chunk_size=0"):
        _hf_features.chunk_from_hf(config, 0, "Llama4TextModel")
    assert _hf_features.chunk_from_hf(config, 7, "Llama4TextModel") is None  # a window's size


def test_graph_runner_refuses_chunks_by_name(model):
    """The runner's bucket plans hand its layers no mask, so none would learn the chunk: it
    refuses the model by name (it ran as plain causal attention, relative error 0.92)."""
    from attn_backends.integrations.graph_runner import GraphRunner

    packed = _packed()
    model.set_attn_implementation(NAME)
    runner = GraphRunner(model, [ab.GraphBucket(max_tokens=32, max_batch=4)])
    with (
        torch.no_grad(),
        pytest.raises(
            ab.errors.FeatureNotSupportedError, match=r"Llama4TextModel.*chunked.*GraphRunner"
        ),
    ):
        runner(packed["input_ids"], packed["cu_seq_lens_q"])
    model.set_attn_implementation(NAME)  # the runner switched it to its own functions
    error, tolerance = _compare(model, _packed())  # the integration itself still serves it
    assert error <= tolerance
