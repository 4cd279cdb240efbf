"""What the conformance suite does not check on an NVIDIA GPU: ``forward`` allocates only its
output and never syncs the host, the kernel flashinfer really runs, batches longer than the
suite's, headwise's compiled block mask, and torch-varlen (torch's own flash kernel) on long
batches with windows and on what it allocates.

Every shape here uses a flashinfer JIT module that benchmarks/gpu/prebuild.py builds (bf16/fp16,
head dims 64 and 128), so nothing compiles for minutes inside a test.
"""

from __future__ import annotations

import pytest
import torch
from attn_backends_builtin import _flex_kernel, headwise
from attn_backends_builtin._flashinfer_direct import DirectRun
from attn_backends_builtin.flashinfer import FlashinferRopeBackend, RaggedPlan
from attn_backends_builtin.torch_varlen import VarlenCall

import attn_backends as ab
from attn_backends.reference import TOLERANCE, relative_error

pytestmark = pytest.mark.gpu

HW = ab.HeadwiseConfig(frozenset({0, 5}), sink_token_num=4, swa_token_num=96, seqlen_threshold=256)
SPECS = {
    "flashinfer": ab.AttentionSpec(16, 8, 128, torch.bfloat16, causal=True),
    "flashinfer-rope": ab.AttentionSpec(16, 8, 128, torch.bfloat16, True, rope=ab.RopeSpec(1e6)),
    "trt": ab.AttentionSpec(12, 12, 64, torch.bfloat16, causal=False),
    "headwise": ab.AttentionSpec(8, 2, 128, torch.bfloat16, True, headwise=HW),
    "torch-varlen": ab.AttentionSpec(16, 8, 128, torch.bfloat16, causal=True),
    "fa4": ab.AttentionSpec(16, 8, 128, torch.bfloat16, causal=True),
}
LENGTHS = (300, 77, 1, 512, 40)


def _batch(spec: ab.AttentionSpec, lengths: tuple[int, ...], seed: int = 0, pad: int = 5):
    tokens = sum(lengths)
    params = ab.FMHAParams.from_lengths(lengths, device="cuda", padded_rows=tokens + pad)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(tokens + pad, spec.qkv_width, device="cuda", generator=gen).to(spec.dtype)
    return params, qkv


def _check(out: torch.Tensor, pristine: torch.Tensor, spec, params) -> float:
    ref = ab.reference_attention(pristine, spec, params)
    err = relative_error(out, ref)
    assert err < TOLERANCE[spec.dtype], f"relative error {err:.3g}"
    return err


def _ready(name: str, lengths: tuple[int, ...] = LENGTHS):
    """Backend, plan and input for ``name``, after one checked forward (kernels loaded)."""
    spec = SPECS[name]
    backend = ab.select(spec, backend=name, device="cuda").backend
    params, qkv = _batch(spec, lengths)
    plan = backend.prepare(params)
    _check(backend.forward(qkv.clone(), plan), qkv, spec, params)
    torch.cuda.synchronize()
    return spec, backend, params, plan, qkv


def _forward_bytes(backend, plan, qkv, *, no_sync: bool = False) -> tuple[torch.Tensor, int, int]:
    """``forward``'s output and the bytes it kept and peaked at (``no_sync``: a host sync
    inside it raises). Requested bytes, not memory_allocated(): block counters include the rest
    of a cached block the allocator hands out unsplit (remainder under 1 MiB), which forward did
    not ask for."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = backend.forward(qkv, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    grown = stats["requested_bytes.all.current"] - before
    return out, grown, stats["requested_bytes.all.peak"] - before


@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-rope", "trt"])
def test_forward_allocates_only_the_output(name):
    spec, backend, params, plan, qkv = _ready(name)
    out, grown, peak = _forward_bytes(backend, plan, qkv.clone())
    nbytes = out.untyped_storage().nbytes()
    assert nbytes == params.token_q_num * spec.q_width * out.element_size()
    assert grown == nbytes and peak == nbytes, (grown, peak, nbytes)
    _check(out, qkv, spec, params)


@pytest.mark.parametrize(
    "name", ["flashinfer", "flashinfer-rope", "trt", "headwise", "torch-varlen", "fa4"]
)
def test_forward_does_not_sync_the_host(name):
    spec, backend, params, plan, qkv = _ready(name)
    buf = qkv.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = backend.forward(buf, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check(out, qkv, spec, params)


def _assert_runs(plan, kernel: str) -> None:
    assert isinstance(plan.kernel, RaggedPlan)
    assert plan.kernel.choice.backend == kernel
    # flashinfer's wrapper keeps the implementation it runs in ``_backend`` (private; read here
    # only to prove the explicit choice was honoured).
    assert plan.kernel.wrapper._backend == kernel


@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-rope"])
def test_flashinfer_calls_its_kernel_directly_once_proved(name):
    """The first call of a kernel module ran ``run`` and the direct ``ragged_run`` call and
    found them equal (`_flashinfer_direct`); a later plan calls ``ragged_run`` with the list it
    fixed: bit for bit ``run``'s output on a fresh input, within the float64 reference's
    tolerance, no host sync. Short sequences, so flashinfer-rope fuses its RoPE."""
    spec, backend, params, _, _ = _ready(name, (200, 77, 1, 40))
    params, qkv = _batch(spec, (150, 3, 64), seed=1)
    plan = backend.prepare(params)
    kernel = plan.kernel
    assert isinstance(kernel, RaggedPlan) and isinstance(kernel.run, DirectRun), kernel.run
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = backend.forward(qkv.clone(), plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check(out, qkv, spec, params)
    rows = qkv[: params.token_q_num]
    q, k, v = rows.split((spec.q_width, spec.kv_width, spec.kv_width), dim=1)
    heads = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
    q, k, v = (t.unflatten(1, (h, spec.head_dim)) for t, h in zip((q, k, v), heads, strict=True))
    expected = kernel.wrapper.run(q, k, v)  # [tokens, Hq, D]; forward's rows are [tokens, Hq * D]
    assert torch.equal(out.view(expected.shape), expected)


def test_flashinfer_runs_the_kernel_the_record_names():
    major, minor = torch.cuda.get_device_capability()
    expected = "fa3" if (major, minor) == (9, 0) else "fa2"
    selection = ab.select(SPECS["flashinfer"], backend="flashinfer", device="cuda")
    assert dict(selection.details)["flashinfer_backend"] == expected
    _assert_runs(_ready("flashinfer")[3], expected)

    # flashinfer-rope decides per batch: fused RoPE (fa2 only) up to the limit, else the
    # separate RoPE pass and the plain kernel.
    limit = FlashinferRopeBackend.capabilities.fused_rope_max_seqlen
    assert limit is not None
    selection = ab.select(SPECS["flashinfer-rope"], backend="flashinfer-rope", device="cuda")
    record = dict(selection.details)["flashinfer_backend"]
    assert record == f"fa2 for batches of max_seqlen <= {limit}, else {expected}"
    short = (limit, 77, 1, 40)
    assert max(short) <= limit
    plan = _ready("flashinfer-rope", short)[3]
    assert plan.preprocess == "fused"
    _assert_runs(plan, "fa2")
    plan = _ready("flashinfer-rope", (limit + 1, 40))[3]
    assert plan.preprocess != "fused"
    _assert_runs(plan, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("name", "spec", "lengths"),
    [
        ("flashinfer", ab.AttentionSpec(16, 8, 128, torch.bfloat16, True), (2048, 1500, 64, 700)),
        (
            "flashinfer-rope",
            ab.AttentionSpec(16, 8, 128, torch.bfloat16, True, rope=ab.RopeSpec(1e6)),
            (2048, 1500, 64, 700),
        ),
        ("trt", ab.AttentionSpec(12, 12, 64, torch.bfloat16, False), (512,) * 8),
        ("trt", ab.AttentionSpec(16, 16, 128, torch.bfloat16, True), (1024, 333, 17)),
    ],
)
def test_long_sequences(name, spec, lengths, dtype):
    """Sequences past the suite's 345 tokens: many tiles, split KV, the benchmark's shapes."""
    spec = ab.AttentionSpec(
        spec.num_heads, spec.num_kv_heads, spec.head_dim, dtype, spec.causal, rope=spec.rope
    )
    backend = ab.select(spec, backend=name, device="cuda").backend
    params, qkv = _batch(spec, lengths, seed=1)
    _check(backend.forward(qkv.clone(), backend.prepare(params)), qkv, spec, params)


def test_headwise_compiled_block_mask_and_kernel(monkeypatch):
    """Long sequences build the block mask with a compiled kernel; the flex kernel is compiled;
    nothing fell back to eager."""
    monkeypatch.setattr(_flex_kernel, "EAGER_MASK_LIMIT", 0)
    spec = SPECS["headwise"]
    backend = headwise.HeadwiseBackend.bind(spec)
    params, qkv = _batch(spec, (1500, 700, 40, 255, 256), seed=2)
    plan = backend.prepare(params)
    assert isinstance(plan.kernel, headwise.HeadwisePlan)
    assert plan.kernel.windowed_sequences == 3
    _check(backend.forward(qkv.clone(), plan), qkv, spec, params)
    assert headwise.COMPILE_STATE.failures == 0, headwise.COMPILE_STATE.last_error


SEPARATE_SPEC = ab.AttentionSpec(16, 8, 128, torch.bfloat16, True, rope=ab.RopeSpec(1e6))


def _separate_views(qkv: torch.Tensor, spec: ab.AttentionSpec):
    """Disjoint column views of one buffer, as a model with separate projections would hand
    them over (rows strided, heads dense within a row)."""
    q_w, kv_w = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return qkv[:, :q_w], qkv[:, q_w : q_w + kv_w], qkv[:, q_w + kv_w :]


@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-rope"])
def test_separate_qkv_allocates_only_the_output_and_never_syncs(name):
    """Separate (q, k, v) on a plan whose packed pass is the native kernel (flashinfer) or
    flashinfer's own RoPE (flashinfer-rope): the plan's tables are built in ``prepare``, so a
    layer neither copies tables to the device (a host sync) nor allocates more than its
    output."""
    spec = SEPARATE_SPEC
    backend = ab.select(spec, backend=name, device="cuda").backend
    params, qkv = _batch(spec, LENGTHS)
    plan = backend.prepare(params)
    out = backend.forward(_separate_views(qkv.clone(), spec), plan)  # kernels loaded
    _check(out, qkv, spec, params)
    del out  # freed now, not while the measured forward's output replaces it
    views = _separate_views(qkv.clone(), spec)
    out, grown, peak = _forward_bytes(backend, plan, views, no_sync=True)
    nbytes = params.token_q_num * spec.q_width * out.element_size()
    _check(out, qkv, spec, params)
    assert grown == nbytes, f"kept {grown} bytes, the output is {nbytes}"
    assert peak == nbytes, f"peak {peak} bytes during forward, the output is {nbytes}"


def _strided_batch(spec: ab.AttentionSpec, lengths: tuple[int, ...], seed: int, pad: int = 5):
    """Packed rows as a column slice of a wider buffer (row stride past the QKV width, 16-byte
    aligned), with ``pad`` padding rows."""
    tokens = sum(lengths)
    params = ab.FMHAParams.from_lengths(lengths, device="cuda", padded_rows=tokens + pad)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(tokens + pad, spec.qkv_width + 16, device="cuda", generator=gen)
    return params, wide.to(spec.dtype)[:, 8 : 8 + spec.qkv_width]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "dim", "causal", "window"),
    [
        ((16, 8), 128, True, None),
        ((12, 12), 64, False, None),
        ((8, 2), 96, False, ab.SlidingWindow(64, 64)),
        ((8, 2), 256, True, ab.SlidingWindow.causal(128)),
        ((16, 16), 80, False, ab.SlidingWindow(0, 31)),
        ((8, 1), 128, False, ab.SlidingWindow(2**31 - 1, 5)),
    ],
    ids=["gqa-causal", "mha-bidir", "window-both", "window-causal", "window-right", "widest"],
)
@pytest.mark.parametrize(
    "lengths", [(1500, 77, 1, 512, 40), (1,), (1, 0, 1, 1)], ids=["long", "one", "ones"]
)
def test_torch_varlen_numbers(heads, dim, causal, window, lengths, dtype):
    """torch's flash kernel on strided views against the float64 reference: varlen batches
    longer than the suite's (many tiles), single-token batches (the kernel's own GQA path for
    one query per sequence), padding rows, windows both sides, GQA (native or expanded)."""
    spec = ab.AttentionSpec(heads[0], heads[1], dim, dtype, causal, window=window)
    sel = ab.select(spec, backend="torch-varlen", device="cuda")
    params, qkv = _strided_batch(spec, lengths, seed=3)
    pristine = qkv.clone()
    out = sel.backend.forward(qkv, sel.backend.prepare(params))
    _check(out, pristine, spec, params)
    assert torch.equal(qkv, pristine), "the input was written"


def test_torch_varlen_allocates_the_output_and_the_kernel_scratch_only():
    """Kept: the output only. Peak: the output, the kernel's float32 log-sum-exp and its two
    rng-state tensors, plus a copy of K and V where this torch's varlen_attn has no
    enable_gqa (the decision record says so)."""
    spec, backend, params, plan, qkv = _ready("torch-varlen")
    call = backend.binding.variant
    assert isinstance(call, VarlenCall)
    out, grown, peak = _forward_bytes(backend, plan, qkv.clone())
    tokens = params.token_q_num
    nbytes = tokens * spec.q_width * out.element_size()
    lse = spec.num_heads * tokens * 4
    expanded = 2 * nbytes if call.kv_repeat > 1 else 0
    assert grown == nbytes, f"kept {grown} bytes, the output is {nbytes}"
    assert nbytes + lse <= peak <= nbytes + lse + expanded + 64, (peak, nbytes, lse, expanded)
    _check(out, qkv, spec, params)
