"""``aiter-asm`` and ``aiter-nonasm`` on CPU, through a fake ``aiter`` with the real signatures.

What is checked: each backend calls exactly one aiter function, with views trimmed to the valid
tokens (no copies), int32 ``cu_seqlens`` on Q's device, the spec's causal flag and softmax
scale, keyword arguments aiter really has; FP8 goes to the FP8 entry point with the descales
folded in; the output is ``[token_q_num, Hq * D]`` and matches the float64 reference. The
conformance suite then runs through both backends on the same fake.
"""

from __future__ import annotations

import ast
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
from attn_backends_builtin import _aiter_common
from attn_backends_builtin import aiter as aiter_plugin

import attn_backends as ab
from attn_backends.testing import NoCachePrefillConformance
from tests.fakes import fake_aiter
from tests.fakes.fake_aiter import FakeAiter, install

AITER = (("aiter", "fake"),)
GFX942 = ab.Platform(kind="rocm", arch="gfx942", libraries=AITER)
GFX950 = ab.Platform(kind="rocm", arch="gfx950", libraries=AITER)
GFX90A = ab.Platform(kind="rocm", arch="gfx90a", libraries=AITER)
LENGTHS = (5, 17, 1, 32)


def spec_of(dtype=torch.bfloat16, *, heads=8, kv_heads=2, dim=128, causal=True, **kw):
    return ab.AttentionSpec(heads, kv_heads, dim, dtype, causal=causal, **kw)


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
        self.plan = selection.backend.prepare(self.params)
        self.out = selection.backend.forward(self.packed, self.plan, fp8_scales=self.fp8_scales)

    def error(self) -> float:
        ref = ab.reference_attention(
            self.pristine, self.spec, self.params, fp8_scales=self.fp8_scales
        )
        return ab.relative_error(self.out, ref)


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


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch, "gfx942")


# Registration, lazy import, declared capabilities.


def test_one_plugin_registers_both_backends():
    registry = ab.get_registry()
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
    backend = module.AiterAsmBackend().bind(spec)
    assert backend.supports(spec, GFX942) == []
    assert "aiter" not in sys.modules
    params = ab.FMHAParams.from_lengths([3], device="cpu")
    with pytest.raises(
        ab.BackendFailure, match=r"cannot import aiter \(RuntimeError: ROCm"
    ) as info:
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
    for caps in (asm, ck):
        assert caps.gqa and caps.causal and caps.bidirectional
        assert not caps.needs_contiguous and caps.requires == ("aiter",)
    rocm = ab.parse_platform("rocm:gfx942")
    scores = [
        backend.capabilities.priority_for(spec_of(), rocm)
        for backend in (aiter_plugin.AiterAsmBackend(), aiter_plugin.AiterNonAsmBackend())
    ]
    assert [rule.score for rule in scores if rule is not None] == [200, 100]


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
    impl = aiter_plugin.AiterAsmBackend() if backend == "asm" else aiter_plugin.AiterNonAsmBackend()
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
    impl = aiter_plugin.AiterAsmBackend() if backend == "asm" else aiter_plugin.AiterNonAsmBackend()
    assert impl.supports(spec, platform) == []


def test_asm_refuses_gfx942_parts_aiter_ships_no_kernels_for(monkeypatch):
    backend = aiter_plugin.AiterAsmBackend()
    assert _aiter_common.local_cu_count(GFX942) is None  # CPU machine: nothing to probe
    assert _aiter_common.local_cu_count(ab.parse_platform("rocm:gfx942")) is None  # dry run
    monkeypatch.setattr(aiter_plugin, "local_cu_count", lambda platform: 228)
    (reason,) = backend.supports(spec_of(), GFX942)
    assert reason.code == ab.ReasonCode.ARCH and reason.got == "gfx942 with 228 CUs"
    assert backend.supports(spec_of(), GFX950) == []
    monkeypatch.setattr(aiter_plugin, "local_cu_count", lambda platform: 304)
    assert backend.supports(spec_of(), GFX942) == []


# What reaches aiter, call by call.


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_asm_calls_the_asm_kernel_with_views_and_spec_flags(fake, causal, strided):
    spec = spec_of(causal=causal, softmax_scale=0.07)
    run = Run("aiter-asm", spec, GFX942, strided=strided)
    assert fake.accessed == ["fmha_v3_varlen_fwd"]
    assert [c.name for c in fake.calls] == ["fmha_v3_varlen_fwd"]
    args = fake.calls[0].args
    assert_views_of_packed(run, args)
    assert_batch_args(run, args)
    assert args["is_causal"] is causal
    assert args["softmax_scale"] == 0.07 and type(args["softmax_scale"]) is float
    assert args["how_v3_bf16_cvt"] == 1
    assert (args["min_seqlen_q"], args["dropout_p"], args["logits_soft_cap"]) == (0, 0.0, 0.0)
    assert (args["window_size_left"], args["window_size_right"]) == (-1, -1)
    assert args["return_softmax_lse"] is False and args["return_dropout_randval"] is False
    assert all(args[n] is None for n in ("out", "block_table", "bias", "alibi_slopes", "gen"))
    assert run.out.shape == (run.params.token_q_num, spec.q_width)
    assert run.out.dtype == torch.bfloat16
    assert run.error() < ab.TOLERANCE[torch.bfloat16]


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
def test_nonasm_calls_the_ck_op_with_views_and_spec_flags(fake, spec):
    run = Run("aiter-nonasm", spec, GFX942, strided=True)
    assert fake.accessed == ["mha_varlen_fwd"]
    assert [c.name for c in fake.calls] == ["mha_varlen_fwd"]
    args = fake.calls[0].args
    assert_views_of_packed(run, args)
    assert_batch_args(run, args)
    assert args["is_causal"] is spec.causal
    assert args["softmax_scale"] == spec.scale and type(args["softmax_scale"]) is float
    assert (args["window_size_left"], args["window_size_right"]) == (-1, -1)
    assert args["cu_seqlens_q_padded"] is None and args["cu_seqlens_k_padded"] is None
    assert run.out.shape == (run.params.token_q_num, spec.q_width)
    assert run.out.dtype == spec.dtype
    assert run.error() < ab.TOLERANCE[spec.dtype]


@pytest.mark.parametrize(
    ("gfx", "platform", "dtype"),
    [("gfx942", GFX942, torch.float8_e4m3fnuz), ("gfx950", GFX950, torch.float8_e4m3fn)],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("host_scales", [False, True], ids=["tensor-scales", "float-scales"])
def test_fp8_goes_to_the_fp8_entry_point_with_descales_folded(
    monkeypatch, gfx, platform, dtype, causal, host_scales
):
    fake = install(monkeypatch, gfx)
    spec = spec_of(dtype, causal=causal)
    scales = (0.05, 0.2, 0.5)
    run = Run("aiter-nonasm", spec, platform, scales=scales, host_scales=host_scales)
    assert fake.accessed == ["flash_attn_varlen_fp8_pertensor_func"]
    assert [c.name for c in fake.calls] == ["flash_attn_varlen_fp8_pertensor_func"]
    args = fake.calls[0].args
    assert_views_of_packed(run, args)
    assert_batch_args(run, args)
    assert args["causal"] is causal
    assert args["softmax_scale"] == pytest.approx(spec.scale * scales[0] * scales[1], rel=1e-6)
    assert (args["min_seqlen_q"], args["logits_soft_cap"], args["window_size"]) == (
        0,
        0.0,
        (-1, -1),
    )
    assert run.out.shape == (run.params.token_q_num, spec.q_width)
    assert run.out.dtype == torch.bfloat16
    assert run.error() < ab.TOLERANCE[dtype]
    # The check has teeth: the same output read without the scales is far off.
    unscaled = ab.reference_attention(run.pristine, spec, run.params)
    assert ab.relative_error(run.out, unscaled) > 0.5


def test_prepare_resolves_once_and_forward_only_launches(fake):
    spec = spec_of(torch.float16)
    backend = ab.select(spec, platform=GFX942).backend
    assert backend.name == "aiter-nonasm"
    params = ab.FMHAParams.from_lengths([4, 9], device="cpu")
    plan = backend.prepare(params)
    assert fake.calls == [] and fake.accessed == ["mha_varlen_fwd"]
    qkv = torch.randn(params.rows, spec.qkv_width, generator=torch.Generator().manual_seed(1))
    qkv = qkv.to(spec.dtype)
    first = backend.forward(qkv, plan)
    second = backend.forward(qkv, plan)
    assert torch.equal(first, second)
    assert [c.name for c in fake.calls] == ["mha_varlen_fwd"] * 2
    assert fake.accessed == ["mha_varlen_fwd"]
    assert fake.calls[0].args["cu_seqlens_q"] is fake.calls[1].args["cu_seqlens_q"]


# The fake is only useful if it refuses what aiter refuses and computes what aiter computes.


def _direct_inputs(dtype=torch.bfloat16, dim=128):
    spec = spec_of(dtype, dim=dim)
    params = ab.FMHAParams.from_lengths([3, 6], device="cpu")
    packed = torch.randn(params.rows, spec.qkv_width, generator=torch.Generator().manual_seed(2))
    packed = packed.to(dtype)
    q, k, v = ab.split_views(packed, spec, params.token_q_num)
    return spec, params, packed, (q, k, v, params.cu_seqlens_q, params.cu_seqlens_k, 6, 6)


OP_KWARGS = {
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


def test_fake_computes_aiter_attention():
    spec, params, packed, head = _direct_inputs()
    out = FakeAiter().flash_attn_varlen_func(*head, causal=True, softmax_scale=spec.scale)
    ref = ab.reference_attention(packed, spec, params)
    assert ab.relative_error(out.reshape(params.token_q_num, -1), ref) < ab.TOLERANCE[spec.dtype]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda f, h: f.mha_varlen_fwd(*h, **{**OP_KWARGS, "causal": True}), TypeError, "causal"),
        (
            lambda f, h: f.mha_varlen_fwd(*h, **{**OP_KWARGS, "softmax_scale": 1}),
            TypeError,
            "float",
        ),
        (lambda f, h: f.mha_varlen_fwd(*h, **{**OP_KWARGS, "is_causal": 1}), TypeError, "bool"),
        (lambda f, h: f.fmha_v3_varlen_fwd(*h, **OP_KWARGS), TypeError, "how_v3_bf16_cvt"),
        # flash-attn's positional order: the 8th argument lands in min_seqlen_q.
        (lambda f, h: f.flash_attn_varlen_func(*h, 0.0, 0.1), TypeError, "min_seqlen_q"),
        (
            lambda f, h: f.mha_varlen_fwd(*h[:3], h[3].long(), *h[4:], **OP_KWARGS),
            RuntimeError,
            "int32",
        ),
        (
            lambda f, h: f.mha_varlen_fwd(h[0].transpose(1, 2), *h[1:], **OP_KWARGS),
            RuntimeError,
            "contiguous last dimension",
        ),
        (
            lambda f, h: f.mha_varlen_fwd(*h[:5], 2, 6, **OP_KWARGS),
            RuntimeError,
            "max_seqlen",
        ),
        (
            lambda f, h: f.fmha_v3_varlen_fwd(
                *(t.half() if t.is_floating_point() else t for t in h[:3]),
                *h[3:],
                **OP_KWARGS,
                how_v3_bf16_cvt=1,
            ),
            RuntimeError,
            "invalid argument for fmha_v3_varlen_fwd",
        ),
    ],
)
def test_fake_refuses_what_aiter_refuses(call, error, match):
    _, _, _, head = _direct_inputs()
    fake = FakeAiter()
    with pytest.raises(error, match=match):
        call(fake, head)


def test_fake_kernel_availability_follows_arch():
    _, _, _, head = _direct_inputs()
    with pytest.raises(RuntimeError, match="invalid argument"):
        FakeAiter(gfx="gfx90a").fmha_v3_varlen_fwd(*head, **OP_KWARGS, how_v3_bf16_cvt=1)
    with pytest.raises(RuntimeError, match="228 CUs"):
        FakeAiter(cu_count=228).fmha_v3_varlen_fwd(*head, **OP_KWARGS, how_v3_bf16_cvt=1)
    fp8 = tuple(t.to(torch.float8_e4m3fnuz) for t in head[:3])
    with pytest.raises(RuntimeError, match="no fp8bf16 kernel"):
        FakeAiter(gfx="gfx950").flash_attn_varlen_fp8_pertensor_func(*fp8, *head[3:])
    out = FakeAiter(gfx="gfx942").flash_attn_varlen_fp8_pertensor_func(*fp8, *head[3:])
    assert out.dtype == torch.bfloat16 and not out.isnan().any()


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


def _normalise(annotation: str) -> str:
    text = annotation.replace("torch.", "").replace("typing.", "")
    return re.sub(r"Optional\[(\w+)\]", r"\1 | None", text)


def test_fake_signatures_match_aiter_source():
    path = _aiter_mha_source()
    if path is None or not path.is_file():
        pytest.skip("amd-aiter is not installed; set AITER_SRC=<unpacked wheel>/aiter to check")
    tree = ast.parse(path.read_text())
    real = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name, stub in fake_aiter.SIGNATURES.items():
        args = real[name].args
        assert not args.posonlyargs and not args.kwonlyargs and args.vararg is None
        defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
        theirs = [
            (
                a.arg,
                ast.literal_eval(d) if d is not None else inspect.Parameter.empty,
                _normalise(ast.unparse(a.annotation)) if a.annotation is not None else "",
            )
            for a, d in zip(args.args, defaults, strict=True)
        ]
        ours = [
            (
                p.name,
                p.default,
                _normalise(p.annotation) if p.annotation is not inspect.Parameter.empty else "",
            )
            for p in inspect.signature(stub).parameters.values()
        ]
        assert ours == theirs, name
        assert [type(d) for _, d, _ in ours] == [type(d) for _, d, _ in theirs], name
    init = (path.parent.parent / "__init__.py").read_text()
    assert "from .ops.mha import *" in init and "__all__" not in path.read_text()


# Selection as `attn-backends explain --platform rocm:gfx942` shows it.


def _verdicts(selection: ab.Selection) -> dict[str, ab.Candidate]:
    return {c.name: c for c in selection.candidates}


def test_selection_on_gfx942_prefers_asm_for_bf16_d128():
    selection = ab.select(spec_of(), platform="rocm:gfx942")
    assert selection.name == "aiter-asm" and selection.source == "priority"
    cands = _verdicts(selection)
    assert cands["aiter-nonasm"].verdict == "eligible" and cands["aiter-nonasm"].priority == 100
    assert cands["torch-sdpa"].verdict == "eligible" and cands["torch-sdpa"].priority == 0
    assert dict(selection.details)["aiter_entry"] == "fmha_v3_varlen_fwd"
    text = selection.explain()
    assert "selected: aiter-asm (by priority)" in text
    assert "eligible  aiter-nonasm" in text


@pytest.mark.parametrize(
    ("spec", "platform", "code"),
    [
        (spec_of(torch.float16), "rocm:gfx942", ab.ReasonCode.DTYPE),
        (spec_of(dim=64, causal=False), "rocm:gfx942", ab.ReasonCode.HEAD_DIM),
        (spec_of(), "rocm:gfx90a", ab.ReasonCode.ARCH),
        (spec_of(torch.float8_e4m3fnuz), "rocm:gfx942", ab.ReasonCode.FP8),
    ],
)
def test_selection_falls_to_nonasm_and_records_why_asm_lost(spec, platform, code):
    selection = ab.select(spec, platform=platform)
    assert selection.name == "aiter-nonasm"
    loser = _verdicts(selection)["aiter-asm"]
    assert loser.verdict == "rejected" and code in {r.code for r in loser.reasons}
    text = selection.explain()
    assert "selected: aiter-nonasm (by priority)" in text
    assert f"[{code.value}]" in text


def test_fp8_in_the_wrong_format_is_refused_by_every_backend():
    with pytest.raises(ab.NoBackendError) as info:
        ab.select(spec_of(torch.float8_e4m3fn), platform="rocm:gfx942")
    reasons = dict(info.value.reasons)
    assert ab.ReasonCode.FP8 in {r.code for r in reasons["aiter-nonasm"]}
    assert "gfx942" in str(info.value)


# The shipped conformance suite, through each backend, on the fake.


class _OnFakeAiter(NoCachePrefillConformance):
    device: ClassVar[str | None] = "cpu"
    platform: ClassVar[ab.Platform | None] = GFX942

    @pytest.fixture(autouse=True)
    def _fake_aiter(self, monkeypatch):
        install(monkeypatch, "gfx942")


class TestAiterAsmConformance(_OnFakeAiter):
    backend_names = ("aiter-asm",)


class TestAiterNonAsmConformance(_OnFakeAiter):
    backend_names = ("aiter-nonasm",)
