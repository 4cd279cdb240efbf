"""Proofs the hot path keeps instead of remaking per forward, each proven equal to what it
replaces: a config's text sub-config read from the instance (against transformers' own
``get_text_config``), separate-input checks shared by the plans of one backend (still keyed
by every count they read), and the positions check's three-operation rule (against the full
rule)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

import attn_backends as ab
import attn_backends.errors
import attn_backends.reference
from attn_backends._path import _contract
from attn_backends._path import _separate as separate_checks
from attn_backends.integrations import _hf_proof, _layout

transformers = pytest.importorskip("transformers")

from attn_backends.integrations import _hf_models  # noqa: E402

# --- a config's text sub-config ----------------------------------------------------------


def _default_configs() -> list[tuple[str, Any]]:
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, cls in transformers.CONFIG_MAPPING.items():
            try:
                found.append((name, cls()))
            except Exception:  # a config that needs arguments: nothing to compare
                continue
    return found


def _transformers_text_config(config: Any) -> Any:
    if getattr(config, "layer_types", None) is not None:
        return config
    return config.get_text_config()


def test_text_config_is_transformers_own_for_every_registered_config():
    configs = _default_configs()
    assert len(configs) > 500, "transformers' registry of config classes"
    wrong = []
    for name, config in configs:
        ambiguous = "more than one text sub-config"
        try:
            want: Any = _transformers_text_config(config)
        except ValueError:  # transformers' own answer to an ambiguous composite
            want = ambiguous
        try:
            got: Any = _hf_models._text_config(config)
        except attn_backends.errors.IntegrationError as exc:  # the library refuses it by name
            got = ambiguous if "more than one text config" in str(exc) else exc
        if got is not want:
            wrong.append(name)
    assert wrong == []


def test_text_config_follows_a_sub_config_set_or_dropped_after_loading():
    text = transformers.Qwen3Config(num_hidden_layers=2)
    outer = transformers.Qwen3Config(num_hidden_layers=3)
    outer.layer_types = None
    assert _hf_models._text_config(outer) is outer.get_text_config() is outer
    outer.text_config = text
    assert _hf_models._text_config(outer) is outer.get_text_config() is text
    outer.decoder = transformers.Qwen3Config(num_hidden_layers=1)
    with pytest.raises(ValueError, match="Multiple valid text configs"):
        outer.get_text_config()
    with pytest.raises(ValueError, match="Multiple valid text configs"):
        _hf_models._text_config(outer)
    outer.text_config = None
    assert _hf_models._text_config(outer) is outer.decoder


# --- separate-input checks shared across plans ---------------------------------------------

SPEC = ab.AttentionSpec(4, 2, 16, torch.float32, causal=True)


def _separate(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 4, 16, generator=g),
        torch.randn(rows, 2, 16, generator=g),
        torch.randn(rows, 2, 16, generator=g),
    )


def test_a_new_plan_finds_the_checks_an_earlier_plan_made(monkeypatch):
    calls = []
    real = separate_checks.separate_geometry

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2].token_q_num)
        return real(*args, **kwargs)

    monkeypatch.setattr(_contract, "separate_geometry", counting)  # what ForwardPath calls
    backend = TorchSdpaBackend.bind(SPEC)
    for lengths in ((3, 5), (5, 3), (2, 6)):  # three batches of 8 tokens, three plans
        params = ab.FMHAParams.from_lengths(lengths, device="cpu")
        qkv = _separate(8)
        out = backend.forward(qkv, backend.prepare(params))
        want = ab.reference_attention(torch.cat([t.flatten(1) for t in qkv], 1), SPEC, params)
        assert ab.reference.relative_error(out, want) < ab.reference.TOLERANCE[torch.float32]
    assert calls == [8], "checked once for the three plans of one geometry"
    other = ab.FMHAParams.from_lengths((4, 6), device="cpu")
    backend.forward(_separate(10), backend.prepare(other))
    assert calls == [8, 10], "another token count is checked anew"


def test_shared_checks_still_refuse_rows_a_new_plan_does_not_have():
    backend = TorchSdpaBackend.bind(SPEC)
    backend.forward(_separate(8), backend.prepare(ab.FMHAParams.from_lengths((3, 5), device="cpu")))
    bigger = backend.prepare(ab.FMHAParams.from_lengths((3, 5, 2), device="cpu"))
    with pytest.raises(ab.errors.PackedQKVError, match="8 rows for a plan of 10 rows"):
        backend.forward(_separate(8), bigger)


# --- the positions check ------------------------------------------------------------------


def _row_layout(lengths: list[int]) -> _layout.BatchLayout:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return _layout.from_cu_seqlens(torch.tensor(bounds, dtype=torch.int32), 1, bounds[-1])


@pytest.mark.parametrize(
    ("positions", "counts"),
    [
        ([0, 1, 2, 0, 1, 0, 1, 2, 3], True),  # restarting at 0
        ([2, 3, 4, 2, 3, 2, 3, 4, 5], True),  # RoBERTa's offset, shared
        ([0, 1, 2, 5, 6, 9, 10, 11, 12], True),  # each sequence its own start: the full rule
        ([0, 1, 2, 3, 4, 5, 6, 7, 8], True),  # counting through a boundary: loose rule holds
        ([0, 1, 3, 0, 1, 0, 1, 2, 3], False),  # a jump inside the first sequence
        ([0, 0, 0, 0, 0, 0, 0, 0, 0], False),
    ],
)
def test_positions_proof_agrees_with_the_full_rule(positions, counts):
    layout = _row_layout([3, 2, 4])
    row = torch.tensor(positions)
    starts = [start for _, start, _ in layout.segments]
    assert _hf_proof.positions_split_at(row, starts, strict=False) is counts
    reads = (("positions", row[None]),)
    assert _hf_proof._reads_match_segments(reads, layout) is counts


def _counts_by_hand(row: list[int], starts: list[int], *, strict: bool) -> bool:
    """`positions_split_at`'s rule, token by token on host ints."""
    boundary = set(starts[1:])
    for t in range(1, len(row)):
        counts = row[t] == row[t - 1] + 1
        if t not in boundary and not counts:
            return False
        if strict and t in boundary and counts:
            return False
    return True


def test_positions_rule_equals_the_rule_by_hand_on_random_rows():
    gen = torch.Generator().manual_seed(7)
    for _ in range(300):
        lengths = torch.randint(
            1, 6, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen
        )
        starts = [0, *torch.cumsum(lengths, 0)[:-1].tolist()]
        seq = int(lengths.sum())
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        if kind == 0:  # restarting per sequence at a shared offset
            row = torch.cat([torch.arange(int(n)) for n in lengths]) + int(
                torch.randint(0, 3, (1,), generator=gen)
            )
        elif kind == 1:  # counting through the boundaries
            row = torch.arange(seq)
        elif kind == 2:  # each sequence its own start
            row = torch.cat(
                [
                    torch.arange(int(n)) + int(torch.randint(0, 9, (1,), generator=gen))
                    for n in lengths
                ]
            )
        else:  # noise
            row = torch.randint(0, 4, (seq,), generator=gen)
        for strict in (False, True):
            expected = _counts_by_hand(row.tolist(), starts, strict=strict)
            assert _hf_proof.positions_split_at(row, starts, strict=strict) is expected


def test_positions_that_cannot_count_prove_nothing():
    starts = [0, 2]
    assert (
        _hf_proof.positions_split_at(torch.tensor([True, True, True]), starts, strict=False)
        is False
    )
    # an empty sequence at either end adds no step to check
    assert _hf_proof.positions_split_at(torch.tensor([0, 1, 0]), [0, 0, 2, 3], strict=True) is True
