"""``aiter-asm`` and ``aiter-nonasm`` on CPU, through a fake ``aiter`` per release generation.

What is checked, against every generation of aiter's parameter lists from 0.1.7 to 0.1.20.post1
(`tests.aiter_signatures`): each backend calls exactly one aiter function, all by keyword, with
views trimmed to the valid tokens (no copies), int32 ``cu_seqlens`` on Q's device, the spec's
causal flag and softmax scale, ``sink_size=0`` where the release requires it; FP8 goes to the
FP8 entry point with float32 ``[1]`` descale tensors where it takes them and with the scales
folded where it does not; the output is ``[token_q_num, Hq * D]`` and matches the float64
reference. ``aiter-nonasm`` passes a spec's window, soft-cap and ALiBi slopes to the CK op,
whose fake computes them as CK's source describes. A parameter list the backends do not know is
refused at ``prepare``. The conformance suite then runs through both backends on each
generation.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from attn_backends_builtin import _aiter_binding, _aiter_common, _aiter_signature
from attn_backends_builtin import aiter as aiter_plugin

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends._select._ranking import ranked
from attn_backends.deploy import get_registry
from attn_backends.errors import BackendFailure
from attn_backends.reference import TOLERANCE, relative_error
from attn_backends.testing import NoCachePrefillConformance
from tests.aiter_signatures import ENTRY_POINTS, NEWEST, OLDEST, RELEASES, Release
from tests.fakes import fake_aiter
from tests.fakes.fake_aiter import FakeAiter, install, stub_of

AITER = (("aiter", "fake"),)
GFX942 = ab.Platform(kind="rocm", arch="gfx942", libraries=AITER)
GFX950 = ab.Platform(kind="rocm", arch="gfx950", libraries=AITER)
GFX90A = ab.Platform(kind="rocm", arch="gfx90a", libraries=AITER)
LENGTHS = (5, 17, 1, 32)
FP8_ENTRY = "flash_attn_varlen_fp8_pertensor_func"
BATCH = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
OP_SETTINGS = (
    "min_seqlen_q",
    "dropout_p",
    "logits_soft_cap",
    "zero_tensors",
    "window_size_left",
    "window_size_right",
    "return_softmax_lse",
    "return_dropout_randval",
    "alibi_slopes",
)


def spec_of(dtype=torch.bfloat16, *, heads=8, kv_heads=2, dim=128, causal=True, **kw):
    return ab.AttentionSpec(heads, kv_heads, dim, dtype, causal=causal, **kw)


def declares(release: Release, entry: str, parameter: str) -> bool:
    return parameter in inspect.signature(stub_of(release, entry)).parameters


class Run:
    """One forward through a backend: its inputs, output and the float64 reference."""

    def __init__(
        self,
        backend: str,
        spec: ab.AttentionSpec,
        platform: ab.Platform,
        *,
        lengths=LENGTHS,
        padding=7,
        strided=False,
        scales: tuple[float, float, float] | None = None,
        host_scales=False,
        seed=0,
    ):
        self.spec = spec
        self.params = ab.FMHAParams.from_lengths(
            lengths, device="cpu", padded_rows=sum(lengths) + padding
        )
        extra = 16 if strided else 0
        gen = torch.Generator().manual_seed(seed)
        real = torch.randn(self.params.rows, spec.qkv_width + 2 * extra, generator=gen)
        self.fp8_scales = None
        if scales is not None:
            bounds = (0, spec.q_width, spec.q_width + spec.kv_width, spec.qkv_width)
            for (lo, hi), s in zip(itertools.pairwise(bounds), scales, strict=True):
                real[:, extra + lo : extra + hi] /= s
            if host_scales:
                self.fp8_scales = ab.Fp8Scales(*scales)
            else:
                self.fp8_scales = ab.Fp8Scales(*(torch.tensor(s) for s in scales))
        backing = real.to(spec.dtype)
        self.packed = backing[:, extra : extra + spec.qkv_width] if extra else backing
        self.pristine = self.packed.clone()
        selection = ab.select(spec, backend=backend, platform=platform)
        self.backend = selection.backend
        self.plan = selection.backend.prepare(self.params)
        self.out = selection.backend.forward(self.packed, self.plan, fp8_scales=self.fp8_scales)

    @property
    def binding(self) -> _aiter_binding.EntryBinding:
        kernel = self.plan.kernel
        assert isinstance(kernel, _aiter_common.AiterPlan)
        return kernel.binding

    def error(self) -> float:
        ref = ab.reference_attention(
            self.pristine, self.spec, self.params, fp8_scales=self.fp8_scales
        )
        return relative_error(self.out, ref)


def assert_views_of_packed(run: Run, args: dict[str, object]) -> None:
    """Q, K, V are the packed buffer's own memory, trimmed to the valid tokens: no copy."""
    spec, packed, params = run.spec, run.packed, run.params
    q, k, v = args["q"], args["k"], args["v"]
    assert (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    )
    size = packed.element_size()
    assert q.shape == (params.token_q_num, spec.num_heads, spec.head_dim)
    assert k.shape == v.shape == (params.token_kv_num, spec.num_kv_heads, spec.head_dim)
    assert q.data_ptr() == packed.data_ptr()
    assert k.data_ptr() == packed.data_ptr() + spec.q_width * size
    assert v.data_ptr() == packed.data_ptr() + (spec.q_width + spec.kv_width) * size
    for t in (q, k, v):
        assert t.stride() == (packed.stride(0), spec.head_dim, 1)
        assert t.device == packed.device


def assert_batch_args(run: Run, args: dict[str, object]) -> None:
    params = run.params
    for name, expected in (
        ("cu_seqlens_q", params.cu_seqlens_q),
        ("cu_seqlens_k", params.cu_seqlens_k),
    ):
        cu = args[name]
        assert isinstance(cu, torch.Tensor)
        assert cu is expected, f"{name} must be the FMHAParams tensor, not a copy"
        assert cu.dtype == torch.int32 and cu.is_contiguous()
        assert cu.device == run.packed.device
    assert args["max_seqlen_q"] == params.max_seqlen_q == max(params.input_lengths)
    assert args["max_seqlen_k"] == params.max_seqlen_k
    assert type(args["max_seqlen_q"]) is int and type(args["max_seqlen_k"]) is int


@pytest.fixture(params=RELEASES, ids=str)
def release(request):
    return request.param


@pytest.fixture
def fake(monkeypatch, release):
    return install(monkeypatch, "gfx942", release=release)


# Registration, lazy import, declared capabilities.


def test_one_plugin_registers_both_backends():
    registry = get_registry()
    for name in ("aiter-asm", "aiter-nonasm"):
        entry = registry.get(name)
        assert entry is not None and entry.plugin == "aiter"
    record = next(r for r in registry.records() if r.name == "aiter")
    assert record.status == "loaded" and set(record.backends) == {"aiter-asm", "aiter-nonasm"}


def test_aiter_is_imported_only_by_prepare_and_failures_are_named(monkeypatch):
    fake_aiter.install_failing_import(monkeypatch)
    importlib.reload(_aiter_common)
    module = importlib.reload(aiter_plugin)
    spec = spec_of()
    backend = module.AiterAsmBackend.bind(spec, GFX942)
    assert backend.supports(spec, GFX942) == []
    assert "aiter" not in sys.modules
    params = ab.FMHAParams.from_lengths([3], device="cpu")
    with pytest.raises(BackendFailure, match=r"cannot import aiter \(RuntimeError: ROCm") as info:
        backend.prepare(params)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_declared_capabilities():
    asm = aiter_plugin.AiterAsmBackend.capabilities
    assert asm.platforms == {"rocm"} and asm.rocm_archs == frozenset({"gfx942", "gfx950"})
    assert asm.dtypes == {torch.bfloat16} and asm.head_dims == frozenset({128}) and not asm.fp8
    ck = aiter_plugin.AiterNonAsmBackend.capabilities
    assert ck.platforms == {"rocm"} and ck.rocm_archs == frozenset({"gfx90a", "gfx942", "gfx950"})
    assert ck.dtypes == {
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fnuz,
        torch.float8_e4m3fn,
    }
    assert ck.head_dims == frozenset(range(8, 257, 8)) and ck.fp8
    assert ck.features == (
        abp.WindowSupport(right=True),
        abp.SoftcapSupport(),
        abp.AlibiSupport(bidirectional=True, custom_slopes=True, with_softcap=False),
    ), "CK's order of ALiBi and the soft-cap is not documented: not both on one spec"
    assert asm.features == (), "no ASM kernel has windows, soft-capping or ALiBi"
    for caps in (asm, ck):
        assert caps.gqa and caps.causal and caps.bidirectional
        assert not caps.needs_contiguous and caps.requires == ("aiter",)
        assert not caps.fp8_preprocess and not caps.cuda_graph
    rocm = ab.parse_platform("rocm:gfx942")
    line = [p.entry.name for p in ranked(spec_of(), rocm, get_registry().snapshot().entries)]
    asm_at, ck_at = line.index("aiter-asm"), line.index("aiter-nonasm")
    assert (asm_at, ck_at) == (0, 1), "ASM kernels first, then CK, on ROCm"
    assert line.index("torch-sdpa") > ck_at


def test_fp8_with_rope_is_refused_since_aiter_quantises_before_rotating():
    rope = ab.RopeSpec(theta=10000.0)
    spec = spec_of(torch.float8_e4m3fnuz, rope=rope)
    reasons = aiter_plugin.AiterNonAsmBackend.supports(spec, GFX942)
    assert ab.ReasonCode.FP8 in {r.code for r in reasons}, reasons
    assert "Fp8Support(preprocess=True)" in " ".join(r.message for r in reasons)


@pytest.mark.parametrize(
    ("backend", "spec", "platform", "code"),
    [
        ("asm", spec_of(torch.float16), GFX942, ab.ReasonCode.DTYPE),
        ("asm", spec_of(dim=64), GFX942, ab.ReasonCode.HEAD_DIM),
        ("asm", spec_of(dim=192), GFX950, ab.ReasonCode.HEAD_DIM),
        ("asm", spec_of(), GFX90A, ab.ReasonCode.ARCH),
        ("asm", spec_of(), ab.parse_platform("cuda:sm90"), ab.ReasonCode.PLATFORM),
        ("asm", spec_of(torch.float8_e4m3fnuz), GFX942, ab.ReasonCode.FP8),
        ("ck", spec_of(torch.float32), GFX942, ab.ReasonCode.DTYPE),
        ("ck", spec_of(torch.float16, dim=36), GFX942, ab.ReasonCode.HEAD_DIM),
        ("ck", spec_of(torch.float16, dim=264), GFX942, ab.ReasonCode.HEAD_DIM),
        (
            "ck",
            spec_of(),
            ab.Platform(kind="rocm", arch="gfx1100", libraries=AITER),
            ab.ReasonCode.ARCH,
        ),
        ("ck", spec_of(torch.float8_e4m3fn), GFX942, ab.ReasonCode.FP8),
        ("ck", spec_of(torch.float8_e4m3fnuz), GFX950, ab.ReasonCode.FP8),
        ("ck", spec_of(torch.float8_e4m3fnuz), GFX90A, ab.ReasonCode.FP8),
        ("ck", spec_of(torch.float8_e4m3fnuz, dim=64), GFX942, ab.ReasonCode.HEAD_DIM),
        ("ck", spec_of(torch.float8_e5m2), GFX942, ab.ReasonCode.FP8),
    ],
)
def test_refusals_name_their_reason(backend, spec, platform, code):
    impl = aiter_plugin.AiterAsmBackend if backend == "asm" else aiter_plugin.AiterNonAsmBackend
    reasons = impl.supports(spec, platform)
    assert code in {r.code for r in reasons}, reasons
    assert all(r.message for r in reasons)


@pytest.mark.parametrize(
    ("backend", "spec", "platform"),
    [
        ("asm", spec_of(causal=True), GFX942),
        ("asm", spec_of(causal=False, kv_heads=8), GFX950),
        ("ck", spec_of(torch.float16, dim=64, causal=False), GFX90A),
        ("ck", spec_of(torch.float16, dim=80), GFX942),
        ("ck", spec_of(dim=256), GFX950),
        ("ck", spec_of(torch.float8_e4m3fnuz), GFX942),
        ("ck", spec_of(torch.float8_e4m3fn, causal=False), GFX950),
    ],
)
def test_declared_requests_are_accepted(backend, spec, platform):
    impl = aiter_plugin.AiterAsmBackend if backend == "asm" else aiter_plugin.AiterNonAsmBackend
    assert impl.supports(spec, platform) == []


def test_asm_refuses_gfx942_parts_aiter_ships_no_kernels_for(monkeypatch):
    backend = aiter_plugin.AiterAsmBackend
    assert _aiter_common.local_cu_count(GFX942) is None  # CPU machine: nothing to probe
    assert _aiter_common.local_cu_count(ab.parse_platform("rocm:gfx942")) is None  # dry run
    monkeypatch.setattr(aiter_plugin, "local_cu_count", lambda platform: 228)
    (reason,) = backend.supports(spec_of(), GFX942)
    assert reason.code == ab.ReasonCode.ARCH and reason.got == "gfx942 with 228 CUs"
    assert backend.supports(spec_of(), GFX950) == []
    monkeypatch.setattr(aiter_plugin, "local_cu_count", lambda platform: 304)
    assert backend.supports(spec_of(), GFX942) == []


# What reaches aiter, call by call, for every release generation.


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_asm_calls_the_asm_kernel_with_views_and_spec_flags(fake, release, causal, strided):
    spec = spec_of(causal=causal, softmax_scale=0.07)
    run = Run("aiter-asm", spec, GFX942, strided=strided)
    assert fake.accessed == ["fmha_v3_varlen_fwd"]
    (call,) = fake.calls
    assert call.name == "fmha_v3_varlen_fwd" and call.positional == 0
    args = call.args
    assert_views_of_packed(run, args)
    assert_batch_args(run, args)
    assert args["is_causal"] is causal
    assert args["softmax_scale"] == 0.07 and type(args["softmax_scale"]) is float
    assert args["how_v3_bf16_cvt"] == 1
    assert (args["min_seqlen_q"], args["dropout_p"], args["logits_soft_cap"]) == (0, 0.0, 0.0)
    assert (args["window_size_left"], args["window_size_right"]) == (-1, -1)
    assert args["return_softmax_lse"] is False and args["return_dropout_randval"] is False
    assert all(args[n] is None for n in ("out", "block_table", "bias", "alibi_slopes", "gen"))
    assert all(args.get(n) is None for n in ("q_descale", "k_descale", "v_descale"))
    assert run.binding.generation == "0.1.7"
    assert run.binding.read_from == "aiter/ops/mha.py"
    assert run.binding.aiter_version == release.version
    assert run.out.shape == (run.params.token_q_num, spec.q_width)
    assert run.out.dtype == torch.bfloat16
    assert run.error() < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        (
            {"causal": False, "window": ab.SlidingWindow(4, 2)},
            {"window_size_left": 4, "window_size_right": 2},
        ),
        ({"window": ab.SlidingWindow.causal(5)}, {"window_size_left": 4, "window_size_right": 0}),
        ({"logit_softcap": 30}, {"logits_soft_cap": 30.0}),
    ],
    ids=["window-both-sides", "window-causal", "softcap"],
)
def test_nonasm_passes_windows_and_the_softcap_as_the_ck_op_reads_them(
    fake, release, features, expected
):
    run = Run("aiter-nonasm", spec_of(torch.float16, **features), GFX942)
    (call,) = fake.calls
    for name, value in expected.items():
        assert call.args[name] == value and type(call.args[name]) is type(value), name
    assert call.args["alibi_slopes"] is None
    assert run.error() < TOLERANCE[torch.float16]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_nonasm_passes_alibi_slopes_as_float32_heads_made_once(fake, causal):
    spec = spec_of(torch.bfloat16, causal=causal, alibi=ab.AlibiSpec())
    first, second = Run("aiter-nonasm", spec, GFX942), Run("aiter-nonasm", spec, GFX942, seed=1)
    slopes = [call.args["alibi_slopes"] for call in fake.calls]
    assert slopes[0] is slopes[1], "one device tensor per slopes and device, not one per batch"
    assert slopes[0].dtype == torch.float32 and slopes[0].shape == (spec.num_heads,)
    assert slopes[0].tolist() == pytest.approx(abp.bloom_alibi_slopes(spec.num_heads))
    assert max(first.error(), second.error()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "features",
    [
        {"window": ab.SlidingWindow.causal(8)},
        {"logit_softcap": 30.0},
        {"alibi": ab.AlibiSpec()},
    ],
    ids=["window", "softcap", "alibi"],
)
def test_fp8_with_features_is_refused_by_name(features):
    spec = spec_of(torch.float8_e4m3fnuz, **features)
    reasons = aiter_plugin.AiterNonAsmBackend.supports(spec, GFX942)
    assert any("FP8 varlen entry point" in r.message for r in reasons), reasons


def test_softcap_is_refused_when_aiter_would_build_the_softsign_formula(monkeypatch):
    spec = spec_of(torch.bfloat16, logit_softcap=30.0)
    backend = aiter_plugin.AiterNonAsmBackend
    assert backend.supports(spec, GFX942) == []
    monkeypatch.setenv("CK_TILE_ATTENTION_LOGITS_SOFT_CAP_DEFAULT", "1")
    (reason,) = backend.supports(spec, GFX942)
    assert reason.code == ab.ReasonCode.SOFTCAP and reason.got == "1"
    assert backend.supports(spec_of(torch.bfloat16), GFX942) == [], "only soft-capped specs"


@pytest.mark.parametrize(
    "spec",
    [
        spec_of(torch.bfloat16),  # ASM-eligible, yet the CK op is called
        spec_of(torch.float16, causal=False),
        spec_of(torch.float16, dim=64, kv_heads=8),
        spec_of(torch.bfloat16, dim=80, causal=False, softmax_scale=1),
    ],
    ids=["bf16-d128-causal", "fp16-d128-bidir", "fp16-d64-mha", "bf16-d80-bidir-int-scale"],
)
def test_nonasm_calls_the_ck_op_with_views_and_spec_flags(fake, release, spec):
    run = Run("aiter-nonasm", spec, GFX942, strided=True)
    assert fake.accessed == ["mha_varlen_fwd"]
    (call,) = fake.calls
    assert call.name == "mha_varlen_fwd" and call.positional == 0
    args = call.args
    assert_views_of_packed(run, args)
    assert_batch_args(run, args)
    assert args["is_causal"] is spec.causal
    assert args["softmax_scale"] == spec.scale and type(args["softmax_scale"]) is float
    assert (args["window_size_left"], args["window_size_right"]) == (-1, -1)
    assert args["cu_seqlens_q_padded"] is None and args["cu_seqlens_k_padded"] is None
    sink = declares(release, "mha_varlen_fwd", "sink_size")
    assert ("sink_size" in args) is sink
    if sink:
        assert args["sink_size"] == 0 and type(args["sink_size"]) is int
    assert run.binding.generation == ("0.1.8" if sink else "0.1.7")
    assert run.binding.keywords == (
        *BATCH,
        "softmax_scale",
        "is_causal",
        *OP_SETTINGS[:6],
        *(("sink_size",) if sink else ()),
        *OP_SETTINGS[6:],
    )
    assert run.out.shape == (run.params.token_q_num, spec.q_width)
    assert run.out.dtype == spec.dtype
    assert run.error() < TOLERANCE[spec.dtype]


@pytest.mark.parametrize(
    ("gfx", "platform", "dtype"),
    [("gfx942", GFX942, torch.float8_e4m3fnuz), ("gfx950", GFX950, torch.float8_e4m3fn)],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("host_scales", [False, True], ids=["tensor-scales", "float-scales"])
def test_fp8_goes_to_the_fp8_entry_point_with_the_releases_descales(
    monkeypatch, release, gfx, platform, dtype, causal, host_scales
):
    fake = install(monkeypatch, gfx, release=release)
    spec = spec_of(dtype, causal=causal)
    scales = (0.05, 0.2, 0.5)
    run = Run("aiter-nonasm", spec, platform, scales=scales, host_scales=host_scales)
    assert fake.accessed == ["flash_attn_varlen_fp8_pertensor_func"]
    (call,) = fake.calls
    assert call.name == FP8_ENTRY and call.positional == 0
    args = call.args
    assert_views_of_packed(run, args)
    assert_batch_args(run, args)
    assert args["causal"] is causal
    assert (args["min_seqlen_q"], args["logits_soft_cap"]) == (0, 0.0)
    assert tuple(args["window_size"])[:2] == (-1, -1)
    binding = run.binding
    assert binding.read_from == "inspect.signature"
    if declares(release, FP8_ENTRY, "q_descale"):
        # Passed to aiter as it reads them; the softmax scale is the spec's own.
        assert binding.descales and binding.generation == "0.1.7.post3"
        assert args["softmax_scale"] == spec.scale
        for name, value in zip(("q_descale", "k_descale", "v_descale"), scales, strict=True):
            t = args[name]
            assert isinstance(t, torch.Tensor)
            assert t.shape == (1,) and t.dtype == torch.float32 and t.device == run.packed.device
            assert t.item() == pytest.approx(value)
    else:
        assert not binding.descales and binding.generation == "0.1.7"
        assert args["softmax_scale"] == pytest.approx(spec.scale * scales[0] * scales[1])
    assert run.out.shape == (run.params.token_q_num, spec.q_width)
    assert run.out.dtype == torch.bfloat16
    assert run.error() < TOLERANCE[dtype]
    # The check has teeth: the same output read without the scales is far off.
    unscaled = ab.reference_attention(run.pristine, spec, run.params)
    assert relative_error(run.out, unscaled) > 0.5


def test_fp8_descales_cost_no_copy_and_no_new_tensor_per_forward(monkeypatch):
    fake = install(monkeypatch, "gfx942", release=NEWEST)
    spec = spec_of(torch.float8_e4m3fnuz)
    scales = (0.05, 0.2, 0.5)
    tensors = Run("aiter-nonasm", spec, GFX942, scales=scales)
    given = tensors.fp8_scales
    assert given is not None
    sent = fake.calls[0].args
    for name, scale in (("q_descale", given.q), ("k_descale", given.k), ("v_descale", given.v)):
        assert isinstance(scale, torch.Tensor)
        assert sent[name].data_ptr() == scale.data_ptr(), "a float32 scale goes as a view"
    floats = Run("aiter-nonasm", spec, GFX942, scales=scales, host_scales=True)
    floats.backend.forward(floats.packed, floats.plan, fp8_scales=floats.fp8_scales)
    first, second = fake.calls[1].args, fake.calls[2].args
    for name in ("q_descale", "k_descale", "v_descale"):
        assert first[name] is second[name], "a Python-float scale is made on the device once"


def test_descale_tensor_is_what_aiter_reads():
    cpu = torch.device("cpu")
    given = torch.tensor(0.25)
    as_is = _aiter_common.descale_tensor(given, cpu)
    assert as_is.shape == (1,) and as_is.data_ptr() == given.data_ptr()
    cast = _aiter_common.descale_tensor(torch.tensor([0.5], dtype=torch.float64), cpu)
    assert cast.dtype == torch.float32 and cast.tolist() == [0.5]
    made = _aiter_common.descale_tensor(2.0, cpu)
    assert made.dtype == torch.float32 and made.shape == (1,) and made.tolist() == [2.0]
    assert _aiter_common.descale_tensor(2.0, cpu) is made


def test_prepare_reads_each_signature_once_and_forward_only_launches(fake, monkeypatch):
    reads: list[str] = []
    real_read = _aiter_signature.read_signature

    def counting_read(fn, name):
        reads.append(name)
        return real_read(fn, name)

    monkeypatch.setattr(_aiter_binding, "read_signature", counting_read)
    spec = spec_of(torch.float16)
    backend = ab.select(spec, platform=GFX942).backend
    assert backend.name == "aiter-nonasm"
    params = ab.FMHAParams.from_lengths([4, 9], device="cpu")
    plan = backend.prepare(params)
    backend.prepare(params)
    aiter_plugin.AiterNonAsmBackend.bind(spec, GFX942).prepare(params)
    assert reads == ["mha_varlen_fwd"]
    assert fake.calls == [] and fake.accessed == ["mha_varlen_fwd"] * 3
    qkv = torch.randn(params.rows, spec.qkv_width, generator=torch.Generator().manual_seed(1))
    qkv = qkv.to(spec.dtype)
    first = backend.forward(qkv, plan)
    second = backend.forward(qkv, plan)
    assert torch.equal(first, second)
    assert [c.name for c in fake.calls] == ["mha_varlen_fwd"] * 2
    assert fake.accessed == ["mha_varlen_fwd"] * 3
    assert fake.calls[0].args["cu_seqlens_q"] is fake.calls[1].args["cu_seqlens_q"]


def test_another_aiter_function_object_is_read_again(monkeypatch):
    spec = spec_of(torch.float16)
    params = ab.FMHAParams.from_lengths([4, 9], device="cpu")
    install(monkeypatch, "gfx942", release=OLDEST)
    old = ab.select(spec, platform=GFX942).backend.prepare(params).kernel
    install(monkeypatch, "gfx942", release=NEWEST)
    new = ab.select(spec, platform=GFX942).backend.prepare(params).kernel
    assert isinstance(old, _aiter_common.AiterPlan) and isinstance(new, _aiter_common.AiterPlan)
    assert (old.binding.generation, new.binding.generation) == ("0.1.7", "0.1.8")
    assert "sink_size" not in old.settings and new.settings["sink_size"] == 0


def test_describe_reports_the_bound_generation(fake, release):
    spec = spec_of(torch.float8_e4m3fnuz)
    backend = ab.select(spec, platform=GFX942).backend
    before = backend.describe(GFX942)
    assert before["aiter_signature"] == "read from the installed aiter at the first prepare"
    assert "decided at the first prepare" in before["fp8_descale"]
    backend.prepare(ab.FMHAParams.from_lengths([3], device="cpu"))
    after = backend.describe(GFX942)
    assert after["aiter_entry"] == FP8_ENTRY
    assert f"amd-aiter {release.version}" in after["aiter_signature"]
    descales = declares(release, FP8_ENTRY, "q_descale")
    generation = "0.1.7.post3" if descales else "0.1.7"
    assert f"parameters as in {generation} and later" in after["aiter_signature"]
    assert after["fp8_descale"].startswith("q/k/v_descale" if descales else "q and k scales")


# A release the backends do not know is refused at prepare, never at forward.


def _future_release(tmp_path: Path, edit: tuple[str, str], name: str = "future") -> Release:
    """NEWEST's stubs with one textual edit, loaded from a file as aiter/ops/mha.py would be."""
    source = inspect.getsource(NEWEST.stubs)
    assert edit[0] in source
    path = tmp_path / f"{name}.py"
    path.write_text(source.replace(edit[0], edit[1], 1))
    spec = importlib.util.spec_from_file_location(f"aiter_stub_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Release("9.0.0", "a release after these backends", module)


@pytest.mark.parametrize(
    ("backend", "dtype", "edit", "match"),
    [
        (
            "aiter-nonasm",
            torch.bfloat16,
            ("    sink_size: int,\n", "    sink_size: int,\n    page_size: int,\n"),
            r"aiter 9\.0\.0's mha_varlen_fwd requires parameter 'page_size'",
        ),
        (
            "aiter-asm",
            torch.bfloat16,
            ("    how_v3_bf16_cvt: int,\n", "    how_v3_bf16_cvt: int,\n    v3_mode: str,\n"),
            r"aiter 9\.0\.0's fmha_v3_varlen_fwd requires parameter 'v3_mode'",
        ),
        (
            "aiter-nonasm",
            torch.float8_e4m3fnuz,
            ("    v_descale,\n", "    v_descale,\n    quant_mode,\n"),
            r"aiter 9\.0\.0's flash_attn_varlen_fp8_pertensor_func requires parameter "
            r"'quant_mode'",
        ),
        (
            "aiter-nonasm",
            torch.float8_e4m3fnuz,
            ("    causal=False,\n", "    is_causal=False,\n"),
            r"flash_attn_varlen_fp8_pertensor_func has no parameter 'causal'",
        ),
        (
            "aiter-nonasm",
            torch.float8_e4m3fnuz,
            ("    v_descale,\n", ""),
            r"takes q_descale, k_descale but not all three",
        ),
    ],
    ids=[
        "new-required-op-param",
        "new-required-asm-param",
        "new-required-fp8-param",
        "renamed-causal",
        "two-descales",
    ],
)
def test_an_unknown_parameter_list_is_refused_at_prepare(
    monkeypatch, tmp_path, backend, dtype, edit, match
):
    fake = install(monkeypatch, "gfx942", release=_future_release(tmp_path, edit))
    selection = ab.select(spec_of(dtype), backend=backend, platform=GFX942)
    with pytest.raises(BackendFailure, match=match) as info:
        selection.backend.prepare(ab.FMHAParams.from_lengths([3], device="cpu"))
    assert "0.1.7 to 0.1.20.post1" in str(info.value)
    assert fake.calls == []


def test_positional_only_parameters_are_refused_at_prepare(monkeypatch, tmp_path):
    edit = ("    is_causal: bool,\n", "    is_causal: bool,\n    /,\n")
    install(monkeypatch, "gfx942", release=_future_release(tmp_path, edit))
    backend = ab.select(spec_of(torch.float16), platform=GFX942).backend
    with pytest.raises(BackendFailure, match="cannot be called by keyword"):
        backend.prepare(ab.FMHAParams.from_lengths([3], device="cpu"))


def test_an_op_whose_source_cannot_be_read_is_refused_at_prepare(monkeypatch):
    install(monkeypatch, "gfx942")
    monkeypatch.delitem(sys.modules, "aiter.ops.mha")
    backend = ab.select(spec_of(torch.float16), platform=GFX942).backend
    with pytest.raises(BackendFailure, match=r"cannot read the parameters of aiter's mha_v"):
        backend.prepare(ab.FMHAParams.from_lengths([3], device="cpu"))


# The signature reader and the recorded releases.


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_source_reader_gives_each_releases_declared_signature(release, entry):
    source = inspect.getsource(release.stubs)
    read = _aiter_signature.signature_from_source(source, entry)
    assert read is not None
    declared = inspect.signature(stub_of(release, entry))
    assert [(p.name, p.kind, p.default, p.annotation) for p in read.parameters.values()] == [
        (p.name, p.kind, p.default, p.annotation) for p in declared.parameters.values()
    ]
    assert _aiter_signature.signature_from_source(source, "no_such_function") is None


def test_compiled_ops_show_no_signature_so_theirs_is_read_from_source(fake):
    module = sys.modules["aiter"]
    for op in ("mha_varlen_fwd", "fmha_v3_varlen_fwd"):
        shown = inspect.signature(vars(module)[op])
        assert [p.kind for p in shown.parameters.values()] == [
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ]
        _, source = _aiter_signature.read_signature(vars(module)[op], op)
        assert source == "aiter/ops/mha.py"
    _, source = _aiter_signature.read_signature(vars(module)[FP8_ENTRY], FP8_ENTRY)
    assert source == "inspect.signature"


def test_non_literal_defaults_still_count_as_optional():
    source = "def f(a, b=dtypes.fp8, *, c=1):\n    ...\n"
    read = _aiter_signature.signature_from_source(source, "f")
    assert read is not None
    b, c = read.parameters["b"], read.parameters["c"]
    assert b.default is _aiter_signature.DECLARED_DEFAULT and c.default == 1
    assert c.kind is inspect.Parameter.KEYWORD_ONLY


def test_releases_change_where_the_backends_bind_differently():
    """The facts the binding follows: descales at positions 4-6 of the FP8 entry point from
    0.1.7.post3, a required ``sink_size`` in ``mha_varlen_fwd`` from 0.1.8."""
    order = [r.version for r in RELEASES]
    for r in RELEASES:
        fp8 = list(inspect.signature(stub_of(r, FP8_ENTRY)).parameters)
        descales = fp8[3:6] == ["q_descale", "k_descale", "v_descale"]
        assert descales is (order.index(r.version) >= 1), r
        ck = inspect.signature(stub_of(r, "mha_varlen_fwd")).parameters
        sink = "sink_size" in ck and ck["sink_size"].default is inspect.Parameter.empty
        assert sink is (order.index(r.version) >= 2), r


# The fake is only useful if it refuses what aiter refuses and computes what aiter computes.


def _direct_inputs(dtype=torch.bfloat16, dim=128):
    spec = spec_of(dtype, dim=dim)
    params = ab.FMHAParams.from_lengths([3, 6], device="cpu")
    packed = torch.randn(params.rows, spec.qkv_width, generator=torch.Generator().manual_seed(2))
    packed = packed.to(dtype)
    q, k, v = ab.split_views(packed, spec, params.token_q_num)
    return spec, params, packed, (q, k, v, params.cu_seqlens_q, params.cu_seqlens_k, 6, 6)


def op_kwargs(release: Release, entry: str = "mha_varlen_fwd", **changes) -> dict[str, object]:
    """Everything after ``max_seqlen_k`` that op ``entry`` of ``release`` requires, but the
    ASM op's ``how_v3_bf16_cvt``."""
    kwargs: dict[str, object] = {
        "min_seqlen_q": 0,
        "dropout_p": 0.0,
        "softmax_scale": 0.1,
        "logits_soft_cap": 0.0,
        "zero_tensors": False,
        "is_causal": True,
        "window_size_left": -1,
        "window_size_right": -1,
        "return_softmax_lse": False,
        "return_dropout_randval": False,
    }
    if declares(release, entry, "sink_size"):
        kwargs["sink_size"] = 0
    return {**kwargs, **changes}


def test_fake_computes_aiter_attention(release):
    spec, params, packed, head = _direct_inputs()
    fake = FakeAiter(release=release)
    out = fake.mha_varlen_fwd(*head, **op_kwargs(release, softmax_scale=spec.scale))[0]
    ref = ab.reference_attention(packed, spec, params)
    assert relative_error(out.reshape(params.token_q_num, -1), ref) < TOLERANCE[spec.dtype]


def test_fake_propagates_nan_instead_of_hiding_it():
    _, _, _, head = _direct_inputs()
    q, k, v, cuq, _, _, _ = head
    # Causal rows with no visible key: three queries against one key, bottom-right aligned.
    cuk = torch.tensor([0, 1, 2], dtype=torch.int32)
    fake = FakeAiter()
    out = fake.mha_varlen_fwd(q, k, v, cuq, cuk, 6, 6, **op_kwargs(NEWEST))[0]
    assert out[:2].isnan().all() and not out[2].isnan().any()


def test_nan_in_the_input_reaches_the_output(fake):
    spec = spec_of(torch.float16, kv_heads=8)
    params = ab.FMHAParams.from_lengths([4, 4], device="cpu")
    qkv = torch.randn(params.rows, spec.qkv_width, generator=torch.Generator().manual_seed(3))
    qkv = qkv.to(spec.dtype)
    qkv[5, spec.q_width : spec.q_width + spec.head_dim] = float("nan")  # key of row 1, seq 2
    backend = ab.select(spec, platform=GFX942).backend
    out = backend.forward(qkv, backend.prepare(params)).view(8, spec.num_heads, spec.head_dim)
    seen = out[:, 0].isnan().any(dim=-1).tolist()
    assert seen == [False] * 5 + [True] * 3
    assert not out[:, 1:].isnan().any()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda f, h, r: f.mha_varlen_fwd(*h, **op_kwargs(r, causal=True)),
            RuntimeError,
            "causal",
        ),
        (
            lambda f, h, r: f.mha_varlen_fwd(*h, **op_kwargs(r, softmax_scale=1)),
            TypeError,
            "float",
        ),
        (
            lambda f, h, r: f.mha_varlen_fwd(*h, **op_kwargs(r, is_causal=1)),
            TypeError,
            "bool",
        ),
        (
            lambda f, h, r: f.fmha_v3_varlen_fwd(*h, **op_kwargs(r, "fmha_v3_varlen_fwd")),
            RuntimeError,
            "how_v3_bf16_cvt",
        ),
        # aiter's eighth positional parameter is min_seqlen_q, not flash-attn's dropout_p.
        (
            lambda f, h, r: f.mha_varlen_fwd(*h, 0.0, **op_kwargs(r)),
            RuntimeError,
            "multiple values for argument 'min_seqlen_q'",
        ),
        (
            lambda f, h, r: f.mha_varlen_fwd(*h[:3], h[3].long(), *h[4:], **op_kwargs(r)),
            RuntimeError,
            "int32",
        ),
        (
            lambda f, h, r: f.mha_varlen_fwd(h[0].transpose(1, 2), *h[1:], **op_kwargs(r)),
            RuntimeError,
            "contiguous last dimension",
        ),
        (
            lambda f, h, r: f.mha_varlen_fwd(*h[:5], 2, 6, **op_kwargs(r)),
            RuntimeError,
            "max_seqlen",
        ),
        (
            lambda f, h, r: f.fmha_v3_varlen_fwd(
                *(t.half() if t.is_floating_point() else t for t in h[:3]),
                *h[3:],
                **op_kwargs(r, "fmha_v3_varlen_fwd"),
                how_v3_bf16_cvt=1,
            ),
            RuntimeError,
            "invalid argument for fmha_v3_varlen_fwd",
        ),
    ],
    ids=[
        "unknown-keyword",
        "int-scale",
        "int-flag",
        "missing-how-v3",
        "positional-order",
        "int64-offsets",
        "strided-last-dim",
        "short-max-seqlen",
        "asm-fp16",
    ],
)
def test_fake_refuses_what_aiter_refuses(release, call, error, match):
    _, _, _, head = _direct_inputs()
    fake = FakeAiter(release=release)
    with pytest.raises(error, match=match):
        call(fake, head, release)


def test_fake_refuses_a_missing_sink_size_where_the_release_requires_it():
    _, _, _, head = _direct_inputs()
    kwargs = op_kwargs(NEWEST)
    del kwargs["sink_size"]
    with pytest.raises(RuntimeError, match="sink_size"):
        FakeAiter(release=NEWEST).mha_varlen_fwd(*head, **kwargs)
    with pytest.raises(RuntimeError, match="sink_size"):
        FakeAiter(release=OLDEST).mha_varlen_fwd(*head, **op_kwargs(OLDEST, sink_size=0))


def test_fake_reads_descales_as_the_kernel_does():
    _, _, _, head = _direct_inputs()
    fp8 = tuple(t.to(torch.float8_e4m3fnuz) for t in head[:3])
    one = torch.ones(1)
    call = FakeAiter(release=NEWEST).flash_attn_varlen_fp8_pertensor_func
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    batch = dict(zip(names, head[3:], strict=True))
    with pytest.raises(TypeError, match="q_descale"):
        call(*fp8, **batch)
    with pytest.raises(RuntimeError, match="float32 one-element tensor"):
        call(*fp8, 0.5, one, one, *head[3:])
    with pytest.raises(RuntimeError, match="float32 one-element tensor"):
        call(*fp8, one.double(), one, one, *head[3:])
    with pytest.raises(RuntimeError, match="all provided or all not provided"):
        FakeAiter(release=NEWEST).mha_varlen_fwd(*head, **op_kwargs(NEWEST, q_descale=one))
    plain = call(*fp8, one, one, one, *head[3:])
    halved = call(*fp8, one, one, one * 0.5, *head[3:])
    assert torch.allclose(halved.float(), plain.float() * 0.5)


def test_fake_kernel_availability_follows_arch():
    _, _, _, head = _direct_inputs()
    kwargs = op_kwargs(NEWEST, "fmha_v3_varlen_fwd")
    with pytest.raises(RuntimeError, match="invalid argument"):
        FakeAiter(gfx="gfx90a").fmha_v3_varlen_fwd(*head, **kwargs, how_v3_bf16_cvt=1)
    with pytest.raises(RuntimeError, match="228 CUs"):
        FakeAiter(cu_count=228).fmha_v3_varlen_fwd(*head, **kwargs, how_v3_bf16_cvt=1)
    fp8 = tuple(t.to(torch.float8_e4m3fnuz) for t in head[:3])
    one = torch.ones(1)
    with pytest.raises(RuntimeError, match="no fp8bf16 kernel"):
        FakeAiter(gfx="gfx950").flash_attn_varlen_fp8_pertensor_func(*fp8, one, one, one, *head[3:])
    out = FakeAiter(gfx="gfx942").flash_attn_varlen_fp8_pertensor_func(
        *fp8, one, one, one, *head[3:]
    )
    assert out.dtype == torch.bfloat16 and not out.isnan().any()


# The recorded stubs against a real aiter source, where one is at hand.


def _aiter_mha_source() -> Path | None:
    """aiter/ops/mha.py of an installed amd-aiter, or of ``$AITER_SRC``; never imports aiter."""
    root = os.environ.get("AITER_SRC")
    if root:
        return Path(root) / "ops" / "mha.py"
    try:
        found = importlib.util.find_spec("aiter")
    except ValueError:
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations))) / "ops" / "mha.py"


def _normalise(annotation: object) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    text = str(annotation).replace("torch.", "").replace("typing.", "")
    text = text.replace("Tuple[", "tuple[")
    return re.sub(r"Optional\[([\w.]+)\]", r"\1 | None", text)


def _parameter_lists(source: str) -> dict[str, list[tuple[object, ...]]]:
    lists: dict[str, list[tuple[object, ...]]] = {}
    for entry in ENTRY_POINTS:
        signature = _aiter_signature.signature_from_source(source, entry)
        assert signature is not None, entry
        lists[entry] = [
            (p.name, p.kind, p.default, _normalise(p.annotation))
            for p in signature.parameters.values()
        ]
    return lists


def test_an_installed_aiter_matches_a_recorded_release():
    """Optional: the stubs' own checks run unconditionally above; this one needs the source."""
    path = _aiter_mha_source()
    if path is None or not path.is_file():
        pytest.skip("amd-aiter is not installed; set AITER_SRC=<unpacked wheel>/aiter to check")
    real = _parameter_lists(path.read_text())
    recorded = {r.covers: _parameter_lists(inspect.getsource(r.stubs)) for r in RELEASES}
    matches = [covers for covers, lists in recorded.items() if lists == real]
    assert matches, f"{path} matches none of the recorded releases: add its stubs"
    init = path.parent.parent / "__init__.py"
    assert "from .ops.mha import *" in init.read_text()
    assert "__all__" not in path.read_text()


# Selection as `attn-backends explain --platform rocm:gfx942` shows it.


def _verdicts(selection: ab.Selection) -> dict[str, ab.Candidate]:
    return {c.name: c for c in selection.candidates}


def test_selection_on_gfx942_prefers_asm_for_bf16_d128():
    selection = ab.select(spec_of(), platform="rocm:gfx942")
    assert selection.name == "aiter-asm" and selection.source == "ranking"
    cands = _verdicts(selection)
    assert cands["aiter-asm"].place == 1
    assert cands["aiter-nonasm"].verdict == "eligible" and cands["aiter-nonasm"].place == 2
    assert cands["torch-sdpa"].verdict == "eligible" and cands["torch-sdpa"].place == 3
    assert dict(selection.details)["aiter_entry"] == "fmha_v3_varlen_fwd"
    text = selection.explain()
    assert "selected: aiter-asm (by ranking)" in text
    assert "decided by: row " in text and ": aiter-asm on rocm (" in text
    assert "eligible  aiter-nonasm" in text


@pytest.mark.parametrize(
    ("spec", "platform", "code"),
    [
        (spec_of(torch.float16), "rocm:gfx942", ab.ReasonCode.DTYPE),
        (spec_of(dim=64, causal=False), "rocm:gfx942", ab.ReasonCode.HEAD_DIM),
        (spec_of(), "rocm:gfx90a", ab.ReasonCode.ARCH),
        (spec_of(torch.float8_e4m3fnuz), "rocm:gfx942", ab.ReasonCode.FP8),
        (
            spec_of(causal=False, window=ab.SlidingWindow.modernbert(128)),
            "rocm:gfx942",
            ab.ReasonCode.SLIDING_WINDOW,
        ),
        (spec_of(logit_softcap=50.0), "rocm:gfx942", ab.ReasonCode.SOFTCAP),
        (spec_of(causal=False, alibi=ab.AlibiSpec()), "rocm:gfx942", ab.ReasonCode.ALIBI),
    ],
)
def test_selection_falls_to_nonasm_and_records_why_asm_lost(spec, platform, code):
    selection = ab.select(spec, platform=platform)
    assert selection.name == "aiter-nonasm"
    loser = _verdicts(selection)["aiter-asm"]
    assert loser.verdict == "rejected" and code in {r.code for r in loser.reasons}
    text = selection.explain()
    assert "selected: aiter-nonasm (by ranking)" in text
    assert f"[{code.value}]" in text


def test_fp8_in_the_wrong_format_is_refused_by_every_backend():
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(spec_of(torch.float8_e4m3fn), platform="rocm:gfx942")
    reasons = dict(info.value.reasons)
    assert ab.ReasonCode.FP8 in {r.code for r in reasons["aiter-nonasm"]}
    assert "gfx942" in str(info.value)


# The shipped conformance suite, through each backend, on the fake of each release it calls
# differently: every generation for aiter-nonasm; the oldest and newest for aiter-asm, whose
# arguments have not changed since 0.1.7.


class _OnFakeAiter(NoCachePrefillConformance):
    device: ClassVar[str | None] = "cpu"
    platform: ClassVar[ab.Platform | None] = GFX942

    @pytest.fixture(autouse=True)
    def _fake_aiter(self, monkeypatch, aiter_release):
        install(monkeypatch, "gfx942", release=aiter_release)


class TestAiterAsmConformance(_OnFakeAiter):
    backend_names = ("aiter-asm",)

    @pytest.fixture(params=(OLDEST, NEWEST), ids=str)
    def aiter_release(self, request):
        return request.param


class TestAiterNonAsmConformance(_OnFakeAiter):
    backend_names = ("aiter-nonasm",)

    @pytest.fixture(params=RELEASES, ids=str)
    def aiter_release(self, request):
        return request.param
