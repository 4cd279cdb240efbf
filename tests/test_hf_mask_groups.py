"""The mask check evaluates short packed sequences together (one evaluation of the model's
mask per group) and finds exactly what it found one sequence at a time."""

from __future__ import annotations

import pytest
import torch

import attn_backends as ab
from attn_backends.integrations import _hf_mask, _layout

LENGTHS = (5, 11, 1, 8, 3, 20, 2)
Calls = list[tuple[int, int, int, int]]
"""The ``(q_start, q_len, kv_start, kv_len)`` of each evaluation of the model's mask."""


def _layout_of(lengths: tuple[int, ...]) -> _layout.BatchLayout:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return _layout.from_cu_seqlens(cu, 1, sum(lengths))


def _model(lengths: tuple[int, ...], causal: bool, flip: tuple[int, int] | None, calls: Calls):
    """A model mask over absolute columns: same sequence, causal if asked; ``flip`` turns one
    cell the other way."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def evaluate(rows: int, q0: int, q_len: int, k0: int, k_len: int) -> torch.Tensor:
        calls.append((q0, q_len, k0, k_len))
        q = torch.arange(q0, q0 + q_len)[:, None]
        k = torch.arange(k0, k0 + k_len)[None, :]
        allowed = ids[q] == ids[k.clamp(min=0)]
        if causal:
            allowed &= k <= q
        if flip is not None and q0 <= flip[0] < q0 + q_len and k0 <= flip[1] < k0 + k_len:
            allowed[flip[0] - q0, flip[1] - k0] ^= True
        return allowed.expand(rows, q_len, k_len)

    return evaluate


def _spec(causal: bool) -> ab.AttentionSpec:
    return ab.AttentionSpec(2, 2, 16, torch.float32, causal=causal)


@pytest.mark.parametrize("causal", [True, False])
def test_short_sequences_are_evaluated_once(causal):
    calls: Calls = []
    layout = _layout_of(LENGTHS)
    found = _hf_mask._check_segments(_model(LENGTHS, causal, None, calls), layout, _spec(causal))
    assert found is None
    assert len(calls) == 1, calls
    q0, q_len, k0, k_len = calls[0]
    assert (q0, q_len, k0, k_len) == (0, sum(LENGTHS), 0, sum(LENGTHS))


# (query, key) cells to flip: inside a later sequence, the probe key just before it (causal),
# and a key of the previous sequence that the check does not compare (must pass).
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cell", [(30, 27), (17, 16), (25, 24), (5, 0)])
def test_grouped_and_alone_find_the_same_cell(causal, cell, monkeypatch):
    layout = _layout_of(LENGTHS)
    grouped = _hf_mask._check_segments(_model(LENGTHS, causal, cell, []), layout, _spec(causal))
    monkeypatch.setattr(_hf_mask, "TILE_ELEMENTS", 1)  # every sequence alone
    calls: Calls = []
    alone = _hf_mask._check_segments(_model(LENGTHS, causal, cell, calls), layout, _spec(causal))
    assert len(calls) >= len(LENGTHS)
    assert grouped == alone
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    q, k = cell
    seq = int((starts <= q).sum()) - 1
    compared = starts[seq] <= k < starts[seq + 1] or (causal and k == starts[seq] - 1)
    if compared:
        assert grouped is not None and (grouped.query, grouped.key) == cell
    else:
        assert grouped is None


def test_a_long_sequence_is_evaluated_alone_in_row_tiles(monkeypatch):
    monkeypatch.setattr(_hf_mask, "TILE_ELEMENTS", 400)
    lengths = (3, 4, 30, 2, 2)
    calls: Calls = []
    layout = _layout_of(lengths)
    assert _hf_mask._check_segments(_model(lengths, True, None, calls), layout, _spec(True)) is None
    long_calls = [c for c in calls if c[0] >= 7 and c[0] < 37]
    assert len(long_calls) > 1, "the 30-token sequence is cut into row tiles"
    assert (0, 7, 0, 7) in calls and (37, 4, 36, 5) in calls, calls
