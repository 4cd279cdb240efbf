"""transformers' ``DataCollatorWithFlattening`` output, built from the token lists in a few
tensor operations.

sentence-transformers flattens every text batch through that collator, which builds each of its
four ``[1, T]`` tensors (``input_ids``, ``labels``, ``position_ids``, ``seq_idx``) from a Python
list grown token by token and converted element by element: about 50 µs for 8 queries and 2 ms
for 32 documents of up to 512 tokens, host time each batch waits for before its forward. Here
the token lists become one int64 buffer read in place and the other tensors are computed from it
and the lengths; the result is the collator's own, key for key, dtype for dtype
(`tests/test_st_collator.py` holds the two against each other on random batches).

Only the input sentence-transformers hands over takes this path: ``return_tensors="pt"``, no
``labels`` in the features, ``input_ids`` as Python lists of ints. Anything else goes to the
collator's own ``__call__``.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DataCollatorWithFlattening


class FlatteningCollator(DataCollatorWithFlattening):
    """`DataCollatorWithFlattening` with the same output for sentence-transformers' batches,
    made without per-token Python work (see the module)."""

    def __call__(
        self,
        features: Sequence[dict[str, Any]],
        return_tensors: str | None = None,
        separator_id: int | None = None,
    ) -> dict[str, Any]:
        tokens = _token_lists(features, return_tensors or self.return_tensors)
        flat = _int64_buffer(tokens) if tokens is not None else None
        if tokens is None or flat is None or type(self.position_ids_start) is not int:
            own: dict[str, Any] = super().__call__(  # type: ignore[no-untyped-call]
                features, return_tensors, separator_id
            )
            return own
        separator = self.separator_id if separator_id is None else separator_id
        return self._collate(flat, [len(t) for t in tokens], separator)

    def _collate(self, flat: torch.Tensor, lengths: list[int], separator: int) -> dict[str, Any]:
        count, total = len(lengths), flat.numel()
        starts = list(itertools.accumulate(lengths, initial=0))
        input_ids = flat.view(1, total)
        labels = input_ids.clone()  # each sequence's first label is the separator
        labels[0, starts[:-1]] = separator
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
        per_token = torch.tensor(lengths)
        if self.return_position_ids:
            first = torch.tensor(starts[:-1]).repeat_interleave(per_token, output_size=total)
            offset = torch.arange(total) - first
            batch["position_ids"] = (offset + self.position_ids_start).view(1, total)
        if self.return_seq_idx:
            ids = torch.arange(count, dtype=torch.int32)
            batch["seq_idx"] = ids.repeat_interleave(per_token, output_size=total).view(1, total)
        if self.return_flash_attn_kwargs:
            batch["cu_seq_lens_q"] = torch.tensor(starts, dtype=torch.int32)
            batch["cu_seq_lens_k"] = torch.tensor(starts, dtype=torch.int32)
            batch["max_length_q"] = batch["max_length_k"] = max(lengths)
        return batch


def _token_lists(features: Sequence[dict[str, Any]], return_tensors: str) -> list[list[int]] | None:
    """The non-empty ``input_ids`` lists, when the batch is one this module builds (None: the
    collator's own path, which also raises on a batch of empty inputs)."""
    if return_tensors != "pt" or not features:
        return None
    tokens: list[list[int]] = []
    for feature in features:
        if type(feature) is not dict or "labels" in feature:
            return None
        ids = feature.get("input_ids")
        if type(ids) is not list:
            return None
        if ids:
            tokens.append(ids)
    return tokens or None


def _int64_buffer(tokens: list[list[int]]) -> torch.Tensor | None:
    """The token lists laid end to end as an int64 tensor over one host buffer (read in place);
    None when a value is no integer that fits int64 (a float, say, which the collator's tensor
    conversion reads its own way). A bool is 0 or 1 in both."""
    try:
        values = array.array("q", itertools.chain.from_iterable(tokens))
    except (TypeError, OverflowError):
        return None
    return torch.frombuffer(values, dtype=torch.int64)
