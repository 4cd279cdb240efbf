"""torch-sdpa's grouped path: sequences of other lengths padded into one SDPA call per group,
against the float64 reference on fresh random batches."""

from __future__ import annotations

import pytest
import torch
from attn_backends_builtin import torch_sdpa

import attn_backends as ab
from attn_backends.reference import TOLERANCE, relative_error
from tests.spec_support import batch

CPU = ab.detect_platform("cpu")
LENGTHS = (9, 1, 33, 4, 9, 17)


def _spec(causal: bool, dtype: torch.dtype = torch.float32, **kw: object) -> ab.AttentionSpec:
    return ab.AttentionSpec(8, 2, 16, dtype, causal, **kw)  # type: ignore[arg-type]


CPU_DEVICE = torch.device("cpu")
FEATURES = ("alibi", "chunks", "plain", "window")


def _features(name: str, causal: bool) -> dict[str, object]:
    if name == "window":
        return {"window": ab.SlidingWindow(5, 0 if causal else 3)}
    if name == "alibi":
        return {"alibi": ab.AlibiSpec()}
    if name == "chunks":
        return {"chunk_size": 4}
    return {}


def _run(spec: ab.AttentionSpec, lengths: tuple[int, ...], seed: int, pad: int = 0):
    params, qkv = batch(spec, lengths, pad=pad, seed=seed)
    backend = ab.select(spec, backend="torch-sdpa", platform=CPU).backend
    plan = backend.prepare(params)
    out = backend.forward(qkv.clone(), plan)
    return out, ab.reference_attention(qkv, spec, params), plan.kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("split", [False, True], ids=["one-group", "a-group-per-length"])
@pytest.mark.parametrize("host", [True, False], ids=["host-indices", "tensor-indices"])
def test_groups_match_the_reference(dtype, causal, feature, split, host, monkeypatch):
    if split:  # no padding is worth a call: each length is its own group
        monkeypatch.setitem(torch_sdpa.CALL_COST, "cpu", 0)
    if not host:  # the indices of every batch built by tensor ops
        monkeypatch.setattr(torch_sdpa, "HOST_INDEX_SLOTS", 0)
    spec = _spec(causal, dtype, **_features(feature, causal))
    seed = FEATURES.index(feature) + 10 * causal + 100 * split
    out, ref, kernel = _run(spec, LENGTHS, seed, pad=3)
    assert len(kernel.groups) == (5 if split else 1)
    assert relative_error(out, ref) < TOLERANCE[dtype]


def test_a_single_token_and_mha_in_a_group():
    spec = ab.AttentionSpec(4, 4, 16, torch.float32, causal=False)
    out, ref, kernel = _run(spec, (1, 6, 1, 3), seed=7)
    assert len(kernel.groups) == 1 and kernel.groups[0].length == 6
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


def test_non_contiguous_separate_inputs_in_groups():
    """Views of a wider buffer (rows strided) reach the grouped path as they are."""
    spec = _spec(False)
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu")
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(params.token_q_num, spec.qkv_width + 16, generator=gen)
    q = wide[:, : spec.q_width]
    k = wide[:, spec.q_width : spec.q_width + spec.kv_width]
    v = wide[:, spec.q_width + spec.kv_width : spec.qkv_width]
    backend = ab.select(spec, backend="torch-sdpa", platform=CPU).backend
    out = backend.forward((q, k, v), backend.prepare(params))
    ref = ab.reference_attention(torch.cat((q, k, v), dim=1), spec, params)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


def test_equal_lengths_stay_one_view_without_a_gather():
    spec = _spec(True)
    out, ref, kernel = _run(spec, (8, 8, 8), seed=5)
    assert kernel.groups == () and len(kernel.runs) == 1
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


def test_sinks_keep_the_per_length_runs():
    spec = _spec(False, attention_sinks=True)
    params, qkv = batch(spec, LENGTHS, seed=9)
    backend = ab.select(spec, backend="torch-sdpa", platform=CPU).backend
    plan = backend.prepare(params)
    sinks = torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(9))
    out = backend.forward(qkv.clone(), plan, sinks=sinks)
    assert isinstance(plan.kernel, torch_sdpa.SdpaPlan) and plan.kernel.groups == ()
    ref = ab.reference_attention(qkv, spec, params, sinks=sinks)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


def test_a_sequence_joins_a_group_while_its_padding_costs_less_than_a_call():
    unit = 8 * 16
    # 40^2 - 39^2 = 79 cells of padding: joins at a cost of 79 * unit, not at 78 * unit
    assert torch_sdpa._group_members((40, 39), unit, 79 * unit) == [[0, 1]]
    assert torch_sdpa._group_members((40, 39), unit, 78 * unit) == [[0], [1]]
    # longest first; empty sequences belong to no group
    assert torch_sdpa._group_members((2, 0, 5, 5), unit, 0) == [[2, 3], [0]]


@pytest.mark.parametrize("seed", range(6))
def test_host_and_tensor_indices_agree(seed, monkeypatch):
    """Both ways of building a plan's gather indices give the same indices, on random batches
    of one to many groups (zero-length sequences included)."""
    gen = torch.Generator().manual_seed(seed)
    count = int(torch.randint(2, 40, (), generator=gen))
    lengths = tuple(int(n) for n in torch.randint(0, 70, (count,), generator=gen))
    lengths = (*lengths, 5)  # at least one token
    members = torch_sdpa._group_members(lengths, 64, 1 << (10 + 2 * seed))
    tokens = sum(lengths)
    monkeypatch.setattr(torch_sdpa, "HOST_INDEX_SLOTS", 1 << 30)
    host = torch_sdpa._indices(members, lengths, tokens, CPU_DEVICE)
    monkeypatch.setattr(torch_sdpa, "HOST_INDEX_SLOTS", 0)
    tensor = torch_sdpa._indices(members, lengths, tokens, CPU_DEVICE)
    for a, b in zip(host, tensor, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(8))
def test_one_group_in_batch_order_gathers_and_returns_every_row(seed):
    """A single group keeps the batch's order on the CPU, its indices made from the valid
    slots: each sequence's rows in its slots, padded slots repeating its last row, and every
    packed row taken back from its own slot; the same cells as the longest-first builder."""
    gen = torch.Generator().manual_seed(100 + seed)
    count = int(torch.randint(1, 12, (), generator=gen))
    lengths = tuple(int(n) for n in torch.randint(0, 30, (count,), generator=gen))
    lengths = (*lengths, 3)
    group = [i for i, n in enumerate(lengths) if n > 0]
    rows, valid, take = torch_sdpa._one_group_indices(group, lengths)
    length = max(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    want_rows = [starts[i] + min(j, lengths[i] - 1) for i in group for j in range(length)]
    want_valid = [j < lengths[i] for i in group for j in range(length)]
    assert rows.tolist() == want_rows and valid.tolist() == want_valid
    assert torch.equal(rows.index_select(0, take), torch.arange(sum(lengths)))
    old_rows, old_valid, _ = torch_sdpa._indices(
        torch_sdpa._group_members(lengths, 64, 1 << 40), lengths, sum(lengths), CPU_DEVICE
    )
    assert sorted(old_rows[old_valid].tolist()) == sorted(rows[valid].tolist())
