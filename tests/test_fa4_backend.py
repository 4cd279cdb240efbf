"""``fa4`` (FlashAttention-4) on CPU: registered, refused where it cannot run, its declarations
and refusals, the spec -> ``flash_attn_varlen_func`` argument mapping, and its numbers through a
fake ``flash_attn.cute`` (tests/fakes/fake_flash_attn_cute.py) against the float64 reference,
the shipped conformance suite included.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
from typing import ClassVar

import pytest
import torch
from attn_backends_builtin import fa4
from attn_backends_builtin.fa4 import Fa4Backend, Fa4Plan, KernelArguments, kernel_arguments

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends._select._ranking import RANKING
from attn_backends.deploy import get_registry
from attn_backends.errors import BackendFailure
from attn_backends.testing import NoCachePrefillConformance
from tests.backend_support import check_numbers, packed_input, reason_codes, spec_of
from tests.fakes import fake_flash_attn_cute
from tests.fakes.fake_flash_attn_cute import FakeFlashAttnCute, install

SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flash_attn", "fake"),))
LENGTHS = (5, 0, 17, 1, 9)
MAX_WINDOW = 2**31 - 1
CAPS = Fa4Backend.capabilities


def codes(spec: ab.AttentionSpec, platform: ab.Platform | str = "cuda:sm90") -> set[ab.ReasonCode]:
    return reason_codes(Fa4Backend, spec, platform)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashAttnCute:
    return install(monkeypatch)


# Registration, and refusal where it cannot run.


def test_fa4_is_registered():
    registry = get_registry()
    record = next(r for r in registry.records() if r.name == "fa4")
    assert record.status == "loaded" and record.backends == ("fa4",), record
    entry = registry.get("fa4")
    assert entry is not None and entry.capabilities is CAPS


def test_refused_on_cpu_with_structured_reasons():
    bare_cpu = ab.Platform(kind="cpu", libraries=(("flash_attn", None),))
    reasons = Fa4Backend.supports(spec_of(), bare_cpu)
    assert [r.code for r in reasons] == [ab.ReasonCode.PLATFORM, ab.ReasonCode.LIBRARY_MISSING]
    platform, library = reasons
    assert (platform.field, platform.got, platform.allowed) == ("platform", "cpu", "cuda")
    assert library.field == "libraries" and "flash_attn" in library.message
    # On a GPU machine without the library: "not installed" alone.
    bare_gpu = ab.Platform(kind="cuda", arch="sm90", libraries=(("flash_attn", None),))
    assert codes(spec_of(), bare_gpu) == {ab.ReasonCode.LIBRARY_MISSING}


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed here"
)
def test_this_cpu_machine_lists_fa4_and_selects_another():
    spec = spec_of()
    sel = ab.select(spec, device="cpu")
    assert sel.name != "fa4"
    candidate = next(c for c in sel.candidates if c.name == "fa4")
    assert {r.code for r in candidate.reasons} == {
        ab.ReasonCode.PLATFORM,
        ab.ReasonCode.LIBRARY_MISSING,
    }
    with pytest.raises(ab.NoBackendError) as refused:
        ab.select(spec, backend="fa4", device="cpu")
    assert "not swapped" in str(refused.value)


# Declarations.


def test_declared_capabilities():
    assert CAPS.platforms == {"cuda"} and (CAPS.min_sm, CAPS.max_sm) == (90, 110)
    assert CAPS.dtypes == {torch.float16, torch.bfloat16} and not CAPS.fp8
    assert CAPS.head_dims == frozenset(range(8, 257, 8))
    assert len(CAPS.head_dims) == 32 and {8, 40, 128, 136, 256} <= CAPS.head_dims
    assert CAPS.gqa and CAPS.causal and CAPS.bidirectional
    assert not CAPS.needs_contiguous and not CAPS.cuda_graph and not CAPS.fused_rope
    assert CAPS.requires == ("flash_attn",)
    # Both window sides, the soft-cap and sinks; no ALiBi, headwise masks, chunks, MLA or FP8.
    assert CAPS.features == (
        abp.WindowSupport(right=True),
        abp.SoftcapSupport(),
        abp.SinkSupport(),
    )
    assert all(row.backend != "fa4" for row in RANKING), "chosen by name only until verified"
    listed = CAPS.to_dict()
    assert listed["features"] == {
        "window": {"right": True},
        "logit_softcap": {},
        "attention_sinks": {},
    }


@pytest.mark.parametrize(
    ("kw", "platform"),
    [
        ({}, "cuda:sm90"),
        ({"causal": False, "window": ab.SlidingWindow(4, 4)}, "cuda:sm90"),
        ({"window": ab.SlidingWindow.causal(4096), "logit_softcap": 50.0}, "cuda:sm90"),
        ({"dtype": torch.float16, "heads": (12, 12), "dim": 64}, "cuda:sm90"),
        ({"dim": 256}, "cuda:sm90"),
        ({"dim": 192}, "cuda:sm90"),
        ({"dim": 40}, "cuda:sm90"),
        ({"dim": 128}, "cuda:sm100"),
        ({"dim": 256}, "cuda:sm100"),
        ({"dim": 8}, "cuda:sm110"),
    ],
)
def test_served(kw, platform):
    assert codes(spec_of(**kw), platform) == set()


@pytest.mark.parametrize(
    ("kw", "platform", "code"),
    [
        ({"alibi": ab.AlibiSpec()}, "cuda:sm90", ab.ReasonCode.ALIBI),
        ({"alibi": ab.AlibiSpec(), "logit_softcap": 30.0}, "cuda:sm90", ab.ReasonCode.ALIBI),
        ({"dtype": torch.float8_e4m3fn}, "cuda:sm90", ab.ReasonCode.FP8),
        ({"dtype": torch.float8_e4m3fn}, "cuda:sm100", ab.ReasonCode.FP8),
        ({"dtype": torch.float32}, "cuda:sm90", ab.ReasonCode.DTYPE),
        (
            {"headwise": ab.HeadwiseConfig(frozenset({0}), 2, 4, 8)},
            "cuda:sm90",
            ab.ReasonCode.HEADWISE,
        ),
        ({"chunk_size": 8}, "cuda:sm90", ab.ReasonCode.CHUNKED),
        ({"use_mla": True}, "cuda:sm90", ab.ReasonCode.MLA),
        ({"dim": 264}, "cuda:sm90", ab.ReasonCode.HEAD_DIM),
        ({"dim": 100}, "cuda:sm90", ab.ReasonCode.HEAD_DIM),
        ({"dim": 192}, "cuda:sm100", ab.ReasonCode.HEAD_DIM),
        ({"dim": 136}, "cuda:sm110", ab.ReasonCode.HEAD_DIM),
        ({}, "cuda:sm80", ab.ReasonCode.ARCH),
        ({}, "cuda:sm120", ab.ReasonCode.ARCH),
        ({}, "rocm:gfx942", ab.ReasonCode.PLATFORM),
    ],
)
def test_refused_with_its_code(kw, platform, code):
    assert codes(spec_of(**kw), platform) == {code}


def test_softcap_with_alibi_says_alibi_is_not_implemented():
    spec = spec_of(alibi=ab.AlibiSpec(), logit_softcap=30.0)
    (reason,) = Fa4Backend.supports(spec, ab.parse_platform("cuda:sm90"))
    assert reason.code is ab.ReasonCode.ALIBI and "not implemented" in reason.message


def test_blackwell_head_dim_reason_says_what_is_served():
    (reason,) = Fa4Backend.supports(spec_of(dim=160), ab.parse_platform("cuda:sm100"))
    assert (reason.field, reason.got) == ("head_dim", "160")
    assert reason.allowed == "8..128 in steps of 8, or 256"


def test_flashattention_2_is_not_taken_for_flashattention_4():
    try:
        importlib.metadata.version(fa4.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("flash-attn-4 is installed here")
    fa2 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flash_attn", "2.7.4.post1"),))
    (reason,) = Fa4Backend.supports(spec_of(), fa2)
    assert reason.code is ab.ReasonCode.LIBRARY_MISSING
    assert reason.got == "flash_attn 2.7.4.post1" and reason.allowed == "flash-attn-4"
    for version in ("4.0.0b36", "unknown", "fake"):
        present = ab.Platform(kind="cuda", arch="sm90", libraries=(("flash_attn", version),))
        assert codes(spec_of(), present) == set(), version


def test_an_installed_flash_attn_4_whose_cute_does_not_import_is_refused(monkeypatch):
    """Seen on an H200: the wheels installed, the CuTe DSL's ``cutlass.cute`` missing. The
    backend is refused with the import's own error, never selected to fail in prepare()."""
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        return "4.0.0b36" if name == fa4.DISTRIBUTION else real_version(name)

    def broken(name: str, *args: object) -> object:
        raise ModuleNotFoundError("No module named 'cutlass.cute'")

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib, "import_module", broken)
    fa4.cute_import_failure.cache_clear()
    try:
        real = ab.Platform(kind="cuda", arch="sm90", libraries=(("flash_attn", "4.0.0b36"),))
        (reason,) = Fa4Backend.supports(spec_of(), real)
        assert reason.code is ab.ReasonCode.LIBRARY_MISSING
        assert reason.got == "ModuleNotFoundError: No module named 'cutlass.cute'"
        assert "CuTe DSL" in reason.message
        # a dry run (platform="cuda:sm90") assumes the libraries and imports nothing
        assert codes(spec_of(), "cuda:sm90") == set()
    finally:
        fa4.cute_import_failure.cache_clear()


def test_decision_record_names_the_kernel():
    sel = ab.select(spec_of(), backend="fa4", platform="cuda:sm90")
    details = dict(sel.details)
    assert details["kernel"] == "flash_attn.cute.flash_attn_varlen_func"
    assert details["input_layout"] == "views" and details["flash_attn"] == "assumed"
    assert "first use" in details["compile"]


def test_graph_mode_is_not_declared():
    with pytest.raises(ab.NoBackendError) as refused:
        ab.select(spec_of(), backend="fa4", platform="cuda:sm90", cuda_graph=True)
    codes_given = {r.code for _, rs in refused.value.reasons for r in rs}
    assert codes_given == {ab.ReasonCode.CUDA_GRAPH}


def test_not_ranked_so_chosen_by_name_only():
    """Unverified on hardware: never the default, even where only it and the fallbacks fit."""
    spec = spec_of(causal=False, window=ab.SlidingWindow(4, 4))  # flashinfer refuses right > 0
    default = ab.select(spec, platform="cuda:sm90")
    assert default.name != "fa4"
    fa4_candidate = next(c for c in default.candidates if c.name == "fa4")
    assert fa4_candidate.verdict == "not ranked" and fa4_candidate.place is None
    assert [r.code for r in fa4_candidate.reasons] == [ab.ReasonCode.NOT_RANKED]
    assert ab.select(spec, backend="fa4", platform="cuda:sm90").name == "fa4"


# The argument mapping, by hand.


@pytest.mark.parametrize(
    ("kw", "max_seqlen", "expected"),
    [
        ({}, 32, KernelArguments(128**-0.5, True, (None, None), 0.0)),
        ({"causal": False}, 32, KernelArguments(128**-0.5, False, (None, None), 0.0)),
        (
            {"softmax_scale": 0.3, "logit_softcap": 30.0},
            5,
            KernelArguments(0.3, True, (None, None), 30.0),
        ),
        # Mistral's sliding_window=8: eight keys, the query's own included.
        ({"window": ab.SlidingWindow.causal(8)}, 32, KernelArguments(128**-0.5, True, (7, 0), 0.0)),
        (
            {"causal": False, "window": ab.SlidingWindow(4, 4)},
            32,
            KernelArguments(128**-0.5, False, (4, 4), 0.0),
        ),
        # ModernBERT local_attention=128: |i - j| <= 64.
        (
            {"causal": False, "window": ab.SlidingWindow.modernbert(128), "dim": 64},
            300,
            KernelArguments(0.125, False, (64, 64), 0.0),
        ),
        # Sides past the longest sequence are capped at its largest distance (int32 safety).
        (
            {"window": ab.SlidingWindow(MAX_WINDOW, 0)},
            17,
            KernelArguments(128**-0.5, True, (16, 0), 0.0),
        ),
        (
            {"causal": False, "window": ab.SlidingWindow(1, MAX_WINDOW)},
            40,
            KernelArguments(128**-0.5, False, (1, 39), 0.0),
        ),
        (
            {"causal": False, "window": ab.SlidingWindow(0, 3)},
            1,
            KernelArguments(128**-0.5, False, (0, 0), 0.0),
        ),
    ],
)
def test_kernel_arguments(kw, max_seqlen, expected):
    assert kernel_arguments(spec_of(**kw), max_seqlen) == expected


def test_window_semantics_match_the_fakes_reading_of_fa4():
    """The mapped window, as FA4 resolves it, is the spec's window: causal-local for a causal
    spec, local for a bidirectional one, never silently dropped."""
    causal = kernel_arguments(spec_of(window=ab.SlidingWindow.causal(8)), 32)
    assert fake_flash_attn_cute.resolve_window(causal.causal, *causal.window_size) == (
        False,
        True,
        7,
        0,
    )
    both = kernel_arguments(spec_of(causal=False, window=ab.SlidingWindow(4, 2)), 32)
    assert fake_flash_attn_cute.resolve_window(both.causal, *both.window_size) == (
        False,
        True,
        4,
        2,
    )
    plain = kernel_arguments(spec_of(), 32)
    assert fake_flash_attn_cute.resolve_window(plain.causal, *plain.window_size) == (
        True,
        False,
        None,
        None,
    )


# Through the fake: one plan per batch, views in, the reference's numbers out.


def test_plans_once_per_batch_and_runs_on_views(fake):
    spec = spec_of(window=ab.SlidingWindow.causal(6), logit_softcap=20.0)
    backend = Fa4Backend.bind(spec, SM90)
    params, qkv = packed_input(spec, LENGTHS)
    plan = backend.prepare(params)
    kernel = plan.kernel
    assert isinstance(kernel, Fa4Plan)
    assert kernel.cu_seqlens is params.cu_seqlens_q, "int32 already: no per-batch copy"
    buffers = [qkv.clone() for _ in range(3)]
    for buf in buffers:
        check_numbers(backend.forward(buf, plan), qkv, spec, params)
    assert len(fake.calls) == 3
    for call, buf in zip(fake.calls, buffers, strict=True):
        a = call.args
        assert a["cu_seqlens_q"] is kernel.cu_seqlens and a["cu_seqlens_k"] is kernel.cu_seqlens
        assert a["cu_seqlens_q"].tolist() == [0, 5, 5, 22, 23, 32]
        assert a["max_seqlen_q"] == a["max_seqlen_k"] == 17
        assert a["softmax_scale"] == spec.scale and a["causal"] is True
        assert a["window_size"] == (5, 0) and a["softcap"] == 20.0
        assert a["learnable_sink"] is None and a["score_mod"] is None
        assert not a["return_lse"] and a["num_splits"] == 1
        q, k, v = a["q"], a["k"], a["v"]
        for t in (q, k, v):
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert t.stride() == (spec.qkv_width, spec.head_dim, 1)
        assert q.shape == (32, 8, 128) and k.shape == v.shape == (32, 2, 128)
        assert call.copied == (), "aligned views: FA4 reads them in place"


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": False},
        {"heads": (4, 4), "dim": 64, "dtype": torch.float16},
        {"window": ab.SlidingWindow.causal(4)},
        {"causal": False, "window": ab.SlidingWindow(3, 5)},
        {"causal": False, "window": ab.SlidingWindow(0, MAX_WINDOW)},
        {"logit_softcap": 2.0},
        {"causal": False, "logit_softcap": 5.0, "window": ab.SlidingWindow(6, 2)},
        {"rope": ab.RopeSpec(1e4), "softmax_scale": 0.2},
        {"dim": 256},
    ],
)
def test_numbers_match_the_reference(fake, kw):
    spec = spec_of(**kw)
    backend = Fa4Backend.bind(spec, SM90)
    params, qkv = packed_input(spec, LENGTHS, extra=8)
    pristine = qkv.clone()
    out = backend.forward(qkv, backend.prepare(params))
    assert out.shape == (params.token_q_num, spec.num_heads * spec.head_dim)
    assert out.dtype == spec.dtype
    check_numbers(out, pristine, spec, params)
    (call,) = fake.calls
    assert call.args["q"].stride(0) == spec.qkv_width + 16 and call.copied == ()


def test_runs_on_blackwell_head_dims(monkeypatch):
    fake = install(monkeypatch, arch=100)
    sm100 = ab.Platform(kind="cuda", arch="sm100", libraries=(("flash_attn", "fake"),))
    for dim in (64, 256):
        spec = spec_of(dim=dim, causal=False)
        backend = Fa4Backend.bind(spec, sm100)
        params, qkv = packed_input(spec, (4, 11))
        check_numbers(backend.forward(qkv.clone(), backend.prepare(params)), qkv, spec, params)
    assert len(fake.calls) == 2


def test_offsets_built_otherwise_are_made_int32_once():
    params = ab.FMHAParams.from_lengths((3, 4), device="cpu")
    wide = torch.tensor([0, 0, 3, 3, 7, 7])[::2]  # int64, stride 2
    odd = dataclasses.replace(params, cu_seqlens_q=wide)
    cu = fa4._int32_offsets(odd)
    assert cu.dtype == torch.int32 and cu.stride(0) == 1 and cu.tolist() == [0, 3, 7]
    assert fa4._int32_offsets(params) is params.cu_seqlens_q


def test_a_plan_from_elsewhere_is_refused(fake):
    spec = spec_of()
    backend = Fa4Backend.bind(spec, SM90)
    params, _ = packed_input(spec, (3,))
    foreign = dataclasses.replace(backend.prepare(params), kernel=object())
    q, k, v = (torch.zeros(3, heads, 128, dtype=spec.dtype) for heads in (8, 2, 2))
    views = abp.QKVViews(None, q, k, v)
    with pytest.raises(BackendFailure, match="did not make"):
        backend.attend(views, foreign)


# The fake itself: it asserts what FA4 asserts.


def _fake_inputs(dtype: torch.dtype = torch.bfloat16, dim: int = 128) -> dict[str, object]:
    q = torch.randn(7, 4, dim).to(dtype)
    k = torch.randn(7, 2, dim).to(dtype)
    v = torch.randn(7, 2, dim).to(dtype)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 4}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"cu_seqlens_q": torch.tensor([0, 3, 7])}, AssertionError),  # int64
        (
            {"cu_seqlens_k": torch.tensor([0, 0, 3, 3, 7, 7], dtype=torch.int32)[::2]},
            AssertionError,
        ),
        ({"learnable_sink": torch.zeros(2)}, AssertionError),  # [Hkv], not [H]
        ({"learnable_sink": torch.zeros(4, dtype=torch.float64)}, AssertionError),
        ({"softcap": 5.0, "score_mod": lambda *a: a[0]}, AssertionError),
        ({"max_seqlen_q": 3}, RuntimeError),
        ({"qv": torch.zeros(1)}, NotImplementedError),
        ({"no_such_keyword": 1}, TypeError),
    ],
)
def test_fake_asserts_the_interface_rules(fake, change, error):
    with pytest.raises(error):
        fake.flash_attn_varlen_func(**{**_fake_inputs(), **change})


@pytest.mark.parametrize(
    ("arch", "dim", "ok"),
    [(90, 256, True), (90, 264, False), (100, 192, False), (100, 256, True), (90, 100, False)],
)
def test_fake_checks_head_dims_per_arch(monkeypatch, arch, dim, ok):
    fake = install(monkeypatch, arch=arch)
    inputs = _fake_inputs(dim=dim)
    if ok:
        fake.flash_attn_varlen_func(**inputs)
    else:
        with pytest.raises(AssertionError):
            fake.flash_attn_varlen_func(**inputs)


def test_fake_refuses_fp32_and_fp8_on_hopper(fake):
    with pytest.raises(AssertionError):
        fake.flash_attn_varlen_func(**_fake_inputs(torch.float32))
    with pytest.raises(AssertionError):
        fake.flash_attn_varlen_func(**_fake_inputs(torch.float8_e4m3fn))


def test_fake_records_the_copies_fa4_would_make(fake):
    inputs = _fake_inputs()
    wide = torch.randn(7, 4 * 128 + 1).to(torch.bfloat16)
    inputs["q"] = wide[:, 1:].view(7, 4, 128)  # base 2 bytes past an aligned address
    fake.flash_attn_varlen_func(**inputs)
    assert fake.calls[-1].copied == ("q",)


def test_fake_sink_is_one_more_softmax_column_without_a_value(fake):
    """``learnable_sink``: natural-log logit, not scaled, added to each row's denominator."""
    q = torch.zeros(2, 1, 8, dtype=torch.float16)
    k = torch.zeros(2, 1, 8, dtype=torch.float16)
    v = torch.tensor([[1.0], [3.0]]).expand(2, 8).reshape(2, 1, 8).to(torch.float16)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    sink = torch.tensor([0.0])
    out, lse = fake.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, learnable_sink=sink, return_lse=True
    )
    # Bidirectional, all scores 0: weights 1/3 each for the two keys and the sink.
    assert torch.allclose(out[:, 0, 0].float(), torch.tensor([4 / 3, 4 / 3]), atol=1e-3)
    assert torch.allclose(lse[0], torch.log(torch.tensor([3.0, 3.0])))


def test_fake_signature_matches_real_fa4():
    try:
        real = importlib.import_module("flash_attn.cute")
    except Exception as exc:  # not installed, or no CUDA stack to import it with
        pytest.skip(f"flash_attn.cute cannot be imported here: {type(exc).__name__}")
    theirs = [
        (p.name, p.kind, p.default)
        for p in inspect.signature(real.flash_attn_varlen_func).parameters.values()
    ]
    ours = [
        (p.name, p.kind, p.default)
        for p in inspect.signature(fake_flash_attn_cute.SIGNATURE).parameters.values()
    ]
    assert ours == theirs


# The shipped conformance suite, through the fake, as on an sm90 device.


class TestFakeFa4Conformance(NoCachePrefillConformance):
    backend_names = ("fa4",)
    device: ClassVar[str | None] = "cpu"
    platform: ClassVar[ab.Platform | None] = SM90

    @pytest.fixture(autouse=True)
    def _fake_flash_attn(self, monkeypatch: pytest.MonkeyPatch) -> None:
        install(monkeypatch)
