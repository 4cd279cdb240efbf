"""The mask check evaluates packed sequences of similar length together (one evaluation of the
model's mask per group, `_hf_mask.hook_blocks`), reads exactly what transformers' own
evaluation of the mask says on every compared cell, and finds exactly what it found one
sequence at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import masking_utils as hf

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


def _counted(blocks: _hf_mask.ModelBlocks, counts: list[int]) -> _hf_mask.ModelBlocks:
    def evaluate(rows: torch.Tensor, *args: Any) -> torch.Tensor:
        counts.append(rows.numel())
        return blocks(rows, *args)

    return evaluate


@pytest.mark.parametrize("causal", [True, False])
def test_short_sequences_are_evaluated_in_one_call(causal):
    counts: list[int] = []
    model = _model(LENGTHS, causal, None, [])
    blocks = _counted(_hf_mask.blocks_of(model), counts)
    assert _hf_mask._check_segments(model, blocks, _layout_of(LENGTHS), _spec(causal)) is None
    assert counts == [len(LENGTHS)]


# (query, key) cells to flip: inside a later sequence, the probe key just before it (causal),
# and a key of the previous sequence that the check does not compare (must pass).
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cell", [(30, 27), (17, 16), (25, 24), (5, 0), (47, 47), (0, 0)])
def test_grouped_and_alone_find_the_same_cell(causal, cell, monkeypatch):
    layout = _layout_of(LENGTHS)
    model = _model(LENGTHS, causal, cell, [])
    grouped = _hf_mask._check_segments(model, _hf_mask.blocks_of(model), layout, _spec(causal))
    monkeypatch.setattr(_hf_mask, "TILE_ELEMENTS", 1)  # every sequence alone
    calls: Calls = []
    model = _model(LENGTHS, causal, cell, calls)
    alone = _hf_mask._check_segments(model, _hf_mask.blocks_of(model), layout, _spec(causal))
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
    model = _model(lengths, True, None, calls)
    layout = _layout_of(lengths)
    assert _hf_mask._check_segments(model, _hf_mask.blocks_of(model), layout, _spec(True)) is None
    long_calls = [c for c in calls if 7 <= c[0] < 37]
    assert len(long_calls) > 1, "the 30-token sequence is cut into row tiles"
    assert all(c[1] * c[3] <= 400 for c in long_calls), long_calls
    # the short ones through the grouped path: each its own block and the probe key before it
    assert {(0, 3, 0, 3), (3, 4, 2, 5), (37, 2, 36, 3), (39, 2, 38, 3)} <= set(calls), calls


def test_groups_respect_the_tile(monkeypatch):
    monkeypatch.setattr(_hf_mask, "TILE_ELEMENTS", 100)
    counts: list[int] = []
    model = _model(LENGTHS, False, None, [])
    blocks = _counted(_hf_mask.blocks_of(model), counts)
    assert _hf_mask._check_segments(model, blocks, _layout_of(LENGTHS), _spec(False)) is None
    # 20 and 11 exceed the tile alone (row tiles of the grid); the rest longest first, padded
    # to their group's longest: 8 (64 cells, one fits), then 5, 3, 2, 1 (four blocks of 25)
    assert counts == [1, 4], counts


# --- hook_blocks against transformers' own evaluation of the same mask --------------------

PACKED = (6, 1, 9, 4, 12)


def _mask_functions() -> dict[str, Callable[[torch.Tensor], Callable[..., Any]]]:
    """Mask functions transformers builds, each from the packed row's sequence ids."""
    from transformers.models.gemma3.modeling_gemma3 import _bidirectional_window_overlay

    return {
        "causal": lambda ids: hf.causal_mask_function,
        "bidirectional": lambda ids: hf.bidirectional_mask_function,
        "sliding causal": lambda ids: hf.and_masks(
            hf.causal_mask_function, hf.sliding_window_overlay(3)
        ),
        "sliding bidirectional": lambda ids: hf.sliding_window_bidirectional_overlay(3),
        "chunked causal": lambda ids: hf.and_masks(
            hf.causal_mask_function, hf.chunked_overlay(4, torch.zeros(2, dtype=torch.long))
        ),
        "packed causal": lambda ids: hf.and_masks(
            hf.causal_mask_function, hf.packed_sequence_mask_function(ids)
        ),
        "gemma bidirectional window": lambda ids: hf.or_masks(
            hf.and_masks(hf.causal_mask_function, hf.sliding_window_overlay(3)),
            _bidirectional_window_overlay(3),
        ),
        "true overlay": lambda ids: hf.or_masks(
            hf.causal_mask_function, lambda *args: torch.tensor(True, dtype=torch.bool)
        ),
    }


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind", sorted(_mask_functions()))
@pytest.mark.parametrize("lead", [0, 1])
def test_hooked_blocks_equal_transformers_grid(kind, use_vmap, padded, lead):
    """Two rows: packed sequences in row 1 (with a padded tail when ``padded``); every block's
    compared cells equal the same cells of ``sdpa_mask`` over the whole batch."""
    length = sum(PACKED) + 3
    ids = torch.zeros(2, length, dtype=torch.long)
    ids[1, : sum(PACKED)] = torch.repeat_interleave(
        torch.arange(1, len(PACKED) + 1), torch.tensor(PACKED)
    )
    padding = None
    if padded:
        padding = torch.ones(2, length, dtype=torch.bool)
        padding[1, sum(PACKED) :] = False
    function = _mask_functions()[kind](ids)
    grid = _hf_mask.hook_mask(function, padding, use_vmap, torch.device("cpu"))(
        2, 0, length, 0, length
    )
    blocks = _hf_mask.hook_blocks(function, padding, use_vmap, torch.device("cpu"))
    starts = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()[:-1]])
    stops = starts + torch.tensor(PACKED)
    longest = max(PACKED)
    got = blocks(torch.ones_like(starts), starts, stops, longest, lead)
    assert got.shape == (len(PACKED), longest, lead + longest)
    for g, (start, stop) in enumerate(zip(starts.tolist(), stops.tolist(), strict=True)):
        k0 = max(0, start - lead)
        want = grid[1, start:stop, k0:stop]
        col = k0 - (start - lead)
        assert torch.equal(got[g, : stop - start, col : col + stop - k0], want), (kind, g)


@pytest.mark.parametrize(
    ("spare", "want"),
    [
        (1 << 40, _hf_mask.CUDA_TILE_ELEMENTS),  # plenty: the cap
        (4 * _hf_mask.CELL_BYTES * (1 << 24), 1 << 24),  # a quarter of what is left
        (1 << 20, _hf_mask.TILE_ELEMENTS),  # nearly nothing: never below the CPU's tile
    ],
)
def test_cuda_tiles_grow_with_the_memory_left(spare, want, monkeypatch):
    held, used = 3 << 30, 2 << 30  # the caching allocator's unused 1 GiB counts as left
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (spare - (held - used), 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: held)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: used)
    assert _hf_mask.tile_elements(torch.device("cuda", 0)) == want
    assert _hf_mask.tile_elements(torch.device("cpu")) == _hf_mask.TILE_ELEMENTS
