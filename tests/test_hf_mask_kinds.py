"""Mask functions recognised to broadcast: transformers' non-vmap evaluation of each equals
its own vmap evaluation (the oracle), on random grids with padding; anything not recognised
keeps vmap. Mask functions as values: a check passed for a class of call holds for every batch
of the class, proven against the full check on random batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as mu
from transformers.models.gemma3 import modeling_gemma3

import attn_backends as ab
from attn_backends.integrations import _hf_mask, _hf_proof, _layout
from attn_backends.integrations import _hf_mask_kinds as kinds


def _grid(function, padding: torch.Tensor, use_vmap: bool) -> torch.Tensor:
    batch, length = padding.shape
    mask = mu.sdpa_mask(
        batch_size=batch,
        q_length=length,
        kv_length=length,
        mask_function=function,
        attention_mask=padding,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        device=torch.device("cpu"),
    )
    assert mask is not None, "no skip was allowed"
    return mask.expand(batch, 1, length, length)


def _functions(batch: int, length: int, gen: torch.Generator) -> dict[str, object]:
    ids = torch.randint(0, 3, (batch, length), generator=gen).cumsum(1)
    blocks = torch.randint(-1, 2, (batch, length), generator=gen)
    positions = torch.arange(length).repeat(batch, 1) % max(1, length // 2)
    left = torch.randint(0, 3, (batch,), generator=gen)
    window = int(torch.randint(1, length + 1, (), generator=gen))
    chunk = int(torch.randint(1, length + 1, (), generator=gen))

    def constant_true(*args: object) -> torch.Tensor:
        return torch.tensor(True, dtype=torch.bool)

    return {
        "causal": mu.causal_mask_function,
        "bidirectional": mu.bidirectional_mask_function,
        "sliding-causal": mu.sliding_window_causal_mask_function(window),
        "sliding-bidirectional": mu.sliding_window_bidirectional_mask_function(window),
        "chunked-causal": mu.chunked_causal_mask_function(chunk, left),
        "packed-causal": mu.and_masks(
            mu.causal_mask_function, mu.packed_sequence_mask_function(ids)
        ),
        "blockwise-or-causal": mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks)),
        "remapped-window": mu.remap_positions_for_packed_sequence(
            mu.sliding_window_causal_mask_function(window), positions
        ),
        "offsets": mu.add_offsets_to_mask_function(mu.causal_mask_function, 1, 0),
        "gemma3-window-or": mu.or_masks(
            mu.sliding_window_causal_mask_function(window),
            modeling_gemma3._bidirectional_window_overlay(window),
        ),
        "gemma3-constant-or": mu.or_masks(mu.causal_mask_function, constant_true),
    }


@pytest.mark.parametrize("seed", range(6))
def test_every_recognised_kind_broadcasts_exactly_as_vmap_evaluates_it(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, length = 1 + seed % 3, 3 + 5 * seed
    padding = torch.rand(batch, length, generator=gen) > 0.2
    for name, function in _functions(batch, length, gen).items():
        assert kinds.broadcastable(function), name
        exact = _grid(function, padding, use_vmap=True)
        assert torch.equal(_grid(function, padding, use_vmap=False), exact), name


def test_a_function_reading_its_indices_is_not_taken_for_a_constant() -> None:
    def small_q(b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return q < 3

    def global_reader(*args: object) -> torch.Tensor:
        return torch.tensor(THRESHOLD > 0)

    for unknown in (
        small_q,
        lambda b, h, q, kv: q >= 0,
        global_reader,
        mu.or_masks(mu.causal_mask_function, small_q),
        mu.and_masks(mu.sliding_window_overlay(3), mu.or_masks(global_reader)),
    ):
        assert not kinds.broadcastable(unknown)
    assert not kinds.broadcastable(None) and not kinds.broadcastable(len)


THRESHOLD = 1


def test_a_recognised_code_with_an_unknown_function_inside_keeps_vmap() -> None:
    """Composition is walked: and/or nodes and the remapping wrappers are recognised only
    when every function they close over is."""

    def custom(b: object, h: object, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q - kv) % 2 == 0

    assert not kinds.broadcastable(mu.remap_positions_for_packed_sequence(custom, torch.zeros(1)))
    assert not kinds.broadcastable(mu.add_offsets_to_mask_function(custom, 0, 0))
    assert kinds.broadcastable(mu.and_masks(mu.causal_mask_function, mu.causal_mask_function))


def test_a_transformers_release_without_a_primitive_recognises_the_others(monkeypatch) -> None:
    """transformers 5.17 has no ``remap_positions_for_packed_sequence``: recognition must
    not assume every primitive of the newest release exists (it failed every packed
    EmbeddingGemma batch on the H200 once)."""
    monkeypatch.delattr(mu, "remap_positions_for_packed_sequence")
    kinds.clear_caches()
    try:
        assert kinds.broadcastable(mu.sliding_window_causal_mask_function(4))
        remapped = mu.add_offsets_to_mask_function(mu.causal_mask_function, 0, 0)
        assert kinds.broadcastable(remapped)
    finally:
        monkeypatch.undo()
        kinds.clear_caches()


# ---- the proof: a check passed for a class of call holds for every batch of the class --------

CPU = torch.device("cpu")
KINDS = ["causal", "sliding-causal", "bidirectional", "sliding-bidirectional"]


def _kinds(window: int) -> dict[str, tuple[Callable[..., Any], bool, ab.SlidingWindow | None]]:
    """Mask function, causal flag and the window the spec must carry for it."""
    return {
        "causal": (mu.causal_mask_function, True, None),
        "sliding-causal": (
            mu.sliding_window_causal_mask_function(window),
            True,
            ab.SlidingWindow(window - 1, 0),
        ),
        "bidirectional": (mu.bidirectional_mask_function, False, None),
        "sliding-bidirectional": (
            mu.sliding_window_bidirectional_mask_function(window),
            False,
            ab.SlidingWindow(window, window),
        ),
    }


def _rows_case(
    function: Callable[..., Any], gen: torch.Generator
) -> tuple[_hf_mask.MaskRequest, _layout.BatchLayout]:
    batch, length = (
        int(torch.randint(1, 4, (), generator=gen)),
        int(torch.randint(2, 12, (), generator=gen)),
    )
    padding = torch.zeros(batch, length, dtype=torch.bool)
    for row in range(batch):
        count = int(torch.randint(1, length + 1, (), generator=gen))
        start = int(torch.randint(0, length - count + 1, (), generator=gen))
        padding[row, start : start + count] = True
    pad = None if bool(padding.all()) else padding
    request = _hf_mask.MaskRequest(
        "test", batch, length, CPU, pad, _hf_mask.hook_mask(function, pad, False, CPU)
    )
    request.blocks = _hf_mask.hook_blocks(function, pad, False, CPU)
    return request, _layout.from_padding_mask(padding)


def _packed_case(
    function: Callable[..., Any], causal: bool, gen: torch.Generator
) -> tuple[_hf_mask.MaskRequest, _layout.BatchLayout]:
    lengths = torch.randint(1, 7, (int(torch.randint(2, 5, (), generator=gen)),), generator=gen)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None]
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    # what transformers builds for a packed causal batch: positions remapped per sequence,
    # and the sequences' ids
    full = (
        mu.and_masks(
            mu.remap_positions_for_packed_sequence(function, positions),
            mu.packed_sequence_mask_function(ids),
        )
        if causal
        else function
    )
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    tokens = int(cu[-1])
    request = _hf_mask.MaskRequest(
        "test", 1, tokens, CPU, None, _hf_mask.hook_mask(full, None, False, CPU)
    )
    request.blocks = _hf_mask.hook_blocks(full, None, False, CPU)
    found = kinds.proof_signature(full)
    assert found is not None
    request.proof, packed = found
    request.packed_ids = tuple(packed)
    return request, _layout.from_cu_seqlens(cu, 1, tokens)


@pytest.mark.parametrize(
    "kind", ["causal", "sliding-causal", "bidirectional", "sliding-bidirectional"]
)
def test_every_batch_of_a_proved_class_passes_the_full_check(kind: str) -> None:
    """The claim the cache rests on, checked against the full check itself on random batches:
    one key per class, and every batch with that key passes."""
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    function, causal, window = _kinds(3)[kind]
    spec = ab.AttentionSpec(2, 2, 8, torch.float32, causal=causal, window=window)
    keys: dict[str, set[object]] = {"rows": set(), "packed": set()}
    for _ in range(12):
        request, layout = _rows_case(function, gen)
        found = kinds.proof_signature(function)
        assert found is not None
        request.proof, _ = found
        keys["rows"].add(_hf_proof.mask_proof(request, layout, spec))
        assert request.evaluate is not None
        _hf_mask.check_mask(
            request.evaluate, layout, spec, model_name="m", layer="l", blocks=request.blocks
        )
        request, layout = _packed_case(function, causal, gen)
        keys["packed"].add(_hf_proof.mask_proof(request, layout, spec))
        assert request.evaluate is not None
        _hf_mask.check_mask(
            request.evaluate, layout, spec, model_name="m", layer="l", blocks=request.blocks
        )
    assert all(len(found) == 1 and None not in found for found in keys.values()), keys


def test_a_batch_of_no_provable_class_has_no_proof() -> None:
    spec = ab.AttentionSpec(2, 2, 8, torch.float32, causal=True)
    hole = torch.tensor([[True, False, True, True]])
    request = _hf_mask.MaskRequest(
        "test", 1, 4, CPU, hole, _hf_mask.hook_mask(mu.causal_mask_function, hole, False, CPU)
    )
    request.proof = kinds.proof_signature(mu.causal_mask_function)[0]  # type: ignore[index]
    assert _hf_proof.mask_proof(request, _layout.from_padding_mask(hole), spec) is None
    request.proof = None  # a function not built from shift-free primitives
    assert (
        _hf_proof.mask_proof(request, _layout.from_padding_mask(torch.ones(1, 4).bool()), spec)
        is None
    )
    # packed ids that do not change at the layout's boundaries
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    wrong = torch.tensor([[0, 0, 0, 1]])
    function = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(wrong))
    request.proof, ids = kinds.proof_signature(function)  # type: ignore[misc]
    request.packed_ids = tuple(ids)
    assert _hf_proof.mask_proof(request, _layout.from_cu_seqlens(cu, 1, 4), spec) is None
    # positions that do not count up by one inside a sequence
    jumping = torch.tensor([[0, 2, 0, 1]])
    right = torch.tensor([[0, 0, 1, 1]])
    function = mu.and_masks(
        mu.remap_positions_for_packed_sequence(mu.causal_mask_function, jumping),
        mu.packed_sequence_mask_function(right),
    )
    request.proof, ids = kinds.proof_signature(function)  # type: ignore[misc]
    request.packed_ids = tuple(ids)
    assert _hf_proof.mask_proof(request, _layout.from_cu_seqlens(cu, 1, 4), spec) is None
    assert (
        kinds.proof_signature(
            mu.remap_positions_for_packed_sequence(mu.packed_sequence_mask_function(right), right)
        )
        is None
    ), "a remapped function reading tensors of its own is not proved"
