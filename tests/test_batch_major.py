"""Batch-major ``(q, k, v)`` input and the bound forward, each against the float64 reference
and against the path it shortcuts.

Batch-major input is ``[n, heads, L, D]`` per tensor for a batch of ``n`` sequences of ``L``
tokens (transformers' layout): torch-sdpa attends it as it is, any other kernel reads rows made
from it (a view where the memory allows, else a copy). `PrefillBackend.bind_forward` checks an
input once and serves later inputs of its signature without the checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attn_backends as ab
from attn_backends._path._contract import BoundForward, PrefillPlan, QKVInput, QKVViews
from attn_backends._path._geometry import Grid
from attn_backends.errors import PackedQKVError
from attn_backends.plugin import PrefillBackend
from attn_backends.reference import TOLERANCE, reference_attention, relative_error

CPU = torch.device("cpu")


def _spec(causal: bool, kv_heads: int = 2, **kw: object) -> ab.AttentionSpec:
    return ab.AttentionSpec(
        num_heads=4,
        num_kv_heads=kv_heads,
        head_dim=16,
        dtype=torch.float32,
        causal=causal,
        **kw,  # type: ignore[arg-type]
    )


def _batch(spec: ab.AttentionSpec, count: int, length: int, seed: int) -> torch.Tensor:
    """Packed rows ``[count * length, qkv_width]``, fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count * length, spec.qkv_width, generator=gen)


def _batch_major(
    spec: ab.AttentionSpec, packed: torch.Tensor, count: int, dense: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    length = packed.shape[0] // count
    q_end, k_end = spec.q_width, spec.q_width + spec.kv_width
    parts = (
        packed[:, :q_end].view(count, length, spec.num_heads, spec.head_dim),
        packed[:, q_end:k_end].view(count, length, spec.num_kv_heads, spec.head_dim),
        packed[:, k_end:].view(count, length, spec.num_kv_heads, spec.head_dim),
    )
    grids = [p.transpose(1, 2) for p in parts]
    if dense:
        grids = [g.contiguous() for g in grids]
    return grids[0], grids[1], grids[2]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dense", [False, True], ids=["views", "dense"])
@pytest.mark.parametrize("shape", [(3, 7), (1, 1), (1, 20)], ids=["3x7", "one-token", "1x20"])
def test_batch_major_input_against_the_reference(
    causal: bool, kv_heads: int, dense: bool, shape: tuple[int, int]
):
    count, length = shape
    spec = _spec(causal, kv_heads)
    backend = ab.select(spec, device=CPU).backend
    params = ab.FMHAParams.from_lengths([length] * count, device=CPU)
    packed = _batch(spec, count, length, seed=count * 100 + length + kv_heads + int(causal))
    out = backend.forward(_batch_major(spec, packed, count, dense), backend.prepare(params))
    ref = reference_attention(packed, spec, params)
    assert out.shape == (count * length, spec.q_width)
    assert relative_error(out, ref) < TOLERANCE[spec.dtype]


def test_a_batch_major_kernel_reads_the_tensors_as_given_and_rows_are_made_on_first_read():
    spec = _spec(False)
    backend = ab.select(spec, device=CPU).backend
    assert isinstance(backend, PrefillBackend)
    plan = backend.prepare(ab.FMHAParams.from_lengths([5, 5], device=CPU))
    seen: list[QKVViews] = []
    real = type(backend).attend

    def spy(self: PrefillBackend, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        seen.append(views)
        return real(self, views, plan)

    q, k, v = _batch_major(spec, _batch(spec, 2, 5, seed=1), 2, dense=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(backend), "attend", spy)
        backend.forward((q, k, v), plan)
    (views,) = seen
    assert views.batch is not None and views.batch[0] is q and views.batch[2] is v
    assert views._q is None, "torch-sdpa attends batch-major: no rows were made"
    rows = views.q  # made on first read: a view of the given tensor here
    assert rows.shape == (10, 4, 16) and rows.data_ptr() == q.data_ptr()
    assert torch.equal(rows, q.transpose(1, 2).reshape(10, 4, 16))
    dense = _batch_major(spec, _batch(spec, 2, 5, seed=2), 2, dense=True)
    views = QKVViews.of_batch(dense, _grids_of(backend, dense, plan))
    assert views.k.data_ptr() != dense[1].data_ptr(), "rows no view reaches are a copy"
    assert torch.equal(views.k, dense[1].transpose(1, 2).reshape(10, 2, 16))


def _grids_of(
    backend: PrefillBackend, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], plan: PrefillPlan
) -> tuple[Grid, Grid, Grid]:
    bound = backend.bind_forward(qkv, plan)
    assert bound is not None
    grids = bound._geo.grids
    assert grids is not None
    return grids


@pytest.mark.parametrize(
    ("lengths", "padded_rows", "q_heads", "match"),
    [
        ((4, 4), None, 3, "of shape"),  # heads other than the spec's
        ((3, 5), None, 4, "plan of lengths"),  # 8 tokens, other lengths
        ((4, 4), 10, 4, "in 10 rows"),  # padding rows
    ],
    ids=["heads", "lengths", "padding-rows"],
)
def test_batch_major_input_of_another_batch_is_refused_untouched(
    lengths: tuple[int, ...], padded_rows: int | None, q_heads: int, match: str
):
    spec = _spec(False, kv_heads=4)
    backend = ab.select(spec, device=CPU).backend
    plan = backend.prepare(ab.FMHAParams.from_lengths(lengths, device=CPU, padded_rows=padded_rows))
    q, kv = torch.randn(2, q_heads, 4, 16), torch.randn(2, 4, 4, 16)
    before = q.clone()
    with pytest.raises(PackedQKVError, match=match):
        backend.forward((q, kv, kv.clone()), plan)
    assert torch.equal(q, before)


def test_the_lengths_of_a_checked_batch_major_signature_are_its_own():
    """Two plans of one row count but other lengths: the geometry checked for one is not the
    other's (the contract keys batch-major checks by the lengths too)."""
    spec = _spec(False, kv_heads=4)
    backend = ab.select(spec, device=CPU).backend
    x = torch.randn(2, 4, 4, 16)
    backend.forward((x, x, x), backend.prepare(ab.FMHAParams.from_lengths([4, 4], device=CPU)))
    other = backend.prepare(ab.FMHAParams.from_lengths([3, 5], device=CPU))
    with pytest.raises(PackedQKVError, match="plan of lengths"):
        backend.forward((x, x, x), other)


def test_a_plan_that_rotates_refuses_batch_major_input():
    spec = _spec(True, rope=ab.RopeSpec(theta=10000.0))
    backend = ab.select(spec, device=CPU).backend
    plan = backend.prepare(ab.FMHAParams.from_lengths([6], device=CPU))
    q, k, v = _batch_major(spec, _batch(spec, 1, 6, seed=3), 1, dense=True)
    before = q.clone()
    with pytest.raises(PackedQKVError, match="applies RoPE/logn in place"):
        backend.forward((q, k, v), plan)
    assert torch.equal(q, before)


def test_a_bound_forward_equals_forward_on_every_later_input_of_its_signature():
    spec = _spec(True)
    backend = ab.select(spec, device=CPU).backend
    assert isinstance(backend, PrefillBackend)
    params = ab.FMHAParams.from_lengths([5, 9, 2], device=CPU)
    plan = backend.prepare(params)
    rows = [_batch(spec, 1, 16, seed=s)[:, : spec.q_width + 2 * spec.kv_width] for s in range(3)]

    def separate(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_end, k_end = spec.q_width, spec.q_width + spec.kv_width
        return packed[:, :q_end], packed[:, q_end:k_end], packed[:, k_end:]

    bound = backend.bind_forward(separate(rows[0]), plan)
    assert isinstance(bound, BoundForward)
    for packed in rows:
        out = bound(separate(packed))
        assert out.shape == (16, spec.num_heads, spec.head_dim)
        want = backend.forward(separate(packed), plan)
        assert torch.equal(out.reshape(16, -1), want)
        ref = reference_attention(packed, spec, params)
        assert relative_error(want, ref) < TOLERANCE[spec.dtype]


def test_a_forward_bound_to_an_alignment_takes_the_full_path_for_another():
    """A kernel whose alignment rule reads addresses (flashinfer's, 16 bytes): an input of
    another alignment than the bound one is checked in full, and the rule applies to it."""
    spec = _spec(False, kv_heads=4)
    base = ab.select(spec, device=CPU).backend
    assert isinstance(base, PrefillBackend)
    checked: list[int] = []

    class Aligned(type(base)):  # type: ignore[misc]
        def accepts_rows(self, rows: torch.Tensor) -> bool:
            checked.append(rows.data_ptr() % 64)
            return rows.data_ptr() % 64 == 0

    backend = Aligned(spec, base.binding.platform)
    plan = backend.prepare(ab.FMHAParams.from_lengths([6], device=CPU))
    storage = torch.randn(4 * 6 * 64 + 64)
    start = (-storage.data_ptr() // 4) % 16  # 64-byte aligned start, in float32 elements
    aligned = storage[start : start + 3 * 6 * 64].view(6, 3, 4, 16)
    shifted = storage[start + 4 : start + 4 + 3 * 6 * 64].view(6, 3, 4, 16)
    first = (aligned[:, 0], aligned[:, 1], aligned[:, 2])
    bound = backend.bind_forward(first, plan)
    assert bound is not None
    calls = len(checked)
    bound(first)
    assert len(checked) == calls, "same alignment: no check"
    moved = (shifted[:, 0], shifted[:, 1], shifted[:, 2])
    out = bound(moved)
    assert len(checked) > calls, "another alignment is checked in full"
    assert torch.equal(out.reshape(6, -1), backend.forward(moved, plan))


def test_no_bound_forward_where_every_call_must_take_forward():
    spec = _spec(False, kv_heads=4)
    backend = ab.select(spec, device=CPU).backend
    assert isinstance(backend, PrefillBackend)
    plan = backend.prepare(ab.FMHAParams.from_lengths([4], device=CPU))
    packed = _batch(spec, 1, 4, seed=5)
    assert backend.bind_forward(packed, plan) is None, "the packed buffer: its memo serves it"
    rotating = _spec(False, kv_heads=4, rope=ab.RopeSpec(theta=10000.0))
    rb = ab.select(rotating, device=CPU).backend
    assert isinstance(rb, PrefillBackend)
    q, k, v = torch.randn(4, 64), torch.randn(4, 64), torch.randn(4, 64)
    assert (
        rb.bind_forward((q, k, v), rb.prepare(ab.FMHAParams.from_lengths([4], device=CPU))) is None
    )

    class OwnForward(type(backend)):  # type: ignore[misc]
        def forward(self, qkv: QKVInput, plan: PrefillPlan, **kw: Any) -> torch.Tensor:
            out: torch.Tensor = super().forward(qkv, plan, **kw)
            return out

    own = OwnForward(spec, backend.binding.platform)
    assert (
        own.bind_forward((q, k, v), own.prepare(ab.FMHAParams.from_lengths([4], device=CPU)))
        is None
    )
