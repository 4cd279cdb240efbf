"""The flattening collator sentence-transformers is given returns transformers'
``DataCollatorWithFlattening`` output exactly: the same keys in the same order, tensors of the
same dtype, shape and values, the same Python ints; input it does not build goes to the
collator's own code."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from transformers import DataCollatorWithFlattening

from attn_backends.integrations._st_collator import FlatteningCollator

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for key, want in a.items():
        got = b[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert (got.dtype, got.shape) == (want.dtype, want.shape), key
            assert torch.equal(got, want), key
            assert got.is_contiguous(), key
        else:
            assert type(got) is type(want) and got == want, key


token_lists = st.lists(
    st.lists(st.integers(min_value=0, max_value=2**40), max_size=40), min_size=1, max_size=12
)
flags = st.fixed_dictionaries(
    {
        "return_position_ids": st.booleans(),
        "return_seq_idx": st.booleans(),
        "return_flash_attn_kwargs": st.booleans(),
        "position_ids_start": st.integers(min_value=0, max_value=3),
        "separator_id": st.integers(min_value=-200, max_value=5),
    }
)


@SETTINGS
@given(tokens=token_lists, options=flags, extra=st.booleans())
def test_equals_transformers_collator_on_token_lists(tokens, options, extra):
    """Random batches (empty inputs among them, dropped by both), every option the collator
    has, with or without the other keys sentence-transformers' tokeniser returns."""
    features = [
        {"input_ids": ids, **({"attention_mask": [1] * len(ids)} if extra else {})}
        for ids in tokens
    ]
    if not any(tokens):
        with pytest.raises(ValueError, match="every example is empty"):
            FlatteningCollator(**options)(features)
        return
    want = DataCollatorWithFlattening(**options)(features)
    _same(want, FlatteningCollator(**options)(features))


def test_the_batches_sentence_transformers_builds_are_built_here(monkeypatch):
    """The fast path serves sentence-transformers' own call (the collator's code is not run)."""
    calls: list[object] = []
    own = DataCollatorWithFlattening.__call__

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return own(*args, **kwargs)

    monkeypatch.setattr(DataCollatorWithFlattening, "__call__", counted)
    collator = FlatteningCollator(
        return_seq_idx=True, return_flash_attn_kwargs=True, return_position_ids=True
    )
    out = collator([{"input_ids": [0, 5, 2], "attention_mask": [1, 1, 1]}, {"input_ids": [0, 2]}])
    assert calls == []
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5] and out["max_length_k"] == 3
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert out["seq_idx"].dtype == torch.int32 and out["seq_idx"].tolist() == [[0, 0, 0, 1, 1]]
    assert out["cu_seq_lens_q"] is not out["cu_seq_lens_k"]  # two tensors, as the collator makes


@pytest.mark.parametrize(
    ("features", "kwargs"),
    [
        ([{"input_ids": [1, 2, 3], "labels": [7, 8, 9]}], {}),  # labels of their own
        ([{"input_ids": torch.tensor([1, 2, 3])}], {}),  # a tensor, not a list
        ([{"input_ids": [1.0, 2.0]}], {}),  # floats: the collator's conversion reads them
        ([{"input_ids": [2**63, 1]}], {}),  # beyond int64: the collator's own error
        ([{"input_ids": [1, 2]}], {"return_tensors": "np"}),
    ],
)
def test_other_input_goes_to_the_collators_own_code(features, kwargs):
    def run(collator: DataCollatorWithFlattening) -> object:
        try:
            return collator(features, **kwargs)
        except Exception as exc:  # the same error, raised by the same code
            return (type(exc), str(exc))

    options = {"return_seq_idx": True, "return_flash_attn_kwargs": True}
    want = run(DataCollatorWithFlattening(**options))
    got = run(FlatteningCollator(**options))
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key, value in want.items():
            assert type(got[key]) is type(value), key
            assert str(got[key]) == str(value), key
    else:
        assert got == want


def test_a_bool_token_reads_as_the_collator_reads_it():
    features = [{"input_ids": [True, 3, False]}]
    _same(DataCollatorWithFlattening()(features), FlatteningCollator()(features))
