"""forward is safe to fail: every check before the first write, a late error says what it
already changed, a plan refuses a buffer it was not made for, the buffer checks are done once
per signature but a changed buffer is checked again, and the canary sees any stray write."""

from __future__ import annotations

import pytest
import torch
from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

import attn_backends as ab
import attn_backends.deploy
import attn_backends.errors
import attn_backends.plugin as abp
import attn_backends.reference
from attn_backends._path import _contract

ROPE = ab.AttentionSpec(4, 2, 16, torch.float32, causal=True, rope=ab.RopeSpec(1e4, 8))
PLAIN = ab.AttentionSpec(4, 2, 16, torch.float32, causal=True)
LENGTHS = (3, 1, 5)


def qkv_for(spec, params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(params.rows, spec.qkv_width, generator=gen).to(spec.dtype)


def params_of(lengths=LENGTHS, pad=2):
    return ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=sum(lengths) + pad)


class _Failing(TorchSdpaBackend):
    """Fails inside the kernel call with the exception it is given."""

    name = "failing-probe"
    error: Exception = RuntimeError("kernel fault")

    def attend(self, views, plan):
        raise self.error


@pytest.mark.parametrize("spec", [ROPE, PLAIN], ids=["rope", "no-rope"])
def test_a_kernel_failure_says_whether_the_input_was_modified(spec):
    params = params_of()
    backend = _Failing.bind(spec)
    qkv = qkv_for(spec, params)
    pristine = qkv.clone()
    with pytest.raises(ab.errors.BackendFailure, match="kernel fault") as info:
        backend.forward(qkv, backend.prepare(params))
    if spec.rope is None:
        assert info.value.modified is None
        assert torch.equal(qkv, pristine)
    else:
        note = info.value.modified
        assert note is not None and "WAS MODIFIED" in note and "columns [0, 96)" in note
        assert "rows [0, 9)" in note and "Recompute the QKV projection" in note
        assert "WAS MODIFIED" in str(info.value)
        assert not torch.equal(qkv[:9, :96], pristine[:9, :96]), "the note tells the truth"
        assert torch.equal(qkv[:, 96:], pristine[:, 96:]) and torch.equal(qkv[9:], pristine[9:])


def test_a_library_error_after_the_pass_keeps_its_type_and_gains_the_note():
    params = params_of()
    backend = _Failing.bind(ROPE)
    backend.error = ab.errors.ParamsError("stale metadata")
    with pytest.raises(ab.errors.ParamsError, match=r"stale metadata.*WAS MODIFIED") as info:
        backend.forward(qkv_for(ROPE, params), backend.prepare(params))
    assert info.value.modified is not None


def test_a_failing_rope_pass_says_the_input_may_have_changed(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(_contract, "run_rope_pass", broken)
    params = params_of()
    backend = TorchSdpaBackend.bind(ROPE)
    with pytest.raises(ab.errors.BackendFailure, match="MAY HAVE BEEN MODIFIED") as info:
        backend.forward(qkv_for(ROPE, params), backend.prepare(params))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_inference_tensor_outside_inference_mode_is_refused_untouched():
    params = params_of()
    backend = TorchSdpaBackend.bind(ROPE)
    plan = backend.prepare(params)
    with torch.inference_mode():
        qkv = qkv_for(ROPE, params)
    pristine = qkv.clone()
    with pytest.raises(ab.errors.PackedQKVError, match=r"made under torch\.inference_mode"):
        backend.forward(qkv, plan)
    assert torch.equal(qkv, pristine)
    with torch.inference_mode():
        out = backend.forward(qkv, plan)
    ref = ab.reference_attention(pristine, ROPE, params)
    assert ab.reference.relative_error(out, ref) < ab.reference.TOLERANCE[ROPE.dtype]


def test_a_buffer_needing_grad_is_refused_untouched():
    params = params_of()
    backend = TorchSdpaBackend.bind(ROPE)
    qkv = qkv_for(ROPE, params).requires_grad_()
    pristine = qkv.detach().clone()
    with pytest.raises(ab.errors.PackedQKVError, match="requires grad"):
        backend.forward(qkv, backend.prepare(params))
    assert torch.equal(qkv.detach(), pristine)


@pytest.mark.parametrize(
    ("planned", "pad", "given_rows", "match"),
    [
        ((5, 4), 0, 12, "12 rows for a plan of 9 rows"),
        ((3,), 0, 9, "9 rows for a plan of 3 rows"),
        ((3, 1, 5), 2, 9, "9 rows for a plan of 11 rows"),
    ],
)
def test_a_plan_refuses_a_buffer_of_other_rows(planned, pad, given_rows, match):
    params = params_of(planned, pad)
    backend = TorchSdpaBackend.bind(ROPE)
    plan = backend.prepare(params)
    qkv = torch.randn(given_rows, ROPE.qkv_width)
    pristine = qkv.clone()
    with pytest.raises(ab.errors.PackedQKVError, match=match):
        backend.forward(qkv, plan)
    assert torch.equal(qkv, pristine)


@pytest.fixture
def checked_buffers(monkeypatch) -> list[int]:
    """Addresses of the buffers `check_packed` examined, in order."""
    calls: list[int] = []
    real = _contract.check_packed

    def counting(packed, spec, params):
        calls.append(packed.data_ptr())
        return real(packed, spec, params)

    monkeypatch.setattr(_contract, "check_packed", counting)
    return calls


def test_buffer_checks_run_once_per_signature_and_again_for_a_changed_buffer(checked_buffers):
    calls = checked_buffers
    params = params_of()
    backend = TorchSdpaBackend.bind(PLAIN)
    plan = backend.prepare(params)
    qkv = qkv_for(PLAIN, params)
    for _ in range(5):
        backend.forward(qkv, plan)
    assert len(calls) == 1, "same plan, same buffer: checked once"
    other = qkv.clone()
    backend.forward(other, plan)
    assert len(calls) == 2, "another buffer is checked"
    backend.forward(other, plan)
    assert len(calls) == 2
    # Same address, other geometry: rows that overlap in memory are refused again.
    overlapping = qkv.as_strided(qkv.shape, (PLAIN.qkv_width - 16, 1))
    with pytest.raises(ab.errors.PackedQKVError, match="rows overlap"):
        backend.forward(overlapping, plan)
    # Same address and shape, another dtype: refused, not served from the memo.
    as_int = qkv.view(torch.int32)
    with pytest.raises(ab.errors.PackedQKVError, match="dtype int32"):
        backend.forward(as_int, plan)
    # A second plan keeps its own memo.
    plan2 = backend.prepare(params)
    backend.forward(qkv, plan2)
    assert len(calls) == 5


def test_a_layer_loop_rotating_through_buffers_is_checked_once_per_buffer(checked_buffers):
    """An engine's caching allocator hands each layer one of a few blocks in turn: every one
    of them is remembered, and one past `MEMO_SLOTS` pushes out the oldest."""
    calls = checked_buffers
    params = params_of()
    backend = TorchSdpaBackend.bind(PLAIN)
    plan = backend.prepare(params)
    buffers = [qkv_for(PLAIN, params) for _ in range(3)]
    for _layer in range(4):
        for qkv in buffers:
            backend.forward(qkv, plan)
    assert len(calls) == 3, "three buffers in turn: each checked once"
    assert len(plan.memo) == 3

    many = [qkv_for(PLAIN, params) for _ in range(_contract.MEMO_SLOTS)]
    for qkv in many:
        backend.forward(qkv, plan)
    assert len(plan.memo) == _contract.MEMO_SLOTS
    checked = len(calls)
    backend.forward(many[-1], plan)
    assert len(calls) == checked, "a recent buffer is still remembered"
    backend.forward(buffers[0], plan)
    assert len(calls) == checked + 1, "the oldest was dropped and is checked again"


class _WritesV(TorchSdpaBackend):
    name = "writes-v"

    def attend(self, views, plan):
        out = super().attend(views, plan)
        views.v.mul_(1.0)
        views.v[0, 0, 0] += 1.0
        return out


class _WritesUnrotatedK(TorchSdpaBackend):
    name = "writes-k"

    def attend(self, views, plan):
        out = super().attend(views, plan)
        views.k[0, 0, -1] += 1.0  # past rotary_dim: RoPE never touches it
        return out


class _WritesQ(TorchSdpaBackend):
    name = "writes-q"

    def attend(self, views, plan):
        out = super().attend(views, plan)
        views.q[1, 0, 0] += 1.0
        return out


@pytest.mark.parametrize(
    ("backend", "spec", "match"),
    [
        (_WritesV, ROPE, "wrote the V columns"),
        (_WritesUnrotatedK, ROPE, "wrote K columns outside the rotated dims"),
        (_WritesQ, PLAIN, "wrote the Q columns"),
    ],
)
def test_the_canary_sees_a_write_outside_the_rotated_columns(backend, spec, match):
    result = ab.deploy.run_canary(backend.bind(spec), spec, "cpu")
    assert result.status == "failed" and match in result.detail, result.detail
    honest = ab.deploy.run_canary(TorchSdpaBackend.bind(spec), spec, "cpu")
    assert honest.status == "passed", honest.detail


def test_fp8_with_rope_is_refused_unless_the_backend_rotates_before_quantising():
    fp8 = ab.AttentionSpec(4, 4, 128, torch.float8_e4m3fn, causal=True, rope=ab.RopeSpec(1e4))
    caps = abp.Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({fp8.dtype}))
    reasons = abp.check_capabilities(caps, fp8, ab.parse_platform("cpu"))
    fp8_reasons = [r for r in reasons if r.code is ab.ReasonCode.FP8]
    assert fp8_reasons and "before quantising" in fp8_reasons[0].message
    declared = abp.Capabilities(
        platforms=frozenset({"cpu"}),
        dtypes=frozenset({fp8.dtype}),
        features=(abp.Fp8Support(preprocess=True),),
    )
    assert not abp.check_capabilities(declared, fp8, ab.parse_platform("cpu"))
    no_rope = ab.AttentionSpec(4, 4, 128, torch.float8_e4m3fn, causal=True)
    assert not abp.check_capabilities(caps, no_rope, ab.parse_platform("cpu"))


def test_a_device_named_without_index_is_the_one_tensors_report(monkeypatch):
    """Tensors on "cuda" report "cuda:N"; comparisons resolve the name first (the canary once
    failed every backend on `check --device cuda` for comparing the two)."""
    from attn_backends._values._platform import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed("cuda") == torch.device("cuda", 1)
    assert indexed(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert indexed("cpu") == torch.device("cpu")
