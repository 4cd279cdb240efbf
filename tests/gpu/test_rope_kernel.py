"""The native RoPE/logn kernel on a CUDA GPU: it builds, it is the pass the contract picks,
and every variant is the correctly rounded float64 result while V, padding rows and the
columns around a strided slice stay bit-identical. scripts/gpu/rope_kernel.py runs the full
matrix and the bandwidth measurement; this is the regression subset."""

from __future__ import annotations

import math

import pytest
import torch
from attn_backends_builtin._flashinfer_rope import flashinfer_rope_refusal

import attn_backends as ab
from attn_backends._backend._reference import _rotate
from attn_backends._path import _native
from attn_backends._path._preprocess import apply_preprocess
from attn_backends.reference import TOLERANCE, relative_error

pytestmark = pytest.mark.gpu

HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
ATOL = 1e-5
LENGTHS = (1, 17, 1, 300, 0, 45, 1)
PAD = 5
ROPES = {
    "rh": ab.RopeSpec(1e6),
    "il": ab.RopeSpec(1e4, interleaved=True),
    "rh-r64": ab.RopeSpec(1e4, 64),
    "il-r64": ab.RopeSpec(1e4, 64, interleaved=True),
    "rh-r24": ab.RopeSpec(1e4, 24),
    "none": None,
}
LAYOUTS = {"plain": (0, 0), "strided": (24, 8), "misaligned": (3, 1)}


def _spec(dtype, rope, logn):
    return ab.AttentionSpec(
        4, 2, 128, dtype, causal=True, rope=rope, use_logn_attn=logn is not None, logn_base=logn
    )


def _expected(pristine, spec, params):
    tokens = params.token_q_num
    x = pristine[:tokens].to(torch.float64).unflatten(1, (-1, spec.head_dim))
    q, k = x[:, : spec.num_heads], x[:, spec.num_heads : spec.num_heads + spec.num_kv_heads]
    pos = params.positions.to(torch.float64)
    if spec.rope is not None:
        q, k = _rotate(q, pos, spec), _rotate(k, pos, spec)
    if spec.use_logn_attn:
        q = q * (torch.log(pos + 1) / math.log(spec.logn_base)).clamp(min=1)[:, None, None]
    return torch.cat((q, k), dim=1)


def _run(spec, lengths, lead, trail, apply, seed=0):
    """Apply a pass to a fresh buffer: (worst error / rounding bound, relative error, whether
    V, padding rows and the columns around the slice are untouched)."""
    tokens = sum(lengths)
    params = ab.FMHAParams.from_lengths(lengths, device="cuda", padded_rows=tokens + PAD)
    gen = torch.Generator().manual_seed(seed)
    backing = torch.randn(tokens + PAD, lead + spec.qkv_width + trail, generator=gen)
    backing[tokens:] = 1e4
    backing = backing.to("cuda", spec.dtype)
    before = backing.clone()
    packed = backing[:, lead : lead + spec.qkv_width]
    pristine = packed.clone()
    apply(packed, spec, params)
    qk = spec.q_width + spec.kv_width
    ref = _expected(pristine, spec, params)
    out = packed[:tokens, :qk].to(torch.float64).reshape(ref.shape)
    ratio = float(((out - ref).abs() / (HALF_ULP[spec.dtype] * ref.abs() + ATOL)).max())
    untouched = (
        torch.equal(packed[:, qk:], pristine[:, qk:])
        and torch.equal(packed[tokens:], pristine[tokens:])
        and torch.equal(backing[:, :lead], before[:, :lead])
        and torch.equal(backing[:, lead + spec.qkv_width :], before[:, lead + spec.qkv_width :])
    )
    return ratio, relative_error(out, ref), untouched


def _native_pass(packed, spec, params):
    _native.rope_logn_(packed, params.cu_seqlens_q, params.token_q_num, spec)


def _native_separate(lead_q, trail_q, lead_k, trail_k):
    """The separate form of the kernel on Q and K copied into two buffers of their own (other
    offsets and row strides than the packed rows), then written back for the comparison; the
    columns around each slice must stay as they were."""

    def apply(packed, spec, params):
        rows, qk = packed.shape[0], spec.q_width + spec.kv_width
        slices = []
        for cols, lead, trail in (
            (slice(0, spec.q_width), lead_q, trail_q),
            (slice(spec.q_width, qk), lead_k, trail_k),
        ):
            width = cols.stop - cols.start
            backing = torch.full((rows, lead + width + trail), 7.0, dtype=spec.dtype, device="cuda")
            backing[:, lead : lead + width] = packed[:, cols]
            slices.append((cols, backing, backing[:, lead : lead + width], lead, width))
        (_, _, q, _, _), (_, _, k, _, _) = slices
        _native.rope_logn_qk_(q, k, params.cu_seqlens_q, params.token_q_num, spec)
        for cols, backing, view, lead, width in slices:
            assert bool((backing[:, :lead] == 7).all() and (backing[:, lead + width :] == 7).all())
            packed[:, cols] = view

    return apply


@pytest.mark.parametrize(
    "layout", [(0, 0, 0, 0), (8, 16, 24, 0), (3, 1, 0, 5)], ids=["plain", "strided", "misaligned"]
)
@pytest.mark.parametrize(("rope", "logn"), [("rh", None), ("il-r64", 16), ("rh-r24", 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_native_separate_form_is_the_packed_result(dtype, rope, logn, layout):
    spec = _spec(dtype, ROPES[rope], logn)
    ratio, _, untouched = _run(spec, LENGTHS, 0, 0, _native_separate(*layout))
    assert ratio <= 1.0, f"error {ratio:.3f} x the rounding bound"
    assert untouched, "V or padding rows were written"


def test_native_kernel_builds_here():
    assert _native.unavailable_reason() is None


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    ("rope", "logn"),
    [(rope, logn) for rope in sorted(ROPES) for logn in (None, 16) if ROPES[rope] or logn],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_native_pass_is_correctly_rounded(dtype, rope, logn, layout):
    lead, trail = LAYOUTS[layout]
    spec = _spec(dtype, ROPES[rope], logn)
    ratio, _, untouched = _run(spec, LENGTHS, lead, trail, _native_pass)
    assert ratio <= 1.0, f"error {ratio:.3f} x the rounding bound"
    assert untouched, "V, padding rows or columns outside the slice were written"


@pytest.mark.parametrize("theta", [1e4, 1e6])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_native_pass_keeps_accuracy_at_long_positions(dtype, theta):
    spec = ab.AttentionSpec(2, 1, 128, dtype, causal=True, rope=ab.RopeSpec(theta))
    ratio, _, untouched = _run(spec, (32768, 3), 0, 0, _native_pass)
    assert ratio <= 1.0 and untouched


def test_contract_picks_the_native_pass_and_attention_matches():
    spec = ab.AttentionSpec(
        16,
        8,
        128,
        torch.bfloat16,
        causal=True,
        rope=ab.RopeSpec(1e6),
        use_logn_attn=True,
        logn_base=64,
    )
    sel = ab.select(spec, device="cuda", backend="torch-sdpa")
    assert dict(sel.details)["preprocess"] == "native"
    params = ab.FMHAParams.from_lengths((1, 200, 33), device="cuda", padded_rows=240)
    qkv = torch.randn(240, spec.qkv_width, generator=torch.Generator().manual_seed(1))
    qkv = qkv.to("cuda", spec.dtype)
    pristine = qkv.clone()
    plan = sel.backend.prepare(params)
    assert plan.preprocess == "native"
    assert plan.tables is not None, "built once per batch, for a pass that declines a buffer"
    out = sel.backend.forward(qkv, plan)
    err = relative_error(out, ab.reference_attention(pristine, spec, params))
    assert err < TOLERANCE[spec.dtype]


def test_flashinfer_pass_matches_when_installed():
    platform = ab.detect_platform("cuda")
    spec = _spec(torch.bfloat16, ab.RopeSpec(1e6), None)
    refusal = flashinfer_rope_refusal(spec, platform)
    if refusal is not None:
        pytest.skip(f"flashinfer: {refusal}")

    def flashinfer_pass(packed, spec, params):
        apply_preprocess("flashinfer", packed, spec, params, None)

    _, err, untouched = _run(spec, LENGTHS, 24, 8, flashinfer_pass)
    assert untouched
    assert err < 5e-3, "bf16 rounding plus flashinfer's fast pow/sincos"
