"""Binding is the one decision: ``bind`` refuses what ``supports`` refuses, decides the pass,
the layout and the kernel variant once, and every later step reads that; separate ``(q, k, v)``
input never rebuilds RoPE tables per layer and refuses aliased q/k before any write."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_backends_builtin.torch_sdpa import TorchSdpaBackend

import attn_backends as ab
import attn_backends.plugin as abp
from attn_backends._backend import _backend
from attn_backends._path import _contract, _native, _preprocess, _rope, _separate
from attn_backends._path._contract import PrefillPlan
from attn_backends.deploy import get_registry
from attn_backends.errors import PackedQKVError
from attn_backends.reference import TOLERANCE, relative_error

CPU = ab.Platform(kind="cpu")
ASSUMED_SM90 = ab.parse_platform("cuda:sm90")
FAKE_SM90 = ab.Platform(kind="cuda", arch="sm90", libraries=(("flashinfer", "fake"),))
ROPE = ab.AttentionSpec(4, 2, 16, torch.float32, causal=True, rope=ab.RopeSpec(1e4, 8))
ROPE_MHA = ab.AttentionSpec(4, 4, 16, torch.float32, causal=True, rope=ab.RopeSpec(1e4, 8))
PLAIN = ab.AttentionSpec(4, 2, 16, torch.float32, causal=True)
LENGTHS = (3, 1, 5)
ROWS = 11


def params_of() -> ab.FMHAParams:
    return ab.FMHAParams.from_lengths(LENGTHS, device="cpu", padded_rows=ROWS)


# bind() refuses what supports() refuses -----------------------------------------------------


class _NoSoftcap(TorchSdpaBackend):
    """torch-sdpa without soft-cap, whatever torch-sdpa declares later: its kernel call ignores
    the soft-cap, so bound to a soft-capped spec it returned the numbers of the spec without it
    (relative error 0.55-0.71) until bind checked."""

    name = "no-softcap"
    capabilities = replace(
        TorchSdpaBackend.capabilities,
        features=tuple(
            f
            for f in TorchSdpaBackend.capabilities.features
            if not isinstance(f, abp.SoftcapSupport)
        ),
    )


def test_binding_an_unsupported_spec_raises_with_the_reasons():
    spec = replace(PLAIN, logit_softcap=5.0)
    assert _NoSoftcap.supports(spec, CPU)
    with pytest.raises(ab.NoBackendError, match="logit_softcap") as info:
        _NoSoftcap.bind(spec)
    ((name, reasons),) = info.value.reasons
    assert name == "no-softcap" and reasons == tuple(_NoSoftcap.supports(spec, CPU))
    bound = _NoSoftcap.bind(PLAIN)  # what it does declare binds
    assert bound.spec == PLAIN and bound.binding.platform.kind == "cpu"


def test_fp8_with_rope_is_refused_at_bind_by_the_one_check():
    """The FP8 rotation rule lives in the capability check alone; prepare no longer repeats it."""

    class Fp8Probe(TorchSdpaBackend):
        name = "fp8-probe"
        capabilities = replace(
            TorchSdpaBackend.capabilities,
            dtypes=frozenset({torch.float8_e4m3fn}),
            features=(abp.Fp8Support(),),
        )

    spec = ab.AttentionSpec(4, 2, 16, torch.float8_e4m3fn, causal=True, rope=ab.RopeSpec(1e4))
    with pytest.raises(ab.NoBackendError, match="rotate the stored FP8 values") as info:
        Fp8Probe.bind(spec, CPU)
    assert info.value.reasons[0][1][0].code == ab.ReasonCode.FP8
    assert Fp8Probe.bind(replace(spec, rope=None), CPU).spec is not None


def test_every_registered_backend_binds_exactly_where_it_supports():
    """torch-sdpa bound to a soft-capped spec returned relative errors of 0.55-0.71 before
    bind checked; now no backend binds a spec its own supports() refuses."""
    specs = [
        PLAIN,
        ROPE,
        replace(PLAIN, logit_softcap=5.0),
        replace(PLAIN, window=ab.SlidingWindow(2, 0)),
        ab.AttentionSpec(4, 2, 16, torch.bfloat16, causal=False),
    ]
    registry = get_registry()
    for entry in registry.entries():
        cls = entry.backend
        assert isinstance(cls, type) and issubclass(cls, abp.PrefillBackend), entry.name
        for spec in specs:
            for platform in (CPU, ASSUMED_SM90):
                reasons = cls.supports(spec, platform)
                if reasons:
                    with pytest.raises(ab.NoBackendError) as info:
                        cls.bind(spec, platform)
                    assert info.value.reasons[0][1] == tuple(reasons), entry.name
                else:
                    assert cls.bind(spec, platform).spec == spec, entry.name


def test_select_binds_for_the_requested_platform():
    """A dry run for a GPU binds the GPU backend there, and the record is that binding's."""
    selection = ab.select(ROPE, platform="cuda:sm90", backend="torch-sdpa")
    backend = selection.backend
    assert isinstance(backend, abp.PrefillBackend)
    assert backend.binding.platform == selection.platform
    assert backend.binding.preprocess.mode == "native"  # dry run on CUDA: the native pass
    assert backend.binding.details().items() <= dict(selection.details).items()


# The decision is made once -------------------------------------------------------------------


@pytest.fixture
def resolutions(monkeypatch) -> list[tuple[ab.AttentionSpec, bool]]:
    """Every pass resolution a backend asks for, and every pass looked up by name."""
    calls: list[tuple[ab.AttentionSpec, bool]] = []
    real = _preprocess.resolve_preprocess

    def counting(spec, platform, fused_rope):
        calls.append((spec, fused_rope))
        return real(spec, platform, fused_rope)

    def no_lookup(mode):
        raise AssertionError(f"the pass {mode!r} was looked up by name")

    monkeypatch.setattr(_backend, "resolve_preprocess", counting)
    monkeypatch.setattr(_preprocess, "pass_named", no_lookup)
    monkeypatch.setattr(_contract, "pass_named", no_lookup)
    return calls


def test_prepare_describe_and_forward_decide_nothing_again(resolutions):
    backend = TorchSdpaBackend.bind(ROPE, CPU)
    assert resolutions == [(ROPE, False)]  # torch-sdpa fuses nothing: one resolution
    binding = backend.binding
    assert binding.preprocess.mode == "torch" and binding.preprocess.rope_pass is _preprocess.TORCH
    assert binding.layout == "views" and binding.separate_qkv_pass == "torch"
    params = params_of()
    for _ in range(3):
        plan = backend.prepare(params)
        assert plan.rope_pass is _preprocess.TORCH and plan.tables is not None
        for _ in range(3):
            qkv = torch.randn(ROWS, ROPE.qkv_width)
            pristine = qkv.clone()
            out = backend.forward(qkv, plan)
            ref = ab.reference_attention(pristine, ROPE, params)
            assert relative_error(out, ref) < TOLERANCE[torch.float32]
    assert backend.describe(CPU) == binding.details()
    assert resolutions == [(ROPE, False)]


def test_a_default_binding_serves_every_batch_of_this_machine(resolutions):
    """Bound for this machine as probed (its libraries listed), a batch on its device takes the
    bound decision, though the device's platform is probed with another library list."""
    backend = TorchSdpaBackend.bind(ROPE)
    assert backend.binding.platform.kind == "cpu"
    for _ in range(3):
        backend.prepare(params_of())
    assert resolutions == [(ROPE, False)]


def test_a_fusing_backend_decides_both_cases_once_and_picks_per_batch(resolutions):
    flashinfer = pytest.importorskip("attn_backends_builtin.flashinfer")
    spec = ab.AttentionSpec(8, 2, 128, torch.bfloat16, causal=True, rope=ab.RopeSpec(1e6))
    binding = flashinfer.FlashinferRopeBackend.bind(spec, FAKE_SM90).binding
    assert sorted(fused for _, fused in resolutions) == [False, True]
    limit = flashinfer.FUSED_ROPE_MAX_SEQLEN
    assert binding.fused is not None and binding.fused_max_seqlen == limit
    assert binding.choice_for(limit).mode == "fused"
    assert binding.choice_for(limit + 1) is binding.unfused
    assert binding.unfused.rope_pass is not None  # a separate pass object, not a name
    variant = binding.variant
    assert isinstance(variant, flashinfer.KernelVariant) and variant.sm == 90
    assert [(fused, c.backend) for fused, c in variant.cases] == [(True, "fa2"), (False, "fa3")]
    unfusable = replace(spec, rope=ab.RopeSpec(1e6, 64))  # partial rotary: never fused
    resolutions.clear()
    assert flashinfer.FlashinferRopeBackend.bind(unfusable, FAKE_SM90).binding.fused is None
    assert len(resolutions) == 2


def test_flashinfer_plans_with_the_bound_kernel_choice(monkeypatch):
    flashinfer = pytest.importorskip("attn_backends_builtin.flashinfer")
    from tests.fakes.fake_flashinfer import install

    fake = install(monkeypatch)
    monkeypatch.setattr(flashinfer, "device_sm", lambda device: 90)
    spec = ab.AttentionSpec(8, 2, 128, torch.bfloat16, causal=True)
    backend = flashinfer.FlashinferBackend.bind(spec, FAKE_SM90)
    chosen: list[object] = []
    real = flashinfer.choose_kernel

    def counting(*args):
        chosen.append(args)
        return real(*args)

    monkeypatch.setattr(flashinfer, "choose_kernel", counting)
    params = ab.FMHAParams.from_lengths((5, 7), device="cpu")
    backend.prepare(params)
    # The fake's tensors are on the CPU, a platform of its own: decided once for it too.
    assert len(chosen) == 1
    chosen.clear()
    for _ in range(3):
        backend.prepare(params)
    assert chosen == [], "prepare read the kernel the binding chose"
    inits = fake.named("BatchPrefillWithRaggedKVCacheWrapper.__init__")
    assert inits and all(call.args["backend"] == "fa3" for call in inits)


# Separate (q, k, v): tables per plan, the record says what runs ---------------------------------


def test_separate_input_on_a_native_plan_runs_the_native_kernel_on_the_callers_tensors(
    monkeypatch,
):
    """A plan whose packed pass is the native kernel (emulated on CPU: a CPU run always picks
    the torch pass) rotates separate q and k with the native kernel's separate form, in place
    on the caller's tensors, once per layer, and builds no table per layer."""
    builds: list[int] = []
    real = _rope.rope_frequencies

    def counting(spec, seq_len):
        builds.append(seq_len)
        return real(spec, seq_len)

    def no_packed(*args, **kwargs):
        raise AssertionError("separate input must not go through the packed operator")

    params = params_of()
    exact = _rope.build_position_tables(ROPE, params.positions, params.max_seqlen_q)
    calls: list[tuple[int, int, int]] = []

    def emulated(q_rows, k_rows, cu, tokens, spec):  # the kernel's math, by torch, in place
        calls.append((q_rows.data_ptr(), k_rows.data_ptr(), tokens))
        _rope.apply_rope_logn(
            q_rows[:tokens].view(tokens, -1, spec.head_dim), spec.num_heads, spec, exact
        )
        _rope.apply_rope_logn(k_rows[:tokens].view(tokens, -1, spec.head_dim), 0, spec, exact)

    monkeypatch.setattr(_rope, "rope_frequencies", counting)
    monkeypatch.setattr(_native, "rope_logn_", no_packed)
    monkeypatch.setattr(_native, "rope_logn_qk_", emulated)
    backend = TorchSdpaBackend.bind(ROPE)
    kernel = backend.prepare(params).kernel
    builds.clear()
    plan = PrefillPlan(backend.name, ROPE, params, "native", None, kernel)
    built = len(builds)
    layers = 4
    for layer in range(layers):
        gen = torch.Generator().manual_seed(layer)
        packed = torch.randn(ROWS, ROPE.qkv_width, generator=gen)
        q, k, v = (t.clone() for t in packed.split([ROPE.q_width, ROPE.kv_width, ROPE.kv_width], 1))
        out = backend.forward((q, k, v), plan)
        ref = ab.reference_attention(packed, ROPE, params)
        assert relative_error(out, ref) < TOLERANCE[torch.float32]
        assert calls[-1] == (q.data_ptr(), k.data_ptr(), params.token_q_num)
    assert len(calls) == layers, "one native launch per layer"
    assert len(builds) == built, f"{len(builds) - built} table builds over {layers} layers"
    assert built == 1 and plan.tables is not None, "the plan built its tables, once"
    assert plan.rope_pass is _preprocess.NATIVE


def test_separate_input_falls_back_to_torch_when_the_pass_declines():
    """A pass whose separate form declines (returns False, writes nothing), or that has none,
    leaves the rotation to the torch pass with the plan's tables: the numbers stay right."""
    params = params_of()
    tables = _rope.build_position_tables(ROPE, params.positions, params.max_seqlen_q)
    asked: list[str] = []

    def declines(q, k, spec, p):
        asked.append("declined")
        return False

    passes = {
        "declines": replace(_preprocess.NATIVE, name="declines", apply_separate=declines),
        "none": replace(_preprocess.NATIVE, name="none", apply_separate=None),
    }
    for name, rope_pass in passes.items():
        gen = torch.Generator().manual_seed(7)
        packed = torch.randn(ROWS, ROPE.qkv_width, generator=gen)
        q, k, _ = (t.clone() for t in packed.split([ROPE.q_width, ROPE.kv_width, ROPE.kv_width], 1))
        heads = (ROWS, -1, ROPE.head_dim)
        ran = _separate.rotate_separate(
            q.view(heads), k.view(heads), ROPE, params, tables, rope_pass
        )
        assert ran == "torch", name
        want = packed.clone()
        _preprocess.apply_torch_pass(want, ROPE, params)
        assert torch.equal(q, want[:, : ROPE.q_width]), name
        assert torch.equal(k, want[:, ROPE.q_width : ROPE.q_width + ROPE.kv_width]), name
    assert asked == ["declined"]


def test_prepare_builds_tables_for_every_pass_that_rotates():
    params = params_of()
    for mode in ("native", "torch"):
        assert _preprocess.prepare_tables(mode, ROPE, params) is not None
    assert _preprocess.prepare_tables("fused", ROPE, params) is None
    assert _preprocess.prepare_tables("none", PLAIN, params) is None


def test_the_record_says_the_torch_pass_serves_separate_input():
    backend = TorchSdpaBackend.bind(ROPE, ASSUMED_SM90)
    details = backend.describe(ASSUMED_SM90)
    assert details["preprocess"] == "native"
    assert details["preprocess_separate_qkv"].startswith("torch")
    assert backend.binding.separate_qkv_pass == "torch"
    on_cpu = backend.describe(CPU)  # the same spec decided for the CPU: torch everywhere
    assert on_cpu["preprocess"] == "torch" and "preprocess_separate_qkv" not in on_cpu


# Aliasing among q, k and v -------------------------------------------------------------------


def _aliased(name: str) -> tuple[ab.AttentionSpec, tuple[torch.Tensor, ...], str]:
    gen = torch.Generator().manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    spec = ROPE
    q, k, v = rand(ROWS, 64), rand(ROWS, 32), rand(ROWS, 32)
    if name == "k is v":
        return spec, (q, k, k), "k and v are the same memory"
    if name == "q a view of v":
        v = rand(ROWS, 64)
        return ROPE_MHA, (v.view(ROWS, 4, 16), rand(ROWS, 64), v), "q and v are the same memory"
    if name == "q and k overlap columns":
        wide = rand(ROWS, 64 + 32 - 16)
        return spec, (wide[:, :64], wide[:, 48:], v), "q and k overlap in memory"
    if name == "k and v overlap columns":
        wide = rand(ROWS, 48)
        return spec, (q, wide[:, :32], wide[:, 16:]), "k and v overlap in memory"
    if name == "q overlaps v across rows":
        flat = rand(ROWS * 64)
        q = flat.view(ROWS, 64)
        v = flat[100 : 100 + ROWS * 32].view(ROWS, 32)  # another row stride, inside q's rows
        return spec, (q, k, v), "q and v overlap in memory"
    if name == "q is k":
        return spec, (q, q[:, :32], v), "q and k are the same memory"
    raise AssertionError(name)


ALIASED = [
    "k is v",
    "q a view of v",
    "q and k overlap columns",
    "k and v overlap columns",
    "q overlaps v across rows",
    "q is k",
]


@pytest.mark.parametrize("name", ALIASED)
def test_aliased_inputs_are_refused_before_any_write(name):
    spec, given, match = _aliased(name)
    storages = {t.untyped_storage().data_ptr(): t for t in given}
    bases = [t._base if t._base is not None else t for t in storages.values()]
    before = [b.clone() for b in bases]
    backend = TorchSdpaBackend.bind(spec)
    plan = backend.prepare(params_of())
    for _ in range(2):  # the second call takes the memo: still refused
        with pytest.raises(PackedQKVError, match=match):
            backend.forward(given, plan)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(bases, before, strict=True)), "input written"


def test_disjoint_column_slices_of_one_buffer_are_served():
    gen = torch.Generator().manual_seed(4)
    packed = torch.randn(ROWS, ROPE.qkv_width, generator=gen)
    pristine = packed.clone()
    q, k, v = packed.split([ROPE.q_width, ROPE.kv_width, ROPE.kv_width], 1)
    backend = TorchSdpaBackend.bind(ROPE)
    params = params_of()
    out = backend.forward((q, k, v), backend.prepare(params))
    ref = ab.reference_attention(pristine, ROPE, params)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
    assert torch.equal(packed[:, ROPE.q_width + ROPE.kv_width :], pristine[:, -ROPE.kv_width :])


def test_a_plan_that_writes_nothing_reads_aliased_inputs():
    """Without RoPE or logn nothing is written, so k is v reads the same keys and values."""
    gen = torch.Generator().manual_seed(5)
    q, kv = torch.randn(ROWS, 64, generator=gen), torch.randn(ROWS, 32, generator=gen)
    backend = TorchSdpaBackend.bind(PLAIN)
    params = params_of()
    out = backend.forward((q, kv, kv), backend.prepare(params))
    ref = ab.reference_attention(torch.cat((q, kv, kv), 1), PLAIN, params)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
