"""Separate Q, K, V input: ``forward((q, k, v), plan)`` with ``[rows, H*D]`` or ``[rows, H, D]``
tensors, zero-copy to the kernel, RoPE/logn in place on q and k, named errors for every
mismatch, the input untouched when refused."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

import attn_backends as ab
import attn_backends.errors
import attn_backends.reference

SPEC = ab.AttentionSpec(
    4,
    2,
    16,
    torch.float32,
    causal=True,
    rope=ab.RopeSpec(1e4, 8),
    use_logn_attn=True,
    logn_base=4,
)
LENGTHS = (3, 1, 5)
ROWS = 11


def params():
    return ab.FMHAParams.from_lengths(LENGTHS, device="cpu", padded_rows=ROWS)


def tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randn(ROWS, SPEC.qkv_width, generator=gen)
    q = packed[:, : SPEC.q_width].clone()
    k = packed[:, SPEC.q_width : SPEC.q_width + SPEC.kv_width].clone()
    v = packed[:, SPEC.q_width + SPEC.kv_width :].clone()
    return packed, q, k, v


class _Probe(TorchSdpaBackend):
    """Records the views it is handed."""

    name = "probe"
    seen: ClassVar[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    def attend(self, views, plan):
        self.seen.append((views.q, views.k, views.v))
        return super().attend(views, plan)


@pytest.mark.parametrize("three_d", [False, True])
def test_separate_tensors_match_the_packed_reference_without_a_copy(three_d):
    packed, q, k, v = tensors()
    if three_d:
        q, k, v = q.view(ROWS, 4, 16), k.view(ROWS, 2, 16), v.view(ROWS, 2, 16)
    backend = _Probe.bind(SPEC)
    out = backend.forward((q, k, v), backend.prepare(params()))
    ref = ab.reference_attention(packed, SPEC, params())
    assert ab.reference.relative_error(out, ref) < ab.reference.TOLERANCE[torch.float32]
    seen_q, seen_k, seen_v = _Probe.seen[-1]
    for got, given in ((seen_q, q), (seen_k, k), (seen_v, v)):
        assert got.data_ptr() == given.data_ptr(), "views of the caller's tensors, no copy"
        assert got.shape[0] == sum(LENGTHS)
    # RoPE and logn rotated q and k in place on the valid rows only; v never written.
    assert not torch.equal(q.reshape(ROWS, -1)[:9], packed[:9, : SPEC.q_width])
    assert torch.equal(q.reshape(ROWS, -1)[9:], packed[9:, : SPEC.q_width])
    assert torch.equal(k.reshape(ROWS, -1)[9:], packed[9:, SPEC.q_width : SPEC.q_width + 32])
    assert torch.equal(v.reshape(ROWS, -1), packed[:, SPEC.q_width + 32 :])


def test_strided_separate_tensors_are_served():
    packed, q, k, v = tensors(1)
    wide = torch.zeros(ROWS, SPEC.q_width + 24)
    wide[:, 8 : 8 + SPEC.q_width] = q
    q_view = wide[:, 8 : 8 + SPEC.q_width]  # rows strided: a column slice of a wider buffer
    backend = TorchSdpaBackend.bind(SPEC)
    out = backend.forward((q_view, k, v), backend.prepare(params()))
    assert ab.reference.relative_error(out, ab.reference_attention(packed, SPEC, params())) < 1e-4
    assert torch.equal(wide[:, :8], torch.zeros(ROWS, 8)), "columns beside q untouched"


def _bad(name):
    _, q, k, v = tensors()
    cases = {
        "k without v": ((q, k, None), "a real K but no V"),
        "q shape": ((q[:, :48], k, v), r"q of shape \(11, 48\)"),
        "k dtype": ((q, k.double(), v), "k of dtype float64"),
        "v rows": ((q, k, v[:9]), "v with 9 rows for a plan of 11 rows"),
        "q column stride": ((torch.randn(ROWS, 128)[:, ::2], k, v), "q with strides"),
        "k heads not dense": (
            (q, torch.randn(ROWS, 16, 4).transpose(1, 2)[:, :2], v),
            "k with strides",
        ),
        "v device": ((q, k, v.to("meta")), "v on meta but FMHAParams on cpu"),
        "q is k": ((q, q[:, :32], v), "q and k are the same memory"),
        "q not a tensor": (([1.0], k, v), "q is a list"),
    }
    return cases[name]


@pytest.mark.parametrize(
    "name",
    [
        "k without v",
        "q shape",
        "k dtype",
        "v rows",
        "q column stride",
        "k heads not dense",
        "v device",
        "q is k",
        "q not a tensor",
    ],
)
def test_every_mismatch_is_named_and_nothing_is_written(name):
    given, match = _bad(name)
    before = [t.clone() for t in given if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    backend = TorchSdpaBackend.bind(SPEC)
    with pytest.raises(ab.errors.PackedQKVError, match=match):
        backend.forward(given, backend.prepare(params()))
    after = [t for t in given if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_kernel_failure_after_the_pass_says_q_and_k_were_modified():
    class Failing(TorchSdpaBackend):
        name = "failing"

        def attend(self, views, plan):
            raise RuntimeError("kernel fault")

    _, q, k, v = tensors()
    backend = Failing.bind(SPEC)
    with pytest.raises(ab.errors.BackendFailure, match="kernel fault") as info:
        backend.forward((q, k, v), backend.prepare(params()))
    assert info.value.modified is not None and "rows [0, 9) of q and k" in info.value.modified


def test_a_backend_reading_packed_rows_gets_one_copy():
    class Packed(TorchSdpaBackend):
        name = "packed-reader"
        rows: ClassVar[list[torch.Tensor]] = []

        def attend(self, views, plan):
            self.rows.append(views.packed)
            return super().attend(views, plan)

    packed, q, k, v = tensors(2)
    spec = ab.AttentionSpec(4, 2, 16, torch.float32, causal=False)
    backend = Packed.bind(spec)
    out = backend.forward((q, k, v), backend.prepare(params()))
    assert ab.reference.relative_error(out, ab.reference_attention(packed, spec, params())) < 1e-4
    assert torch.equal(Packed.rows[-1], packed[:9])


def test_graph_mode_takes_the_packed_buffer_only():
    pytest.importorskip("attn_backends_builtin.flashinfer")
    from tests.fakes.fake_flashinfer import install

    mp = pytest.MonkeyPatch()
    try:
        install(mp)
        from attn_backends_builtin import flashinfer as plugin

        mp.setattr(plugin, "device_sm", lambda device: 90)
        spec = ab.AttentionSpec(4, 2, 64, torch.bfloat16, causal=True)
        platform = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))
        backend = ab.select(spec, backend="flashinfer", platform=platform, cuda_graph=True).backend
        assert isinstance(backend, ab.CudaGraphPrefill)
        plan = backend.prepare_graph(ab.GraphBucket(max_tokens=64, max_batch=2), device="cpu")
        plan.update(ab.FMHAParams.from_lengths((5, 9), device="cpu", padded_rows=64))
        q = torch.randn(64, 256).bfloat16()
        k, v = torch.randn(64, 128).bfloat16(), torch.randn(64, 128).bfloat16()
        with pytest.raises(ab.errors.PackedQKVError, match=r"separate .* with a graph plan"):
            backend.forward((q, k, v), plan)
    finally:
        mp.undo()


def test_a_wrong_output_after_the_pass_says_q_and_k_were_modified():
    class WrongShape(TorchSdpaBackend):
        name = "wrong-shape"

        def attend(self, views, plan):
            return torch.zeros(1, 1, 1)

    _, q, k, v = tensors()
    backend = WrongShape.bind(SPEC)
    with pytest.raises(ab.errors.BackendFailure, match="wrong-shape returned") as info:
        backend.forward((q, k, v), backend.prepare(params()))
    assert info.value.modified is not None and "of q and k" in info.value.modified
