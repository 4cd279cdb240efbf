"""``flashinfer``, ``flashinfer-rope`` and ``trt`` on a fake flashinfer, headwise (flex) for real,
all on CPU.

The fake (tests/fakes/fake_flashinfer.py) has flashinfer's signatures and checks and computes
with torch, so every test compares numbers with the float64 reference, and the recorded calls
show what the backends hand the library: one plan per batch, views or dense rows, dtypes,
masks, the fa2/fa3 choice.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from attn_backends_builtin import _flashinfer_common, flex, headwise
from attn_backends_builtin import flashinfer as flashinfer_plugin
from attn_backends_builtin.flashinfer import FlashinferBackend, FlashinferRopeBackend, RaggedPlan
from attn_backends_builtin.trt import TrtBackend, trt_mask_mode

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends._select._ranking import RANKING
from attn_backends.deploy import get_registry
from attn_backends.reference import TOLERANCE, relative_error
from attn_backends.testing import NoCachePrefillConformance
from tests.fakes import fake_flashinfer
from tests.fakes.fake_flashinfer import FakeFlashinfer, install

SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))
INIT = "BatchPrefillWithRaggedKVCacheWrapper.__init__"
PLAN = "BatchPrefillWithRaggedKVCacheWrapper.plan"
RUN = "BatchPrefillWithRaggedKVCacheWrapper.run"
TRT = "prefill.trtllm_fmha_v2_prefill"
LENGTHS = (5, 0, 17, 1, 9)


def spec_of(
    dtype: torch.dtype = torch.bfloat16,
    heads: tuple[int, int] = (8, 2),
    dim: int = 128,
    causal: bool = True,
    rope: ab.RopeSpec | None = None,
    **kw: object,
) -> ab.AttentionSpec:
    return ab.AttentionSpec(heads[0], heads[1], dim, dtype, causal, rope=rope, **kw)  # type: ignore[arg-type]


def packed_input(
    spec: ab.AttentionSpec, lengths: tuple[int, ...], pad: int = 3, seed: int = 0
) -> tuple[ab.FMHAParams, torch.Tensor]:
    tokens = sum(lengths)
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=tokens + pad)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens + pad, spec.qkv_width, generator=gen).to(spec.dtype)
    return params, qkv


def check_numbers(out: torch.Tensor, pristine: torch.Tensor, spec, params) -> None:
    ref = ab.reference_attention(pristine, spec, params)
    err = relative_error(out, ref)
    assert err < TOLERANCE[spec.dtype], f"relative error {err:.3g}"


def run_layers(backend, spec, params, qkv, layers: int = 1) -> list[torch.Tensor]:
    """``layers`` forwards on fresh copies of ``qkv`` with one plan; each checked numerically."""
    plan = backend.prepare(params)
    outs = []
    for _ in range(layers):
        buf = qkv.clone()
        out = backend.forward(buf, plan)
        check_numbers(out, qkv, spec, params)
        outs.append(out)
    return outs


@pytest.fixture
def fake(monkeypatch) -> FakeFlashinfer:
    return install(monkeypatch)


@pytest.fixture
def sm90(monkeypatch) -> None:
    """The fake runs on CPU tensors; make the backends plan as on an sm90 device."""
    monkeypatch.setattr(flashinfer_plugin, "device_sm", lambda device: 90)


# Registration and declared capabilities.


def test_plugins_register_their_backends():
    registry = get_registry()
    for plugin, names in (
        ("flashinfer", {"flashinfer", "flashinfer-rope"}),
        ("trt", {"trt"}),
        ("headwise", {"headwise"}),
    ):
        record = next(r for r in registry.records() if r.name == plugin)
        assert record.status == "loaded" and set(record.backends) == names, record
    caps = registry.get("flashinfer-rope")
    assert caps is not None and caps.backend.capabilities.fused_rope
    assert not TrtBackend.capabilities.gqa and TrtBackend.capabilities.max_sm == 90


def test_fake_signatures_match_real_flashinfer():
    try:
        real = importlib.import_module("flashinfer.prefill")
    except ImportError:
        pytest.skip("flashinfer is not installed")
    wrapper = real.BatchPrefillWithRaggedKVCacheWrapper
    objects: dict[str, Callable[..., Any]] = {
        INIT: wrapper.__init__,
        PLAN: wrapper.plan,
        RUN: wrapper.run,
        TRT: real.trtllm_fmha_v2_prefill,
    }
    version = importlib.metadata.version("flashinfer-python")
    known = fake_flashinfer.SIGNATURES_BY_VERSION
    assert version in known, (
        f"flashinfer {version} is installed; the fake has parameter lists for "
        f"{', '.join(known)}: add this release's (tests/fakes/fake_flashinfer.py) or install one"
    )
    for name, stub in known[version].items():
        theirs = [
            (p.name, p.kind, p.default)
            for p in inspect.signature(objects[name]).parameters.values()
        ]
        ours = [(p.name, p.kind, p.default) for p in inspect.signature(stub).parameters.values()]
        assert ours == theirs, name


# The fa2/fa3 decision, as data and in the decision record.


@pytest.mark.parametrize(
    ("sm", "dim", "fused", "expected"),
    [
        (90, 128, False, "fa3"),
        (90, 64, False, "fa3"),
        (90, 256, False, "fa3"),
        (90, 128, True, "fa2"),
        (80, 128, False, "fa2"),
        (100, 128, False, "fa2"),
        (None, 128, False, "fa2"),
    ],
)
def test_choose_kernel(sm, dim, fused, expected):
    choice = _flashinfer_common.choose_kernel(spec_of(dim=dim), sm, fused)
    assert choice.backend == expected and choice.reason


def test_kernel_choice_is_in_the_decision_record():
    rope = ab.RopeSpec(1e6)
    plain = ab.select(spec_of(rope=rope), backend="flashinfer", platform="cuda:sm90")
    details = dict(plain.details)
    assert details["flashinfer_backend"] == "fa3" and details["pos_encoding_mode"] == "NONE"
    assert details["preprocess"] not in ("fused", "none") and details["input_layout"] == "views"
    assert "flashinfer_backend=fa3" in plain.explain()
    fused = dict(
        ab.select(spec_of(rope=rope), backend="flashinfer-rope", platform="cuda:sm90").details
    )
    limit = FlashinferRopeBackend.capabilities.fused_rope_max_seqlen
    assert fused["flashinfer_backend"] == f"fa2 for batches of max_seqlen <= {limit}, else fa3"
    assert fused["pos_encoding_mode"] == f"ROPE_LLAMA for max_seqlen <= {limit}, else NONE"
    assert fused["preprocess"] == f"fused for batches of max_seqlen <= {limit}, else native"
    assert "RoPE" in fused["flashinfer_backend_reason"]
    interleaved = dict(
        ab.select(
            spec_of(rope=ab.RopeSpec(1e4, interleaved=True)),
            backend="flashinfer-rope",
            platform="cuda:sm90",
        ).details
    )
    assert interleaved["flashinfer_backend"] == "fa3"
    assert interleaved["preprocess"] not in ("fused", "none")
    ampere = dict(ab.select(spec_of(), backend="flashinfer", platform="cuda:sm80").details)
    assert ampere["flashinfer_backend"] == "fa2" and "sm80" in ampere["flashinfer_backend_reason"]
    trt = dict(
        ab.select(spec_of(heads=(4, 4), dim=64), backend="trt", platform="cuda:sm90").details
    )
    assert trt["kernel_source"] == "flashinfer.trtllm_fmha_v2_prefill"
    assert trt["input_layout"] == "dense-packed" and trt["native_tensorrt_llm"] == "not implemented"


# The ranking (H200 measurements): flashinfer-rope for RoPE it can fuse on sm90, flashinfer
# elsewhere (trt ranks below it: never faster there), flex for headwise.


@pytest.mark.parametrize(
    ("spec", "platform", "winner"),
    [
        (spec_of(heads=(12, 12), dim=64, causal=False), "cuda:sm90", "flashinfer"),
        (spec_of(heads=(12, 12), dim=64, causal=True), "cuda:sm90", "flashinfer"),
        (spec_of(heads=(16, 16), dim=128, causal=False), "cuda:sm90", "flashinfer"),
        (spec_of(heads=(16, 8), rope=ab.RopeSpec(1e6)), "cuda:sm90", "flashinfer-rope"),
        (spec_of(heads=(16, 8), rope=ab.RopeSpec(1e6)), "cuda:sm80", "flashinfer"),
        (
            spec_of(heads=(16, 8), rope=ab.RopeSpec(1e6, interleaved=True)),
            "cuda:sm90",
            "flashinfer",
        ),
        (spec_of(heads=(16, 8), rope=ab.RopeSpec(1e6, rotary_dim=64)), "cuda:sm90", "flashinfer"),
        (spec_of(heads=(12, 12), dim=64, causal=False), "cuda:sm80", "flashinfer"),
        (spec_of(dtype=torch.float32), "cuda:sm90", "torch-sdpa"),
        (spec_of(headwise=ab.HeadwiseConfig(frozenset({0}))), "cuda:sm90", "flex"),
        (spec_of(headwise=ab.HeadwiseConfig(frozenset({0}))), "cpu", "flex"),
    ],
)
def test_ranking_picks(spec, platform, winner):
    assert ab.select(spec, platform=platform).name == winner


# flashinfer: one plan per batch, views per layer, workspace reused.


def test_flashinfer_plans_once_per_batch_and_runs_on_views(fake, sm90):
    spec = spec_of(torch.bfloat16, causal=True)
    backend = FlashinferBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, LENGTHS)
    plan = backend.prepare(params)
    buffers = [qkv.clone() for _ in range(3)]
    for buf in buffers:
        check_numbers(backend.forward(buf, plan), qkv, spec, params)
    assert len(fake.named(INIT)) == 1 and len(fake.named(PLAN)) == 1
    init = fake.named(INIT)[0].args
    assert init["backend"] == "fa3" and init["kv_layout"] == "NHD"
    assert init["float_workspace_buffer"].numel() == 128 << 20
    a = fake.named(PLAN)[0].args
    for name in ("qo_indptr", "kv_indptr"):
        indptr = a[name]
        assert indptr.device.type == "cpu" and indptr.dtype == torch.int32
        assert indptr.tolist() == [0, 5, 22, 23, 32]  # the empty sequence is dropped
    assert (a["num_qo_heads"], a["num_kv_heads"], a["head_dim_qk"], a["head_dim_vo"]) == (
        8,
        2,
        128,
        128,
    )
    assert a["causal"] is True and a["sm_scale"] == spec.scale
    assert a["q_data_type"] == a["kv_data_type"] == a["o_data_type"] == torch.bfloat16
    assert a["pos_encoding_mode"] == "NONE" and a["rope_theta"] is None
    runs = fake.named(RUN)
    assert len(runs) == 3
    for run, buf in zip(runs, buffers, strict=True):
        q, k, v, out = (run.args[n] for n in ("q", "k", "v", "out"))
        for t in (q, k, v):
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert t.stride() == (spec.qkv_width, spec.head_dim, 1)
        assert q.data_ptr() == buf.data_ptr() and q.shape == (32, 8, 128)
        assert k.data_ptr() == buf.data_ptr() + spec.q_width * buf.element_size()
        assert out is None, "the kernel allocates the output: nothing else is allocated"
    # A second batch while the first plan is alive: a wrapper of its own, the same workspace.
    params2, qkv2 = packed_input(spec, (7, 3), seed=1)
    plan2 = backend.prepare(params2)
    assert len(fake.named(INIT)) == 2 and len(fake.named(PLAN)) == 2
    second = fake.named(INIT)[1].args["float_workspace_buffer"]
    assert second is init["float_workspace_buffer"]
    check_numbers(backend.forward(qkv.clone(), plan), qkv, spec, params)
    check_numbers(backend.forward(qkv2.clone(), plan2), qkv2, spec, params2)
    # Dropped plans give their wrappers back: later batches reuse them.
    del plan, plan2
    gc.collect()
    run_layers(backend, spec, params2, qkv2)
    run_layers(backend, spec, params, qkv)
    assert len(fake.named(INIT)) == 2 and len(fake.named(PLAN)) == 4


@pytest.mark.parametrize("causal", [True, False])
def test_flashinfer_mask_and_scale_reach_the_plan(fake, sm90, causal):
    spec = spec_of(torch.float16, heads=(4, 4), dim=64, causal=causal, softmax_scale=0.2)
    backend = FlashinferBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, (9, 4))
    run_layers(backend, spec, params, qkv)
    a = fake.named(PLAN)[0].args
    assert a["causal"] is causal and a["sm_scale"] == 0.2
    assert a["q_data_type"] == torch.float16


def test_flashinfer_rope_fuses_rope_only_when_the_kernel_can(fake, sm90):
    theta = 1e6
    spec = spec_of(rope=ab.RopeSpec(theta))
    backend = FlashinferRopeBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, LENGTHS)
    buf = qkv.clone()
    plan = backend.prepare(params)
    assert plan.preprocess == "fused"
    check_numbers(backend.forward(buf, plan), qkv, spec, params)
    assert torch.equal(buf, qkv), "the fused path must not rotate the buffer"
    init, a = fake.named(INIT)[-1].args, fake.named(PLAN)[-1].args
    assert init["backend"] == "fa2"
    assert a["pos_encoding_mode"] == "ROPE_LLAMA" and a["rope_theta"] == theta
    assert a["rope_scale"] == 1.0

    cases: list[tuple[ab.RopeSpec, dict[str, Any]]] = [
        (ab.RopeSpec(1e4, interleaved=True), {}),
        (ab.RopeSpec(1e4, rotary_dim=64), {}),
        (ab.RopeSpec(1e4), {"use_logn_attn": True, "logn_base": 8}),
    ]
    for rope, extra in cases:
        other = spec_of(rope=rope, **extra)
        backend = FlashinferRopeBackend.bind(other, SM90)
        params, qkv = packed_input(other, LENGTHS)
        assert backend.prepare(params).preprocess == "torch"
        run_layers(backend, other, params, qkv)
        assert fake.named(INIT)[-1].args["backend"] == "fa3"
        assert fake.named(PLAN)[-1].args["pos_encoding_mode"] == "NONE"


def test_flashinfer_rope_fuses_short_batches_and_runs_long_ones_separately(fake, sm90):
    """Per batch: fa2 with ROPE_LLAMA up to the crossover length, the separate pass and fa3
    beyond it; both plans stay valid side by side."""
    spec = spec_of(rope=ab.RopeSpec(1e6))
    limit = FlashinferRopeBackend.capabilities.fused_rope_max_seqlen
    assert limit is not None
    backend = FlashinferRopeBackend.bind(spec, SM90)
    short_params, short_qkv = packed_input(spec, (limit, 3, 1))
    long_params, long_qkv = packed_input(spec, (limit + 1, 5), seed=1)

    short_plan = backend.prepare(short_params)
    assert short_plan.preprocess == "fused"
    buf = short_qkv.clone()
    check_numbers(backend.forward(buf, short_plan), short_qkv, spec, short_params)
    assert torch.equal(buf, short_qkv), "fused: the buffer is not rotated"
    assert fake.named(INIT)[-1].args["backend"] == "fa2"
    assert fake.named(PLAN)[-1].args["pos_encoding_mode"] == "ROPE_LLAMA"

    long_plan = backend.prepare(long_params)
    assert long_plan.preprocess == "torch"  # the separate pass (torch on the fake's CPU tensors)
    buf = long_qkv.clone()
    check_numbers(backend.forward(buf, long_plan), long_qkv, spec, long_params)
    assert not torch.equal(buf, long_qkv), "separate pass: RoPE applied in place"
    assert fake.named(INIT)[-1].args["backend"] == "fa3"
    assert fake.named(PLAN)[-1].args["pos_encoding_mode"] == "NONE"
    assert len(fake.named(INIT)) == 2, "one wrapper per live plan"

    check_numbers(backend.forward(short_qkv.clone(), short_plan), short_qkv, spec, short_params)
    del short_plan
    gc.collect()
    again = backend.prepare(short_params)
    check_numbers(backend.forward(short_qkv.clone(), again), short_qkv, spec, short_params)
    assert len(fake.named(INIT)) == 2, "the dropped plan's fa2 wrapper served the new one"


def test_fa3_would_ignore_fused_rope_so_it_is_never_asked(fake, sm90):
    """The fake, like flashinfer, drops ROPE_LLAMA on fa3: the choice above is what keeps the
    numbers right."""
    spec = spec_of(rope=ab.RopeSpec(1e4))
    params, qkv = packed_input(spec, (12, 6))
    wrapper = fake.modules()[0].BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(16, dtype=torch.uint8), backend="fa3"
    )
    indptr = torch.tensor([0, 12, 18], dtype=torch.int32)
    wrapper.plan(
        indptr,
        indptr,
        8,
        2,
        128,
        causal=True,
        pos_encoding_mode="ROPE_LLAMA",
        rope_theta=1e4,
        q_data_type=torch.bfloat16,
    )
    q, k, v = ab.split_views(qkv, spec, 18)
    out = wrapper.run(q, k, v).reshape(18, spec.q_width)
    ref = ab.reference_attention(qkv, spec, params)
    assert relative_error(out, ref) > 0.1


@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-rope", "trt"])
def test_plans_are_values_whatever_is_prepared_meanwhile(fake, sm90, name):
    """Two callers with the same spec (one `select` decision) and batches in flight together:
    every plan stays valid, in any order of forwards."""
    rope = ab.RopeSpec(1e4) if name == "flashinfer-rope" else None
    spec = spec_of(heads=(4, 4), dim=64, rope=rope) if name == "trt" else spec_of(rope=rope)
    first = ab.select(spec, backend=name, platform=SM90).backend
    second = ab.select(spec, backend=name, platform=SM90).backend
    batches = [
        packed_input(spec, lengths, seed=i)
        for i, lengths in enumerate([(6, 2), (3, 9, 1), (300, 4)])
    ]
    plans = [
        (b.prepare(params), params, qkv)
        for b, (params, qkv) in zip((first, second, first), batches, strict=True)
    ]
    if name != "trt":
        kernels = [plan.kernel for plan, _, _ in plans]
        assert all(isinstance(k, RaggedPlan) for k in kernels)
        assert len({id(k.wrapper) for k in kernels if isinstance(k, RaggedPlan)}) == 3
    for plan, params, qkv in [*reversed(plans), *plans]:
        check_numbers(first.forward(qkv.clone(), plan), qkv, spec, params)
        check_numbers(second.forward(qkv.clone(), plan), qkv, spec, params)


@pytest.mark.parametrize("name", ["flashinfer", "trt"])
def test_misaligned_rows_are_copied_once_not_read_wrongly(fake, sm90, name):
    spec = spec_of(heads=(4, 4), dim=64, causal=False)
    backend = (FlashinferBackend if name == "flashinfer" else TrtBackend).bind(spec, SM90)
    params, qkv = packed_input(spec, (7, 5), pad=0)
    flat = torch.empty(qkv.numel() + 1, dtype=qkv.dtype)
    shifted = flat[1:].view(qkv.shape)  # two bytes past an aligned address
    shifted.copy_(qkv)
    assert not _flashinfer_common.is_aligned(shifted)
    out = backend.forward(shifted, backend.prepare(params))
    check_numbers(out, qkv, spec, params)
    kernel_input = fake.calls[-1].args["q" if name == "flashinfer" else "qkv"]
    assert kernel_input.data_ptr() % 16 == 0


# trt: dense packed rows, mask names, metadata on the device.


def test_trt_gets_dense_packed_rows_without_a_copy(fake):
    spec = spec_of(torch.float16, heads=(4, 4), dim=64, causal=False)
    backend = TrtBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, LENGTHS)
    buf = qkv.clone()
    check_numbers(backend.forward(buf, backend.prepare(params)), qkv, spec, params)
    a = fake.named(TRT)[0].args
    rows = a["qkv"]
    assert rows.data_ptr() == buf.data_ptr() and rows.shape == (32, 3, 4, 64)
    assert rows.is_contiguous()
    assert a["input_layout"] == "PACKED_QKV" and a["mask_mode"] == "padding"
    assert a["bmm1_scale"] == spec.scale and a["bmm2_scale"] == 1.0
    assert a["batch_size"] == 4 and a["max_q_len"] == a["max_kv_len"] == 17
    assert a["cum_seq_lens_q"].tolist() == [0, 5, 22, 23, 32]
    assert a["seq_lens"].tolist() == [5, 17, 1, 9]
    assert a["cum_seq_lens_q"].dtype == torch.int32
    assert a["out"].shape == (32, 4, 64) and a["out"].is_contiguous()


def test_trt_copies_a_strided_buffer_once(fake):
    spec = spec_of(torch.bfloat16, heads=(4, 4), dim=64, causal=True)
    backend = TrtBackend.bind(spec, SM90)
    params, qkv = packed_input(spec, (9, 3))
    wide = torch.zeros(qkv.shape[0], spec.qkv_width + 48, dtype=qkv.dtype)
    strided = wide[:, 24 : 24 + spec.qkv_width]
    strided.copy_(qkv)
    check_numbers(backend.forward(strided, backend.prepare(params)), qkv, spec, params)
    rows = fake.named(TRT)[0].args["qkv"]
    assert rows.untyped_storage().data_ptr() != wide.untyped_storage().data_ptr()
    assert fake.named(TRT)[0].args["mask_mode"] == "causal"


def test_trt_mask_names():
    assert trt_mask_mode(True) == "causal" and trt_mask_mode(False) == "padding"


def test_trt_refuses_gqa_and_other_archs():
    gqa = TrtBackend.supports(spec_of(), ab.parse_platform("cuda:sm90"))
    assert ab.ReasonCode.GQA in {r.code for r in gqa}
    for arch in ("cuda:sm80", "cuda:sm100"):
        reasons = TrtBackend.supports(spec_of(heads=(4, 4)), ab.parse_platform(arch))
        assert ab.ReasonCode.ARCH in {r.code for r in reasons}


# The shipped conformance suite, through each flashinfer-based backend, on the fake.


class TestFakeFlashinferConformance(NoCachePrefillConformance):
    backend_names = ("flashinfer", "flashinfer-rope", "trt")
    device: ClassVar[str | None] = "cpu"
    platform: ClassVar[ab.Platform | None] = SM90

    @pytest.fixture(autouse=True)
    def _fake_flashinfer(self, monkeypatch, sm90):
        install(monkeypatch)


def test_conformance_catches_a_batch_on_the_wrong_side_of_the_fusion_limit(fake, sm90):
    """The suite's limit cases fail when the plan's pre-processing is not the declared one."""
    from attn_backends.testing.cases import conformance_cases
    from attn_backends.testing.suite import run_case

    caps = FlashinferRopeBackend.capabilities
    at_limit = next(c for c in conformance_cases(caps) if c.id.endswith("fused-rope-at-limit"))
    assert at_limit.expect_fused is True and max(at_limit.lengths) == caps.fused_rope_max_seqlen
    run_case("flashinfer-rope", at_limit, "cpu", platform=SM90)
    wrong = dataclasses.replace(at_limit, expect_fused=False)
    with pytest.raises(AssertionError, match="expected the separate pass"):
        run_case("flashinfer-rope", wrong, "cpu", platform=SM90)


# headwise: a term of flex's mask, on CPU (eager FlexAttention); flex's conformance suite
# (tests/test_conformance_flex.py) runs the headwise cases its capabilities generate.


def test_headwise_is_flex_under_its_former_name():
    assert issubclass(headwise.HeadwiseBackend, flex.FlexBackend)
    former, current = headwise.HeadwiseBackend.capabilities, flex.FlexBackend.capabilities
    assert former == current, "the same declarations under the former name"
    ranked = {row.backend for row in RANKING}
    assert "flex" in ranked and "headwise" not in ranked, "headwise runs only when named"
    assert abp.HeadwiseSupport() in current.features


HW = ab.HeadwiseConfig(frozenset({1, 4, 6}), sink_token_num=3, swa_token_num=5, seqlen_threshold=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_headwise_threshold_sinks_and_window(dtype):
    """Sequences at, above and below the threshold; every retrieval pattern; GQA."""
    spec = spec_of(dtype, heads=(8, 2), dim=64, headwise=HW)
    backend = headwise.HeadwiseBackend.bind(spec)
    params, qkv = packed_input(spec, (16, 15, 40, 2, 0, 3), seed=3)
    plan = backend.prepare(params)
    assert isinstance(plan.kernel, headwise.HeadwisePlan)
    assert plan.kernel.windowed_sequences == 2
    check_numbers(backend.forward(qkv.clone(), plan), qkv, spec, params)


def test_headwise_window_matters():
    """The same input without the headwise rule differs: the mask is not a no-op."""
    spec = spec_of(torch.bfloat16, heads=(8, 2), dim=64, headwise=HW)
    params, qkv = packed_input(spec, (40,), seed=4)
    backend = headwise.HeadwiseBackend.bind(spec)
    out = backend.forward(qkv.clone(), backend.prepare(params))
    full = ab.reference_attention(qkv, spec_of(torch.bfloat16, heads=(8, 2), dim=64), params)
    assert relative_error(out, full) > 0.05


def test_headwise_describes_its_kernel():
    spec = spec_of(headwise=HW)
    on_gpu = dict(ab.select(spec, platform="cuda:sm90").details)
    assert on_gpu["flex_mode"] == "compiled" and on_gpu["retrieval_heads"] == "3/8"
    assert dict(ab.select(spec, platform="cpu").details)["flex_mode"] == "eager"
