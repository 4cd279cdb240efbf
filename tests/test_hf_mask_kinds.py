"""Mask functions recognised to broadcast: transformers' non-vmap evaluation of each equals
its own vmap evaluation (the oracle), on random grids with padding; anything not recognised
keeps vmap."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as mu
from transformers.models.gemma3 import modeling_gemma3

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
    kinds.recognised_codes.cache_clear()
    try:
        assert kinds.broadcastable(mu.sliding_window_causal_mask_function(4))
        remapped = mu.add_offsets_to_mask_function(mu.causal_mask_function, 0, 0)
        assert kinds.broadcastable(remapped)
    finally:
        monkeypatch.undo()
        kinds.recognised_codes.cache_clear()
