"""``torch-varlen`` on CPU: registered, refused where it cannot run, its declarations and
refusals, the signature probe (the installed torch and older parameter lists), the mask mapping,
its rank among the CUDA backends, and its numbers through a CPU stand-in for ``varlen_attn``
(tests/fakes/fake_torch_varlen.py) against the float64 reference, the shipped conformance suite
included, for the current API and for torch 2.11's (no ``enable_gqa``: K/V expanded).
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import pytest
import torch
from attn_backends_builtin import _masks, flashinfer, flex, torch_sdpa, torch_varlen
from attn_backends_builtin.torch_varlen import (
    HEAD_DIMS,
    TorchVarlenBackend,
    VarlenPlan,
    VarlenSignature,
    probe_signature,
    varlen_call,
    varlen_reasons,
    window_size_of,
)

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends.deploy import Registry, clear_selection_cache, get_registry
from attn_backends.testing import NoCachePrefillConformance
from tests.backend_support import (
    check_numbers,
    packed_input,
    reason_codes,
    registry_of,
    spec_of,
)
from tests.fakes.fake_torch_varlen import SIGNATURES, FakeVarlen

SM90 = ab.Platform(kind="cuda", arch="sm90")
CPU = ab.detect_platform("cpu")
LENGTHS = (5, 0, 17, 1, 9)
MAX_WINDOW = 2**31 - 1
CAPS = TorchVarlenBackend.capabilities


def codes(spec: ab.AttentionSpec, platform: ab.Platform | str = "cuda:sm90") -> set[ab.ReasonCode]:
    return reason_codes(TorchVarlenBackend, spec, platform)


CURRENT = probe_signature(SIGNATURES["2.13"])
TORCH_2_11 = probe_signature(SIGNATURES["2.11"])


@pytest.fixture(autouse=True)
def _fresh_decisions():
    """Decisions are cached by request; tests here change what the probe answers."""
    clear_selection_cache()
    yield
    clear_selection_cache()


def use_fake(
    monkeypatch: pytest.MonkeyPatch, release: str = "2.13", signature: VarlenSignature = CURRENT
) -> FakeVarlen:
    """The kernel replaced by the CPU stand-in for ``release``; the probe answers ``signature``."""
    fake = FakeVarlen(release)
    monkeypatch.setattr(torch_varlen, "load_varlen", lambda: fake)
    monkeypatch.setattr(torch_varlen, "installed_signature", lambda: signature)
    return fake


# Registration, and refusal where it cannot run.


def test_torch_varlen_is_registered():
    registry = get_registry()
    record = next(r for r in registry.records() if r.name == "torch-varlen")
    assert record.status == "loaded" and record.backends == ("torch-varlen",), record
    entry = registry.get("torch-varlen")
    assert entry is not None and entry.capabilities is CAPS


def test_on_cpu_it_is_refused_for_the_platform_only():
    for spec in (spec_of(), spec_of(torch.float32), spec_of(logit_softcap=30.0)):
        sel = ab.select(spec, platform=CPU)
        cand = next(c for c in sel.candidates if c.name == "torch-varlen")
        assert cand.verdict == "rejected"
        platform = [r for r in cand.reasons if r.code is ab.ReasonCode.PLATFORM]
        assert len(platform) == 1
        assert platform[0].got == "cpu" and platform[0].allowed == "cuda"
    with pytest.raises(ab.NoBackendError, match="does not run on cpu"):
        ab.select(spec_of(), backend="torch-varlen", device="cpu")


def test_sm75_is_refused_by_architecture():
    assert codes(spec_of(), "cuda:sm75") == {ab.ReasonCode.ARCH}


# Declarations and refusals.


def test_declared_capabilities():
    assert CAPS.platforms == frozenset({"cuda"})
    assert CAPS.dtypes == frozenset({torch.float16, torch.bfloat16})
    assert frozenset({8, 64, 80, 96, 128, 192, 256}) <= HEAD_DIMS
    assert CAPS.head_dims == frozenset(d for d in range(1, 257) if d % 8 == 0) == HEAD_DIMS
    assert CAPS.min_sm == 80 and CAPS.max_sm is None
    assert CAPS.gqa and CAPS.causal and CAPS.bidirectional
    assert not CAPS.needs_contiguous and not CAPS.fused_rope and not CAPS.cuda_graph
    assert CAPS.features == (abp.WindowSupport(), abp.SinkSupport()) and abp.WindowSupport().right
    assert CAPS.requires == ()
    assert not CAPS.fp8


@pytest.mark.parametrize(
    ("spec", "code"),
    [
        (spec_of(logit_softcap=30.0), ab.ReasonCode.SOFTCAP),
        (spec_of(alibi=ab.AlibiSpec()), ab.ReasonCode.ALIBI),
        (spec_of(causal=False, alibi=ab.AlibiSpec()), ab.ReasonCode.ALIBI),
        (spec_of(torch.float8_e4m3fn), ab.ReasonCode.FP8),
        (spec_of(torch.float32), ab.ReasonCode.DTYPE),
        (spec_of(dim=12), ab.ReasonCode.HEAD_DIM),
        (spec_of(dim=264), ab.ReasonCode.HEAD_DIM),
        (spec_of(chunk_size=8), ab.ReasonCode.CHUNKED),
        (spec_of(headwise=ab.HeadwiseConfig(frozenset({0}))), ab.ReasonCode.HEADWISE),
    ],
    ids=[
        "softcap",
        "alibi",
        "alibi-bidir",
        "fp8",
        "fp32",
        "dim12",
        "dim264",
        "chunk",
        "headwise",
    ],
)
def test_undeclared_features_are_refused_with_their_code(spec, code):
    assert code in codes(spec)


@pytest.mark.parametrize(
    "spec",
    [
        spec_of(),
        spec_of(torch.float16, heads=(12, 12), dim=64, causal=False),
        spec_of(dim=96, causal=False, window=ab.SlidingWindow(4, 4)),
        spec_of(dim=8, window=ab.SlidingWindow.causal(8)),
        spec_of(dim=256, causal=False, window=ab.SlidingWindow(0, MAX_WINDOW)),
        spec_of(rope=ab.RopeSpec(1e6), use_logn_attn=True, logn_base=8192),
    ],
)
def test_served_specs_pass_every_check_on_sm80_and_sm90(spec):
    assert codes(spec, "cuda:sm80") == set() and codes(spec, "cuda:sm90") == set()


# The signature probe.


def test_probe_reads_the_installed_torch_once():
    from torch.nn.attention.varlen import varlen_attn

    torch_varlen.installed_signature.cache_clear()
    probed = torch_varlen.installed_signature()
    assert probed == probe_signature(varlen_attn)
    assert torch_varlen.installed_signature() is probed
    release = ".".join(torch.__version__.split(".")[:2])
    if release in SIGNATURES:
        # The stand-in's parameter list is this torch's, name for name, kind and default.
        theirs = [
            (p.name, p.kind, p.default) for p in inspect.signature(varlen_attn).parameters.values()
        ]
        stub = inspect.signature(SIGNATURES[release]).parameters.values()
        assert [(p.name, p.kind, p.default) for p in stub] == theirs
        assert probed == probe_signature(SIGNATURES[release])


def test_probe_of_each_release():
    assert probe_signature(SIGNATURES["2.13"]) == VarlenSignature(
        enable_gqa=True, window_size=True, return_aux=True, is_causal=False, scale=True
    )
    assert probe_signature(SIGNATURES["2.11"]) == VarlenSignature(
        enable_gqa=False, window_size=True, return_aux=True, is_causal=False, scale=True
    )
    assert probe_signature(SIGNATURES["2.10"]) == VarlenSignature(
        enable_gqa=False, window_size=False, return_aux=True, is_causal=True, scale=True
    )


def test_probe_of_a_plain_function_with_the_oldest_parameter_list():
    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        raise AssertionError("never called")

    assert probe_signature(old) == VarlenSignature(
        enable_gqa=False, window_size=False, return_aux=False, is_causal=True, scale=False
    )


def test_no_varlen_module_is_a_library_reason_naming_the_release():
    (reason,) = varlen_reasons(spec_of(), None, "2.9.1")
    assert reason.code is ab.ReasonCode.LIBRARY_MISSING
    assert "this torch (2.9.1) has no torch.nn.attention.varlen" in reason.message
    assert reason.got == "2.9.1" and reason.allowed == ">= 2.10"


def test_without_the_module_selection_refuses_it(monkeypatch):
    monkeypatch.setattr(torch_varlen, "installed_signature", lambda: None)
    sel = ab.select(spec_of(dim=96), platform="cuda:sm90")
    cand = next(c for c in sel.candidates if c.name == "torch-varlen")
    assert [r.code for r in cand.reasons] == [ab.ReasonCode.LIBRARY_MISSING]
    assert sel.name != "torch-varlen"


def test_a_torch_without_window_size_refuses_windows_only():
    old = probe_signature(SIGNATURES["2.10"])
    windowed = spec_of(window=ab.SlidingWindow.causal(8))
    (reason,) = varlen_reasons(windowed, old, "2.10.0")
    assert reason.code is ab.ReasonCode.SLIDING_WINDOW
    assert "torch 2.10.0" in reason.message and "window_size" in reason.message
    assert varlen_reasons(spec_of(), old, "2.10.0") == []
    assert varlen_reasons(spec_of(causal=False), old, "2.10.0") == []
    assert varlen_reasons(windowed, TORCH_2_11, "2.11.0") == []


def test_a_torch_without_scale_refuses_other_scales_only():
    def no_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
        raise AssertionError("never called")

    signature = probe_signature(no_scale)
    assert varlen_reasons(spec_of(), signature, "x") == []
    (reason,) = varlen_reasons(spec_of(softmax_scale=0.5), signature, "x")
    assert reason.code is ab.ReasonCode.BACKEND_SPECIFIC


# The call: mask mapping, keywords, GQA.


@pytest.mark.parametrize(
    ("causal", "window", "expected"),
    [
        (True, None, (-1, 0)),
        (False, None, (-1, -1)),
        (True, ab.SlidingWindow.causal(8), (7, 0)),
        (True, ab.SlidingWindow.causal(1), (0, 0)),
        (True, ab.SlidingWindow(MAX_WINDOW, 0), (MAX_WINDOW, 0)),
        (False, ab.SlidingWindow(4, 4), (4, 4)),
        (False, ab.SlidingWindow(0, 3), (0, 3)),
        (False, ab.SlidingWindow(6, 0), (6, 0)),
        (False, ab.SlidingWindow(1, MAX_WINDOW), (1, MAX_WINDOW)),
        (False, ab.SlidingWindow.modernbert(128), (64, 64)),
    ],
)
def test_window_size_mapping(causal, window, expected):
    spec = spec_of(causal=causal, window=window)
    got = window_size_of(spec)
    assert got == expected and isinstance(got, tuple)
    # The kernel's rule (keys in [i - left, i + right], -1 unbounded) leaves visible exactly
    # what the built-ins' elementwise mask does, on a sequence longer than the window.
    length = 19
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    left, right = got
    kernel = torch.ones(length, length, dtype=torch.bool)
    if left >= 0:
        kernel &= i - j <= left
    if right >= 0:
        kernel &= j - i <= right
    expected_mask = _masks.dense_mask(spec, length, torch.device("cpu"))
    if expected_mask.dim() == 3:
        expected_mask = expected_mask[0]
    assert torch.equal(kernel, expected_mask)


def test_keywords_and_gqa_per_release():
    gqa, mha = spec_of(), spec_of(heads=(8, 8), causal=False)
    current = varlen_call(gqa, CURRENT, "2.13.0")
    assert dict(current.keywords) == {
        "window_size": (-1, 0),
        "scale": gqa.scale,
        "enable_gqa": True,
    }
    assert current.kv_repeat == 1 and "enable_gqa" in current.gqa
    old = varlen_call(gqa, TORCH_2_11, "2.11.0")
    assert dict(old.keywords) == {"window_size": (-1, 0), "scale": gqa.scale}
    assert old.kv_repeat == 4 and "repeat_interleave" in old.gqa and "2.11.0" in old.gqa
    plain = varlen_call(mha, TORCH_2_11, "2.11.0")
    assert dict(plain.keywords) == {"window_size": (-1, -1), "scale": mha.scale}
    assert plain.kv_repeat == 1
    first = varlen_call(gqa, probe_signature(SIGNATURES["2.10"]), "2.10.0")
    assert dict(first.keywords) == {"is_causal": True, "scale": gqa.scale}
    assert varlen_call(mha, probe_signature(SIGNATURES["2.10"]), "2.10.0").keywords == (
        ("scale", mha.scale),
    )


def test_decision_record_says_how_gqa_is_served(monkeypatch):
    monkeypatch.setattr(torch_varlen, "installed_signature", lambda: TORCH_2_11)
    sel = ab.select(spec_of(), backend="torch-varlen", platform="cuda:sm90")
    details = dict(sel.details)
    assert details["kernel"] == "torch.nn.attention.varlen.varlen_attn"
    assert details["input_layout"] == "views"
    assert "repeated 4x" in details["gqa"] and "enable_gqa" in details["gqa"]
    assert "window_size=(-1, 0)" in details["varlen_keywords"]
    assert "torch-varlen" in sel.explain()


# Placement among the CUDA backends (dry runs: libraries assumed installed).


SERVED = [
    spec_of(),
    spec_of(torch.float16, heads=(12, 12), dim=64, causal=False),
    spec_of(heads=(16, 8), rope=ab.RopeSpec(1e6)),
    spec_of(dim=96),
    spec_of(dim=256, causal=False),
    spec_of(window=ab.SlidingWindow.causal(8)),
    spec_of(causal=False, window=ab.SlidingWindow(4, 4)),
]


@pytest.mark.parametrize("platform", ["cuda:sm80", "cuda:sm90"])
@pytest.mark.parametrize("spec", SERVED)
def test_ranks_above_sdpa_and_flex_below_flashinfer(spec, platform):
    sel = ab.select(spec, platform=platform)
    # ranks are places in line (1: tried first)
    rank = {c.name: c.place for c in sel.candidates if c.verdict in ("selected", "eligible")}
    ours = rank["torch-varlen"]
    assert ours is not None
    for later in ("torch-sdpa", "flex"):
        other = rank[later]
        assert other is not None and other > ours, (later, other, ours)
    for earlier in ("flashinfer", "flashinfer-rope"):
        other = rank.get(earlier)
        assert other is None or other < ours, (earlier, other, ours)


@pytest.fixture(scope="module")
def registry() -> Registry:
    """torch-varlen and the built-in backends it is ranked against."""
    return registry_of(
        {
            "torch-sdpa": torch_sdpa,
            "flashinfer": flashinfer,
            "flex": flex,
            "torch-varlen": torch_varlen,
        }
    )


@pytest.mark.parametrize("platform", ["cuda:sm80", "cuda:sm90"])
@pytest.mark.parametrize(
    ("spec", "winner"),
    [
        (spec_of(), "flashinfer"),
        (spec_of(window=ab.SlidingWindow.causal(8)), "flashinfer"),
        (spec_of(dim=96), "torch-varlen"),
        (spec_of(causal=False, window=ab.SlidingWindow(4, 4)), "torch-varlen"),
        (spec_of(causal=False, alibi=ab.AlibiSpec()), "flex"),
        (spec_of(logit_softcap=30.0, causal=False, window=ab.SlidingWindow(4, 4)), "flex"),
        (spec_of(torch.float32), "torch-sdpa"),
    ],
    ids=["plain", "causal-window", "dim96", "window-both-sides", "alibi-bidir", "softcap", "fp32"],
)
def test_winner(registry, spec, winner, platform):
    """flashinfer where it serves; torch-varlen for what it refuses among torch-varlen's specs
    (head dims other than 64/128/256, windows reaching later keys); flex and torch-sdpa for
    what torch-varlen refuses."""
    assert ab.select(spec, platform=platform, registry=registry).name == winner


# Numbers, through the CPU stand-in for varlen_attn.


@pytest.mark.parametrize("release", ["2.13", "2.11"])
@pytest.mark.parametrize(
    ("spec", "lengths"),
    [
        (spec_of(), LENGTHS),
        (spec_of(torch.float16, heads=(4, 4), dim=64, causal=False), LENGTHS),
        (spec_of(causal=False, window=ab.SlidingWindow(3, 2)), LENGTHS),
        (spec_of(dim=64, window=ab.SlidingWindow.causal(4)), LENGTHS),
        (spec_of(dim=96, rope=ab.RopeSpec(1e4)), (1,)),
        (spec_of(dim=64, causal=False), (1, 0, 1, 1)),
    ],
    ids=["gqa-causal", "mha-bidir-fp16", "window-both", "window-causal", "one-token", "ones"],
)
def test_views_go_to_the_kernel_and_match_the_reference(monkeypatch, release, spec, lengths):
    signature = probe_signature(SIGNATURES[release])
    fake = use_fake(monkeypatch, release, signature)
    backend = TorchVarlenBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, lengths, extra=8)
    plan = backend.prepare(params)
    kernel = plan.kernel
    assert isinstance(kernel, VarlenPlan)
    pristine = qkv.clone()
    buffers = [qkv.clone() for _ in range(2)]
    for buf in buffers:
        check_numbers(backend.forward(buf, plan), pristine, spec, params)
    assert len(fake.calls) == 2
    nonempty = [n for n in lengths if n > 0]
    expanded = spec.is_gqa and not signature.enable_gqa
    for call, buf in zip(fake.calls, buffers, strict=True):
        q, k, v = call["query"], call["key"], call["value"]
        assert q.data_ptr() == buf.data_ptr() and q.stride() == (buf.stride(0), spec.head_dim, 1)
        assert q.shape == (params.token_q_num, spec.num_heads, spec.head_dim)
        if expanded:
            assert k.shape[1] == v.shape[1] == spec.num_heads
        else:
            assert k.data_ptr() == buf.data_ptr() + spec.q_width * buf.element_size()
            assert k.shape[1] == spec.num_kv_heads and k.stride(0) == buf.stride(0)
        assert call["cu_seq_q"] is call["cu_seq_k"]
        assert call["cu_seq_q"].tolist() == [0, *torch.tensor(nonempty).cumsum(0).tolist()]
        assert call["max_q"] == call["max_k"] == max(lengths)
        assert call["window_size"] == window_size_of(spec) and call["scale"] == spec.scale
        if release == "2.13":
            assert call["enable_gqa"] is spec.is_gqa


def test_offsets_are_the_params_own_without_empty_sequences(monkeypatch):
    use_fake(monkeypatch)
    backend = TorchVarlenBackend.bind(spec_of(), SM90)
    params, _ = packed_input(spec_of(), (5, 17, 1))
    kernel = backend.prepare(params).kernel
    assert isinstance(kernel, VarlenPlan) and kernel.cu_seqlens is params.cu_seqlens_q


def test_separate_qkv_input(monkeypatch):
    use_fake(monkeypatch)
    spec = spec_of(rope=ab.RopeSpec(1e4))
    backend = TorchVarlenBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, LENGTHS, pad=0)
    pristine = qkv.clone()
    q_w, kv_w = spec.q_width, spec.num_kv_heads * spec.head_dim
    parts = (qkv[:, :q_w], qkv[:, q_w : q_w + kv_w], qkv[:, q_w + kv_w :])
    check_numbers(backend.forward(parts, backend.prepare(params)), pristine, spec, params)


def test_misaligned_rows_are_handed_over_as_an_aligned_copy(monkeypatch):
    fake = use_fake(monkeypatch)
    spec = spec_of(dim=64)
    backend = TorchVarlenBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, (7, 3), pad=0)
    storage = torch.empty(qkv.numel() + 1, dtype=spec.dtype)
    odd = storage[1:].view(qkv.shape)  # base pointer 2 bytes past an aligned one
    odd.copy_(qkv)
    assert not backend.accepts_rows(odd) and backend.accepts_rows(qkv)
    check_numbers(backend.forward(odd, backend.prepare(params)), qkv, spec, params)
    assert fake.calls[-1]["query"].data_ptr() % 16 == 0


# The shipped conformance suite, through the stand-in, as on an sm90 device: the current API,
# and torch 2.11's (GQA by expanding K/V).


class TestFakeTorchVarlenConformance(NoCachePrefillConformance):
    backend_names = ("torch-varlen",)
    device: ClassVar[str | None] = "cpu"
    platform: ClassVar[ab.Platform | None] = SM90

    @pytest.fixture(autouse=True)
    def _fake_varlen(self, monkeypatch: pytest.MonkeyPatch) -> None:
        use_fake(monkeypatch)


class TestFakeTorch211VarlenConformance(NoCachePrefillConformance):
    backend_names = ("torch-varlen",)
    device: ClassVar[str | None] = "cpu"
    platform: ClassVar[ab.Platform | None] = SM90

    @pytest.fixture(autouse=True)
    def _fake_varlen(self, monkeypatch: pytest.MonkeyPatch) -> None:
        use_fake(monkeypatch, "2.11", TORCH_2_11)


def test_a_torch_without_return_aux_refuses_sinks_only():
    """Sinks rescale the output by the kernel's log-sum-exp, which only ``return_aux`` returns."""

    def old(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)
    ):
        raise AssertionError("never called")

    sinks = spec_of(attention_sinks=True)
    (reason,) = varlen_reasons(sinks, probe_signature(old), "2.10.0")
    assert reason.code is ab.ReasonCode.SINKS and "return_aux" in reason.message
    assert varlen_reasons(spec_of(), probe_signature(old), "2.10.0") == []
    assert varlen_reasons(sinks, TORCH_2_11, "2.11.0") == []
