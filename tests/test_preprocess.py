"""The RoPE/logn pass: which implementation runs where (and why), its routing through the
contract, the torch implementation against the float64 rotation, and the native loader's
clean refusal on machines that cannot build it."""

from __future__ import annotations

import math
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch
from attn_backends_builtin._flashinfer_rope import FLASHINFER_ROPE, flashinfer_rope_refusal

import attn_backends as ab
import attn_backends.reference
from attn_backends._backend._reference import _rotate
from attn_backends._path import _native, _preprocess
from attn_backends._path._preprocess import (
    NATIVE,
    TORCH,
    apply_preprocess,
    choose_preprocess,
    passes_for,
    register_rope_pass,
    resolve_preprocess,
)
from attn_backends._path._rope import apply_rope_logn, build_position_tables
from attn_backends._values._errors import NativeBuildError
from attn_backends._values._platform import PlatformKind

QWEN3 = ab.AttentionSpec(16, 8, 128, torch.bfloat16, causal=True, rope=ab.RopeSpec(1e6))
FLASHINFER = (("aiter", None), ("flashinfer", "0.7.0.post1"), ("tensorrt_llm", None))
NO_LIBRARIES = (("aiter", None), ("flashinfer", None), ("tensorrt_llm", None))
H200 = ab.Platform(kind="cuda", arch="sm90", device_name="H200", libraries=FLASHINFER)
MI300 = ab.Platform(kind="rocm", arch="gfx942", device_name="MI300X", libraries=NO_LIBRARIES)


@pytest.fixture(autouse=True)
def _fresh_caches():
    register_rope_pass(FLASHINFER_ROPE)  # as the flashinfer plugin does when it loads
    _preprocess.clear_preprocess_cache()
    _native.clear_cache()
    yield
    _preprocess.clear_preprocess_cache()
    _native.clear_cache()


@pytest.fixture
def native_builds(monkeypatch):
    monkeypatch.setattr(_native, "unavailable_reason", lambda: None)


@pytest.fixture
def no_compiler(monkeypatch):
    reason = "native RoPE/logn kernel unavailable: the CUDA compiler nvcc was not found"
    monkeypatch.setattr(_native, "unavailable_reason", lambda: reason)


# ---------------------------------------------------------------- the choice


def test_preferences_are_data_with_evidence():
    kinds: tuple[PlatformKind, ...] = ("cpu", "cuda", "rocm")
    order = {kind: tuple(p.name for p in passes_for(kind)) for kind in kinds}
    assert order == {
        "cpu": ("torch",),
        "cuda": ("native", "flashinfer", "torch"),
        "rocm": ("native", "torch"),
    }
    for kind in order:
        assert passes_for(kind)[-1] is TORCH, "torch runs everywhere: it must close every list"
    assert all(p.note for p in (NATIVE, TORCH, FLASHINFER_ROPE))


def test_a_plugin_pass_is_one_registration_and_names_cannot_be_taken():
    register_rope_pass(FLASHINFER_ROPE)  # the same object again: nothing changes
    impostor = replace(FLASHINFER_ROPE, note="another")
    for bad, match in ((impostor, "already registered"), (replace(TORCH), "already registered")):
        with pytest.raises(ab.SpecError, match=match):
            register_rope_pass(bad)
    for name in ("none", "fused", ""):
        with pytest.raises(ab.SpecError, match="cannot be named"):
            register_rope_pass(replace(FLASHINFER_ROPE, name=name))
    with pytest.raises(ab.SpecError, match="takes a RopePass"):
        register_rope_pass("flashinfer")  # type: ignore[arg-type]


def test_cpu_uses_torch_and_never_asks_for_the_native_kernel(monkeypatch):
    def refuse() -> str:
        raise AssertionError("the native kernel was considered on CPU")

    monkeypatch.setattr(_native, "unavailable_reason", refuse)
    for spec in (QWEN3, replace(QWEN3, use_logn_attn=True, logn_base=8192)):
        choice = choose_preprocess(spec, ab.parse_platform("cpu"), fused_rope=False)
        assert (choice.mode, choice.fallback) == ("torch", None)
        assert choice.details() == {"preprocess": "torch"}


def test_cuda_takes_the_native_kernel_when_it_builds(native_builds):
    choice = choose_preprocess(QWEN3, H200, fused_rope=False)
    assert choice.mode == "native" and choice.fallback is None
    assert "native > flashinfer > torch" in choice.reason


def test_dry_run_assumes_the_native_kernel_without_building(monkeypatch):
    monkeypatch.setattr(_native, "load", lambda: pytest.fail("a dry run built the kernel"))
    for text in ("cuda:sm90", "rocm:gfx942"):
        choice = choose_preprocess(QWEN3, ab.parse_platform(text), fused_rope=False)
        assert choice.mode == "native"
        assert "dry run" in choice.reason


def test_cuda_without_compiler_falls_back_to_flashinfer_and_says_why(no_compiler):
    choice = choose_preprocess(QWEN3, H200, fused_rope=False)
    assert choice.mode == "flashinfer"
    assert choice.fallback is not None and "native: " in choice.fallback
    assert "nvcc was not found" in choice.fallback
    assert choice.details()["preprocess_fallback"] == choice.fallback


def test_logn_skips_flashinfer_for_torch_with_both_reasons(no_compiler):
    spec = replace(QWEN3, use_logn_attn=True, logn_base=8192)
    choice = choose_preprocess(spec, H200, fused_rope=False)
    assert choice.mode == "torch"
    assert choice.fallback is not None
    assert "nvcc" in choice.fallback and "flashinfer: has no logn scaling" in choice.fallback


def test_native_still_serves_logn_on_cuda(native_builds):
    spec = replace(QWEN3, use_logn_attn=True, logn_base=8192)
    assert choose_preprocess(spec, H200, fused_rope=False).mode == "native"


def test_missing_flashinfer_falls_back_to_torch(no_compiler):
    bare = replace(H200, libraries=NO_LIBRARIES)
    choice = choose_preprocess(QWEN3, bare, fused_rope=False)
    assert choice.mode == "torch"
    assert "flashinfer: flashinfer is not installed" in str(choice.fallback)


def test_rocm_has_no_flashinfer_step(native_builds, monkeypatch):
    assert choose_preprocess(QWEN3, MI300, fused_rope=False).mode == "native"
    _preprocess.clear_preprocess_cache()
    monkeypatch.setattr(_native, "unavailable_reason", lambda: "hipcc missing")
    choice = choose_preprocess(QWEN3, MI300, fused_rope=False)
    assert choice.mode == "torch" and choice.fallback == "native: hipcc missing"


def test_fp8_input_goes_through_torch_with_reasons():
    spec = replace(QWEN3, dtype=torch.float8_e4m3fn)
    choice = choose_preprocess(spec, ab.parse_platform("cuda:sm90"), fused_rope=False)
    assert choice.mode == "torch"
    assert "native: serves float32/float16/bfloat16, not float8_e4m3fn" in str(choice.fallback)


def test_native_refuses_rotary_dims_past_its_table(native_builds):
    spec = ab.AttentionSpec(2, 1, 1024, torch.float16, causal=True, rope=ab.RopeSpec(1e4))
    choice = choose_preprocess(spec, H200, fused_rope=False)
    assert choice.mode == "torch"
    assert "rotary_dim 1024 > 512" in str(choice.fallback)


@pytest.mark.parametrize(
    ("dim", "rope", "refusal"),
    [
        (128, ab.RopeSpec(1e4), None),
        (128, ab.RopeSpec(1e4, 64), None),
        (128, ab.RopeSpec(1e4, 16, interleaved=True), None),
        (64, ab.RopeSpec(1e4, 32), None),
        (512, ab.RopeSpec(1e4), None),
        (96, ab.RopeSpec(1e4), "head_dim 96 is not one of"),
        (128, ab.RopeSpec(1e4, 24), "rotary_dim / 2 (12) is not a multiple of its vector width 8"),
        (128, ab.RopeSpec(1e4, 20, interleaved=True), "rotary_dim (20) is not a multiple"),
        (512, ab.RopeSpec(1e4, 16), "rotary_dim / 2 (8) is not a multiple of its vector width 16"),
        (128, None, "applies RoPE only"),
    ],
)
def test_flashinfer_limits(dim, rope, refusal):
    spec = ab.AttentionSpec(4, 2, dim, torch.bfloat16, causal=True, rope=rope)
    got = flashinfer_rope_refusal(spec, H200)
    assert got == refusal if refusal is None else refusal in str(got)


def test_flashinfer_refuses_float32_and_other_platforms():
    assert "float16/bfloat16" in str(
        flashinfer_rope_refusal(replace(QWEN3, dtype=torch.float32), H200)
    )
    assert "not rocm" in str(flashinfer_rope_refusal(QWEN3, MI300))


def test_none_and_fused_keep_their_meaning():
    bare = replace(QWEN3, rope=None)
    assert choose_preprocess(bare, H200, fused_rope=False).mode == "none"
    assert choose_preprocess(QWEN3, H200, fused_rope=True).mode == "fused"
    interleaved = replace(QWEN3, rope=ab.RopeSpec(1e6, interleaved=True))
    assert choose_preprocess(interleaved, ab.parse_platform("cuda:sm90"), True).mode == "native"
    logn = replace(QWEN3, use_logn_attn=True, logn_base=64)
    assert choose_preprocess(logn, ab.parse_platform("cpu"), fused_rope=True).mode == "torch"


def test_choice_is_resolved_once_per_spec_and_platform(monkeypatch):
    calls: list[int] = []

    def reason() -> None:
        calls.append(1)

    monkeypatch.setattr(_native, "unavailable_reason", reason)
    first = resolve_preprocess(QWEN3, H200, False)
    assert resolve_preprocess(QWEN3, H200, False) is first
    assert first.mode == "native" and len(calls) == 1


def test_decision_record_shows_the_pass():
    cpu = ab.select(QWEN3, platform="cpu", backend="torch-sdpa")
    assert dict(cpu.details)["preprocess"] == "torch"
    assert "preprocess_fallback" not in dict(cpu.details)
    dry = ab.select(QWEN3, platform="cuda:sm90", backend="torch-sdpa")
    assert dict(dry.details)["preprocess"] == "native"
    assert "preprocess=native" in dry.explain()
    record = ab.select(replace(QWEN3, rope=None), platform="cpu", backend="torch-sdpa")
    assert dict(record.details)["preprocess"] == "none"


# ---------------------------------------------------------------- routing through the contract


SMALL = ab.AttentionSpec(
    4, 2, 32, torch.float32, causal=True, rope=ab.RopeSpec(1e4), use_logn_attn=True, logn_base=4
)
LENGTHS = (5, 1, 0, 9)


def _packed(spec, rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, spec.qkv_width, generator=gen).to(spec.dtype)


def _torch_pass(packed, spec, params):
    qk = packed[: params.token_q_num, : spec.q_width + spec.kv_width]
    apply_rope_logn(
        qk.unflatten(1, (spec.num_heads + spec.num_kv_heads, spec.head_dim)),
        spec.num_heads,
        spec,
        build_position_tables(spec, params.positions),
    )


def test_prepare_on_cpu_builds_tables_for_torch_only():
    be = ab.select(SMALL, platform="cpu", backend="torch-sdpa").backend
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu", padded_rows=18)
    plan = be.prepare(params)
    assert plan.preprocess == "torch" and plan.tables is not None
    bare = ab.select(
        replace(SMALL, rope=None, use_logn_attn=False, logn_base=None),
        platform="cpu",
        backend="torch-sdpa",
    ).backend
    none = bare.prepare(params)
    assert none.preprocess == "none" and none.tables is None


def test_native_mode_calls_the_kernel_once_per_forward(monkeypatch):
    calls: list[tuple[object, ...]] = []

    def fake(packed, cu_seqlens, tokens, spec, **kw):
        calls.append((packed.data_ptr(), cu_seqlens, tokens, spec, kw))
        _torch_pass(packed, spec, params)

    monkeypatch.setattr(_native, "rope_logn_", fake)
    be = ab.select(SMALL, platform="cpu", backend="torch-sdpa").backend
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu", padded_rows=18)
    plan = replace(be.prepare(params), preprocess="native", tables=None)
    qkv = _packed(SMALL, 18)
    pristine = qkv.clone()
    out = be.forward(qkv, plan)
    assert len(calls) == 1
    ptr, cu, tokens, spec, kw = calls[0]
    assert ptr == qkv.data_ptr() and cu is params.cu_seqlens_q and tokens == 15 and spec == SMALL
    assert kw == {}
    ref = ab.reference_attention(pristine, SMALL, params)
    assert ab.reference.relative_error(out, ref) < ab.reference.TOLERANCE[torch.float32]


def _install_fake_flashinfer(monkeypatch, calls):
    def apply_rope_pos_ids_inplace(
        q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4
    ):
        calls.append(
            {
                "q": q,
                "k": k,
                "pos_ids": pos_ids,
                "rotary_dim": rotary_dim,
                "interleave": interleave,
                "rope_theta": rope_theta,
            }
        )
        spec = ab.AttentionSpec(
            q.shape[1],
            k.shape[1],
            q.shape[2],
            q.dtype,
            causal=True,
            rope=ab.RopeSpec(rope_theta, rotary_dim, interleave),
        )
        for x in (q, k):
            x.copy_(_rotate(x.to(torch.float64), pos_ids, spec).to(x.dtype))

    module = types.ModuleType("flashinfer")
    module.apply_rope_pos_ids_inplace = apply_rope_pos_ids_inplace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)


def test_flashinfer_mode_rotates_views_of_the_packed_rows(monkeypatch):
    calls: list[dict[str, object]] = []
    _install_fake_flashinfer(monkeypatch, calls)
    spec = ab.AttentionSpec(
        4, 2, 64, torch.float32, causal=True, rope=ab.RopeSpec(1e6, 32, interleaved=True)
    )
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu", padded_rows=17)
    backing = _packed(replace(spec, num_heads=6), 17)  # wider rows: a strided packed buffer
    packed = backing[:, 64 : 64 + spec.qkv_width]
    pristine = packed.clone()
    apply_preprocess("flashinfer", packed, spec, params, None)
    assert len(calls) == 1
    call = calls[0]
    q, k = call["q"], call["k"]
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert q.data_ptr() == packed.data_ptr() and q.shape == (15, 4, 64)
    assert k.data_ptr() == packed[:, spec.q_width :].data_ptr() and k.shape == (15, 2, 64)
    assert call["pos_ids"] is params.positions
    assert (call["rotary_dim"], call["interleave"], call["rope_theta"]) == (32, True, 1e6)
    expected = pristine.clone()
    _torch_pass(expected, spec, params)
    assert torch.allclose(packed, expected, rtol=0, atol=1e-5)
    qk = spec.q_width + spec.kv_width
    assert torch.equal(packed[:, qk:], pristine[:, qk:]) and torch.equal(packed[15:], pristine[15:])


def test_flashinfer_mode_sends_misaligned_rows_through_torch(monkeypatch):
    calls: list[dict[str, object]] = []
    _install_fake_flashinfer(monkeypatch, calls)
    spec = replace(SMALL, dtype=torch.bfloat16, use_logn_attn=False, logn_base=None)
    params = ab.FMHAParams.from_lengths(LENGTHS, device="cpu")
    backing = _packed(spec, 15 * 2)
    packed = backing.view(-1)[1 : 1 + 15 * spec.qkv_width].view(15, spec.qkv_width)
    expected = packed.clone()
    _torch_pass(expected, spec, params)
    apply_preprocess("flashinfer", packed, spec, params, None)
    assert calls == []
    assert torch.equal(packed, expected)


# ---------------------------------------------------------------- torch implementation numerics


ROPES = [
    ab.RopeSpec(1e4),
    ab.RopeSpec(1e6),
    ab.RopeSpec(1e4, interleaved=True),
    ab.RopeSpec(1e4, 16),
    ab.RopeSpec(5e5, 24, interleaved=True),
    None,
]


def _case_id(value: object) -> str:
    if isinstance(value, ab.RopeSpec):
        return f"theta{value.theta:g}-r{value.rotary_dim}-{'il' if value.interleaved else 'rh'}"
    return "off" if value is None else f"logn{value}"


@pytest.mark.parametrize(
    ("rope", "logn"),
    [(rope, logn) for rope in ROPES for logn in (None, 16) if rope is not None or logn],
    ids=_case_id,
)
def test_torch_pass_matches_float64_rotation(rope, logn):
    spec = ab.AttentionSpec(
        3,
        1,
        48,
        torch.float32,
        causal=True,
        rope=rope,
        use_logn_attn=logn is not None,
        logn_base=logn,
    )
    lengths = (1, 700, 0, 3000, 1)
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=sum(lengths) + 3)
    qkv = _packed(spec, params.rows, seed=3)
    pristine = qkv.clone()
    _torch_pass(qkv, spec, params)
    tokens = params.token_q_num
    x = pristine[:tokens].to(torch.float64).unflatten(1, (-1, spec.head_dim))
    q, k = x[:, : spec.num_heads], x[:, spec.num_heads : spec.num_heads + spec.num_kv_heads]
    pos = params.positions.to(torch.float64)
    if rope is not None:
        q, k = _rotate(q, pos, spec), _rotate(k, pos, spec)
    if logn is not None:
        q = q * (torch.log(pos + 1) / math.log(logn)).clamp(min=1)[:, None, None]
    ref = torch.cat((q, k), dim=1)
    out = qkv[:tokens, : spec.q_width + spec.kv_width].to(torch.float64).reshape(ref.shape)
    err = (out - ref).abs()
    # float32 math on values of order 1, positions up to 3000: a few float32 ulps.
    assert float(err.max()) < 2e-6, float(err.max())
    qk = spec.q_width + spec.kv_width
    assert torch.equal(qkv[:, qk:], pristine[:, qk:]), "V columns were written"
    assert torch.equal(qkv[tokens:], pristine[tokens:]), "padding rows were written"


def test_position_tables_follow_the_reference_frequencies():
    spec = ab.AttentionSpec(2, 2, 64, torch.float32, causal=True, rope=ab.RopeSpec(1e6, 32))
    positions = torch.tensor([0, 1, 2047, 32767], dtype=torch.int32)
    tables = build_position_tables(spec, positions)
    assert tables.cos is not None and tables.sin is not None and tables.logn is None
    freqs = torch.tensor([1e6 ** (-2.0 * i / 32) for i in range(16)], dtype=torch.float64)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    assert torch.allclose(tables.cos[:, 0].double(), angles.cos(), atol=1e-7, rtol=0)
    assert torch.allclose(tables.sin[:, 0].double(), angles.sin(), atol=1e-7, rtol=0)


# ---------------------------------------------------------------- native loader


def test_native_loader_refuses_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(NativeBuildError, match="no CUDA or ROCm device is visible"):
        _native.load()
    reason = _native.unavailable_reason()
    assert reason is not None and "only built on GPU machines" in reason
    assert isinstance(NativeBuildError("x"), ab.AttentionBackendError)


def test_native_failure_is_remembered(monkeypatch):
    calls: list[int] = []

    def problem() -> str:
        calls.append(1)
        return "no compiler"

    monkeypatch.setattr(_native, "toolchain_problem", problem)
    for _ in range(3):
        with pytest.raises(NativeBuildError, match="unavailable: no compiler"):
            _native.load()
    assert calls == [1]


@pytest.fixture
def fake_cuda_toolchain(monkeypatch, tmp_path):
    """Pretend to be a CUDA machine; the extension loader must not run unless told."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    (cuda_home / "bin" / "nvcc").write_text("")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(cuda_home))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setenv("CXX", sys.executable)  # any existing program stands for the compiler
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("built without a need"))
    return cpp_extension


def test_toolchain_problems_are_named(fake_cuda_toolchain, monkeypatch):
    assert _native.toolchain_problem() is None
    monkeypatch.setattr(fake_cuda_toolchain, "is_ninja_available", lambda: False)
    assert "ninja was not found" in str(_native.toolchain_problem())
    monkeypatch.setattr(fake_cuda_toolchain, "CUDA_HOME", None)
    with pytest.raises(NativeBuildError, match="nvcc was not found; set CUDA_HOME"):
        _native.load()


def test_missing_host_compiler_is_named(fake_cuda_toolchain, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "C++ compiler 'no-such-compiler-here' was not found" in str(_native.toolchain_problem())


def test_a_failed_build_becomes_the_named_error(fake_cuda_toolchain, monkeypatch, tmp_path):
    seen: dict[str, object] = {}

    def failing_load(**kw):
        seen.update(kw)
        raise RuntimeError("Error building extension 'attn_backends_rope_logn'\nnvcc said no")

    monkeypatch.setattr(fake_cuda_toolchain, "load", failing_load)
    with pytest.raises(NativeBuildError, match=r"failed \(RuntimeError: Error building") as info:
        _native.load()
    assert isinstance(info.value.__cause__, RuntimeError)
    build = seen["build_directory"]
    assert isinstance(build, str) and build.startswith(str(tmp_path / "cache" / "attn_backends"))
    assert seen["is_python_module"] is False
    staged = [p for p in seen["sources"]]  # type: ignore[attr-defined]
    assert [p.rsplit("/", 1)[-1] for p in staged] == ["rope_logn.cu", "rope_logn_binding.cpp"]
    for name in _native.SOURCES:  # copied to a writable place beside the build
        copied = (tmp_path / "cache").rglob(name)
        assert any(p.read_bytes() == (_native.source_dir() / name).read_bytes() for p in copied)


def test_sources_ship_with_the_package():
    src = _native.source_dir()
    for name in _native.SOURCES:
        assert (src / name).is_file()
    text = (src / "rope_logn_binding.cpp").read_text()
    assert "TORCH_LIBRARY(attn_backends_native" in text and "Tensor(a!) qkv" in text
    assert "asm" not in (src / "rope_logn.cu").read_text(), "inline assembly does not hipify"


def test_importing_the_package_never_touches_the_extension_loader():
    code = (
        "import sys, attn_backends, attn_backends_builtin.torch_sdpa\n"
        "import torch\n"
        "ab = attn_backends\n"
        "spec = ab.AttentionSpec(2, 1, 16, torch.float32, causal=True, rope=ab.RopeSpec(1e4))\n"
        "be = ab.select(spec, device='cpu').backend\n"
        "params = ab.FMHAParams.from_lengths([3], device='cpu')\n"
        "be.forward(torch.randn(3, spec.qkv_width), be.prepare(params))\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
