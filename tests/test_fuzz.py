"""Property tests over the contract, the params and the selector.

Every generated input either gives the reference result (within `TOLERANCE`) or raises an
`AttentionBackendError` subclass with a message; never a raw torch or Python error, and an
input refused by validation is left bit-for-bit unchanged. Runs are derandomised (the same
cases every time) and the number of cases tried is printed in the terminal summary.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch
from attn_backends_builtin import torch_sdpa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attn_backends as ab
import attn_backends.deploy
import attn_backends.reference

CASES: Counter[str] = Counter()
"""Cases tried per property and outcome, for the terminal summary."""
MIN_CASES = {"spec": 550, "params": 550, "forward": 750, "select": 450}

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


def fuzz(examples: int) -> settings:
    """The shared settings with this many examples: deterministic, no deadline, no database."""
    return settings(FUZZ, max_examples=examples)


class _Report:
    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:  # pytest's reporter type
        total = sum(CASES.values())
        terminalreporter.write_sep("-", f"attn-backends fuzz: {total} cases tried")
        for key in sorted(CASES):
            terminalreporter.write_line(f"  {key}: {CASES[key]}")


@pytest.fixture(scope="module", autouse=True)
def _report_cases(request: pytest.FixtureRequest) -> Iterator[None]:
    """Register the summary; run on one intra-op thread (the tensors here are tiny, and on a
    busy machine thread hand-offs cost more than the work)."""
    manager = request.config.pluginmanager
    if not manager.has_plugin("attn-backends-fuzz"):
        manager.register(_Report(), "attn-backends-fuzz")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _refused(kind: str, exc: ab.AttentionBackendError) -> None:
    assert str(exc).strip(), f"{type(exc).__name__} without a message"
    CASES[f"{kind}: refused ({type(exc).__name__})"] += 1


def _accepted(kind: str) -> None:
    CASES[f"{kind}: accepted"] += 1


T = TypeVar("T")


def _attempt(call: Callable[[], T]) -> tuple[T | None, ab.AttentionBackendError | None]:
    """``(result, None)``, or ``(None, error)`` for a named refusal; anything else propagates."""
    try:
        return call(), None
    except ab.AttentionBackendError as exc:
        return None, exc


# ---- AttentionSpec / RopeSpec / HeadwiseConfig --------------------------------------------
# Each case starts from valid fields and corrupts none, one or two of them: valid inputs must be
# accepted, and whatever is accepted must satisfy what every consumer relies on.

GARBAGE: st.SearchStrategy[object] = st.sampled_from(
    [None, "4", 2.5, [], True, False, float("nan"), -1, 0]
)
BAD_FLAGS = st.sampled_from([0, 1, "yes", "false", None, 1.0])
BAD_DTYPES = st.sampled_from(
    [torch.float64, torch.int32, torch.bool, torch.complex64, torch.uint8, "float16", None]
)
BAD_FLOATS = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1.0, 0.5]), GARBAGE
)
BAD_INTS = st.one_of(st.integers(-3, 0), st.integers(1, 300), GARBAGE)
BAD_HEADS = st.one_of(
    GARBAGE,
    st.integers(0, 3),
    st.frozensets(st.integers(-2, 40), max_size=3),
    st.just([[0]]),
    st.just("01"),
)

CORRUPT: dict[str, st.SearchStrategy[object]] = {
    "num_heads": BAD_INTS,
    "num_kv_heads": BAD_INTS,
    "head_dim": BAD_INTS,
    "dtype": BAD_DTYPES,
    "causal": BAD_FLAGS,
    "use_logn_attn": BAD_FLAGS,
    "logn_base": BAD_INTS,
    "softmax_scale": BAD_FLOATS,
    "use_mla": BAD_FLAGS,
    "rope.theta": BAD_FLOATS,
    "rope.rotary_dim": BAD_INTS,
    "rope.interleaved": BAD_FLAGS,
    "headwise.retrieval_heads": BAD_HEADS,
    "headwise.sink_token_num": BAD_INTS,
    "headwise.swa_token_num": BAD_INTS,
    "headwise.seqlen_threshold": BAD_INTS,
}


@st.composite
def spec_fields(draw: st.DrawFn) -> tuple[dict[str, Any], frozenset[str]]:
    """Fields of a valid spec (RoPE and headwise as nested dicts), then the corrupted names."""
    kv = draw(st.integers(1, 4))
    heads = kv * draw(st.integers(1, 4))
    dim = draw(st.sampled_from([8, 16, 64, 80, 128, 256]))
    causal = draw(st.booleans())
    logn = draw(st.booleans())
    fields: dict[str, Any] = {
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": dim,
        "dtype": draw(st.sampled_from(sorted(ab.reference.TOLERANCE, key=str))),
        "causal": causal,
        "use_logn_attn": logn,
        "logn_base": draw(st.integers(2, 8192)) if logn else None,
        "softmax_scale": draw(st.one_of(st.none(), st.floats(1e-3, 10.0))),
        "use_mla": draw(st.booleans()),
        "rope": None,
        "headwise": None,
    }
    if draw(st.booleans()):
        rotary = draw(st.one_of(st.none(), st.integers(1, dim // 2).map(lambda h: 2 * h)))
        fields["rope"] = {
            "theta": draw(st.sampled_from([1e4, 1e6, 500.0, 2])),
            "rotary_dim": rotary,
            "interleaved": draw(st.booleans()),
        }
    if causal and draw(st.booleans()):
        fields["headwise"] = {
            "retrieval_heads": draw(st.frozensets(st.integers(0, heads - 1), max_size=3)),
            "sink_token_num": draw(st.integers(0, 8)),
            "swa_token_num": draw(st.integers(0, 64)),
            "seqlen_threshold": draw(st.integers(0, 64)),
        }
    names = [n for n in CORRUPT if "." not in n or fields[n.split(".")[0]] is not None]
    corrupted = draw(st.sets(st.sampled_from(names), max_size=2))
    for name in sorted(corrupted):  # sorted: set order follows the per-process string hash
        group, _, key = name.rpartition(".")
        (fields[group] if group else fields)[key] = draw(CORRUPT[name])
    return fields, frozenset(corrupted)


def _check_spec(spec: ab.AttentionSpec) -> None:
    """What an accepted spec guarantees to every consumer."""
    for value in (spec.num_heads, spec.num_kv_heads, spec.head_dim):
        assert type(value) is int
        assert value > 0
    assert spec.num_heads % spec.num_kv_heads == 0
    for flag in (spec.causal, spec.use_logn_attn, spec.use_mla):
        assert type(flag) is bool
    assert spec.dtype in ab.reference.TOLERANCE
    assert math.isfinite(spec.scale)
    assert spec.scale > 0
    if spec.rope is not None:
        assert type(spec.rope.interleaved) is bool
        assert 0 < spec.rotary_dim <= spec.head_dim
        assert spec.rotary_dim % 2 == 0
        assert math.isfinite(spec.rope.theta)
    if spec.use_logn_attn:
        assert type(spec.logn_base) is int
    else:
        assert spec.logn_base is None
    if spec.headwise is not None:
        assert spec.causal
        assert all(
            type(h) is int and 0 <= h < spec.num_heads for h in spec.headwise.retrieval_heads
        )
    hash(spec)
    json.dumps(spec.to_dict())


@fuzz(600)
@given(case=spec_fields())
def test_fuzz_spec(case: tuple[dict[str, Any], frozenset[str]]) -> None:
    fields, corrupted = case

    def build() -> ab.AttentionSpec:
        if fields["rope"] is not None:
            fields["rope"] = ab.RopeSpec(**fields["rope"])
        if fields["headwise"] is not None:
            fields["headwise"] = ab.HeadwiseConfig(**fields["headwise"])
        return ab.AttentionSpec(**fields)

    spec, error = _attempt(build)
    if error is not None:
        assert corrupted, f"valid fields refused: {error}"
        _refused("spec", error)
        return
    assert spec is not None
    _check_spec(spec)
    _accepted("spec")


# ---- FMHAParams.from_lengths --------------------------------------------------------------


@st.composite
def params_args(draw: st.DrawFn) -> tuple[dict[str, Any], list[int] | None]:
    """Valid ``from_lengths`` arguments in every accepted form, then up to two corrupted; the
    plain lengths are returned when the call must succeed."""
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    if sum(lengths) == 0:
        lengths[draw(st.integers(0, len(lengths) - 1))] = 1
    form = draw(st.sampled_from(["list", "tuple", "int64", "int32"]))
    given_lengths: object = (
        lengths
        if form == "list"
        else tuple(lengths)
        if form == "tuple"
        else torch.tensor(lengths, dtype=torch.int64 if form == "int64" else torch.int32)
    )
    args: dict[str, Any] = {
        "input_lengths": given_lengths,
        "device": draw(st.sampled_from(["cpu", torch.device("cpu"), "cpu:0", "meta"])),
        "prefix_lengths": draw(st.sampled_from([None, [0] * len(lengths)])),
        "padded_rows": draw(
            st.one_of(st.none(), st.integers(0, 9).map(lambda p: sum(lengths) + p))
        ),
    }
    bad = {
        "input_lengths": st.one_of(
            st.lists(st.integers(-3, 3), max_size=4),
            st.lists(st.one_of(st.integers(0, 5), GARBAGE), min_size=1, max_size=4),
            st.sampled_from([None, 7, "123", [2**31, 1], [2**40], [2**31 - 1, 1], []]),
            st.sampled_from([torch.float32, torch.bool]).map(lambda d: torch.tensor(lengths).to(d)),
            st.just(torch.tensor(lengths, device="meta")),
            st.just(torch.tensor([lengths, lengths])),
        ),
        "device": st.sampled_from(["cuda", "nonsense", None, 3, "", "cuda:7"]),
        "prefix_lengths": st.one_of(st.lists(st.sampled_from([0, 1, 5]), max_size=7), GARBAGE),
        "padded_rows": st.one_of(st.integers(-1, sum(lengths) - 1), GARBAGE, st.just(2.0)),
    }
    corrupted = draw(st.sets(st.sampled_from(sorted(bad)), max_size=2))
    for name in sorted(corrupted):
        args[name] = draw(bad[name])
    return args, None if corrupted else lengths


def _check_params(p: ab.FMHAParams, args: dict[str, Any]) -> None:
    given_lengths = args["input_lengths"]
    lengths = (
        given_lengths.tolist() if isinstance(given_lengths, torch.Tensor) else list(given_lengths)
    )
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    assert p.input_lengths == tuple(lengths)
    assert p.token_q_num == p.token_kv_num == cu[-1] > 0
    assert p.batch_size == len(lengths)
    assert p.max_seqlen_q == p.max_seqlen_k == max(lengths)
    rows = args["padded_rows"]
    assert p.rows == (cu[-1] if rows is None else rows)
    assert p.device.type == torch.device(args["device"]).type
    for t in (p.cu_seqlens_q, p.cu_seqlens_k, p.positions):
        assert t.dtype == torch.int32
        assert t.device == p.device
    assert p.cu_seqlens_host == tuple(cu)
    if p.device.type != "meta":
        assert p.cu_seqlens_q.tolist() == cu
        assert p.positions.tolist() == [i for n in lengths for i in range(n)]


@fuzz(600)
@given(case=params_args())
def test_fuzz_params(case: tuple[dict[str, Any], list[int] | None]) -> None:
    args, valid = case
    params, error = _attempt(lambda: ab.FMHAParams.from_lengths(**args))
    if error is not None:
        assert valid is None, f"valid lengths {valid} refused: {error}"
        _refused("params", error)
        return
    assert params is not None
    _check_params(params, args)
    _accepted("params")


# ---- the packed-QKV contract, through the torch-sdpa backend -----------------------------


@st.composite
def valid_specs(draw: st.DrawFn) -> ab.AttentionSpec:
    kv = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([2, 4, 8, 16, 32]))
    rope = None
    if draw(st.booleans()):
        rotary = draw(st.one_of(st.none(), st.integers(1, dim // 2).map(lambda h: 2 * h)))
        rope = ab.RopeSpec(draw(st.sampled_from([1e4, 1e6, 50.0])), rotary, draw(st.booleans()))
    logn = draw(st.booleans())
    return ab.AttentionSpec(
        num_heads=kv * draw(st.integers(1, 3)),
        num_kv_heads=kv,
        head_dim=dim,
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        causal=draw(st.booleans()),
        rope=rope,
        use_logn_attn=logn,
        logn_base=draw(st.integers(2, 16)) if logn else None,
        softmax_scale=draw(st.one_of(st.none(), st.sampled_from([0.05, 0.3, 1.0]))),
    )


VALID_FORMS = ("plain", "row-strided", "every-other-row", "tuple-none", "tuple-empty")
INVALID_FORMS = (
    "col-strided",
    "overlapping-rows",
    "tuple-real-k",
    "tuple-real-v",
    "tuple-of-2",
    "list",
    "wrong-dtype",
    "int-dtype",
    "wrong-width",
    "too-few-rows",
    "one-dim",
    "three-dim",
    "qkv-on-meta",
    "params-on-meta",
    "not-a-tensor",
    "fp8-scales-for-float",
    "stale-plan",
)
GRAD_FORMS = ("requires-grad",)


@dataclass(eq=False)
class _Input:
    qkv: object
    backing: torch.Tensor | None
    """All memory the input can reach, to prove a refusal changed nothing."""
    packed: torch.Tensor | None
    params: ab.FMHAParams
    scales: ab.Fp8Scales | None = None
    stale_plan: bool = False


def _make(spec: ab.AttentionSpec, lengths: list[int], pad: int, form: str, seed: int) -> _Input:
    tokens = sum(lengths)
    rows = tokens + pad
    params = ab.FMHAParams.from_lengths(lengths, device="cpu", padded_rows=rows)
    width = spec.qkv_width
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    backing = rand(rows, width)
    packed: torch.Tensor = backing
    qkv: object = backing
    if form == "row-strided":
        backing = rand(rows, width + 10)
        packed = backing[:, 3 : 3 + width]
        qkv = packed
    elif form == "every-other-row":
        backing = rand(2 * rows, width)
        packed = backing[::2]
        qkv = packed
    elif form == "tuple-none":
        qkv = (backing, None, None)
    elif form == "tuple-empty":
        qkv = (backing, torch.empty(0, dtype=spec.dtype), torch.empty(0, 4, dtype=spec.dtype))
    elif form == "col-strided":
        backing = rand(width, rows + 1)  # two rows at least: one row is also column-stride 1
        packed = backing.t()
        qkv = packed
    elif form == "overlapping-rows":
        backing = rand(1, width)
        packed = backing.expand(max(rows, 2), width)
        qkv = packed
    elif form == "tuple-real-k":
        qkv = (backing, rand(tokens, spec.kv_width), None)
    elif form == "tuple-real-v":
        qkv = (backing, torch.empty(0, dtype=spec.dtype), rand(tokens, spec.kv_width))
    elif form == "tuple-of-2":
        qkv = (backing, None)
    elif form == "list":
        qkv = [backing, None, None]
    elif form == "wrong-dtype":
        other = torch.float32 if spec.dtype != torch.float32 else torch.float16
        backing = packed = rand(rows, width, dtype=other)
        qkv = packed
    elif form == "int-dtype":
        backing = packed = torch.randint(-3, 3, (rows, width), generator=gen, dtype=torch.int32)
        qkv = packed
    elif form == "wrong-width":
        backing = packed = rand(rows, width + spec.head_dim)
        qkv = packed
    elif form == "too-few-rows":
        backing = packed = rand(tokens - 1, width)
        qkv = packed
    elif form == "one-dim":
        backing = packed = rand(rows * width)
        qkv = packed
    elif form == "three-dim":
        backing = packed = rand(rows, 1, width)
        qkv = packed
    elif form == "qkv-on-meta":
        qkv = torch.empty(rows, width, dtype=spec.dtype, device="meta")
        return _Input(qkv, None, None, params)
    elif form == "params-on-meta":
        meta = ab.FMHAParams.from_lengths(lengths, device="meta", padded_rows=rows)
        return _Input(qkv, backing, packed, meta)
    elif form == "not-a-tensor":
        return _Input(backing.tolist(), None, None, params)
    elif form == "fp8-scales-for-float":
        one = torch.ones((), dtype=torch.float32)
        return _Input(qkv, backing, packed, params, ab.Fp8Scales(one, one, one))
    elif form == "stale-plan":
        return _Input(qkv, backing, packed, params, stale_plan=True)
    elif form == "requires-grad":
        backing = packed = rand(rows, width).requires_grad_(True)
        qkv = packed
    return _Input(qkv, backing, packed, params)


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


SDPA = ab.deploy.Registry()
SDPA.register_plugin(torch_sdpa, name="torch-sdpa")


@fuzz(800)
@given(
    spec=valid_specs(),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda v: sum(v) > 0),
    pad=st.integers(0, 3),
    form=st.sampled_from(VALID_FORMS + VALID_FORMS + INVALID_FORMS + GRAD_FORMS),
    seed=st.integers(0, 2**16),
)
def test_fuzz_forward(
    spec: ab.AttentionSpec, lengths: list[int], pad: int, form: str, seed: int
) -> None:
    backend = ab.select(spec, backend="torch-sdpa", platform="cpu", registry=SDPA).backend
    data = _make(spec, lengths, pad, form, seed)
    before = _snapshot(data.backing) if data.backing is not None else None
    plan_params = data.params
    plan_spec = spec
    if data.stale_plan:
        plan_spec = ab.AttentionSpec(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, causal=not spec.causal
        )

    def run() -> torch.Tensor:
        planner = (
            backend
            if plan_spec == spec
            else ab.select(plan_spec, backend="torch-sdpa", platform="cpu", registry=SDPA).backend
        )
        plan = planner.prepare(plan_params)
        return backend.forward(data.qkv, plan, fp8_scales=data.scales)  # type: ignore[arg-type]

    out, error = _attempt(run)
    if error is not None:
        _refused("forward", error)
        assert form not in VALID_FORMS, f"{form} input refused: {error}"
        if data.backing is not None and before is not None:
            assert torch.equal(data.backing.detach(), before), "a refused input was modified"
        return
    assert out is not None
    assert form in VALID_FORMS + GRAD_FORMS, f"{form} input was accepted"
    assert data.packed is not None
    assert before is not None
    tokens = data.params.token_q_num
    assert tuple(out.shape) == (tokens, spec.q_width)
    assert out.dtype == spec.dtype
    pristine = before if data.packed is data.backing else _pristine_view(before, data)
    ref = ab.reference_attention(pristine, spec, data.params)
    err = ab.reference.relative_error(out, ref)
    assert err < ab.reference.TOLERANCE[spec.dtype], f"relative error {err:.3g} for {form}"
    v_cols = slice(spec.q_width + spec.kv_width, spec.qkv_width)
    assert torch.equal(data.packed[:, v_cols].detach(), pristine[:, v_cols]), "V written"
    assert torch.equal(data.packed[tokens:].detach(), pristine[tokens:]), "padding written"
    _accepted("forward")


def _pristine_view(before: torch.Tensor, data: _Input) -> torch.Tensor:
    """The packed view, cut from the copy of the backing buffer taken before the call."""
    assert data.packed is not None
    assert data.backing is not None
    offset = data.packed.storage_offset() - data.backing.storage_offset()
    return before.as_strided(data.packed.shape, data.packed.stride(), offset)


# ---- select ---------------------------------------------------------------------------------


@st.composite
def any_specs(draw: st.DrawFn) -> ab.AttentionSpec:
    spec = draw(valid_specs())
    dtype = draw(st.sampled_from([spec.dtype] * 4 + [torch.float8_e4m3fn, torch.bfloat16]))
    mla = draw(st.sampled_from([False] * 5 + [True]))
    headwise = None
    if spec.causal and not draw(st.integers(0, 3)):
        headwise = ab.HeadwiseConfig(frozenset({0}), sink_token_num=2, swa_token_num=4)
    head_dim = draw(st.sampled_from([spec.head_dim, 64, 128, 256]))
    rope = spec.rope if spec.rope is None or spec.rotary_dim <= head_dim else None
    return ab.AttentionSpec(
        spec.num_heads,
        spec.num_kv_heads,
        head_dim,
        dtype,
        spec.causal,
        rope,
        spec.use_logn_attn,
        spec.logn_base,
        spec.softmax_scale,
        mla,
        headwise,
    )


GOOD_PLATFORMS = ["cpu", "cuda:sm80", "cuda:sm90", "cuda:sm_100a", "cuda:sm75", "rocm:gfx942"]


@st.composite
def select_args(draw: st.DrawFn) -> dict[str, Any]:
    """A request an engine could make (which may still fit no backend), then up to two of its
    arguments corrupted."""
    args: dict[str, Any] = {
        "spec": draw(any_specs()),
        "platform": draw(st.sampled_from([None, None, "rocm:gfx90a", *GOOD_PLATFORMS])),
        "device": draw(st.sampled_from([None, "cpu"])),
        "has_kv_cache": False,
        "need_rope_kv_cache": None,
        "backend": draw(st.sampled_from([None, None, None, "torch-sdpa", "flashinfer"])),
        "strict": draw(st.booleans()),
    }
    bad: dict[str, st.SearchStrategy[object]] = {
        "platform": st.one_of(
            st.sampled_from(["cuda", "cpu:sm90", "tpu", "cuda:sm9", "rocm:mi300", 7]),
            st.text(max_size=12),
        ),
        "device": st.sampled_from(["meta", "cuda", "nonsense", "cuda:3", 2.5]),
        "has_kv_cache": st.just(True),
        "need_rope_kv_cache": st.booleans(),
        "backend": st.sampled_from(["no-such-backend", "", 3]),
    }
    for name in sorted(draw(st.sets(st.sampled_from(sorted(bad)), max_size=2))):
        args[name] = draw(bad[name])
    return args


@pytest.fixture(scope="module")
def installed() -> ab.deploy.Registry:
    """Every installed plugin, loaded through the entry points, as an engine would see them."""
    reg = ab.deploy.Registry()
    reg.load_entry_points(policy=ab.deploy.PluginPolicy())
    return reg


@fuzz(500)
@given(args=select_args())
def test_fuzz_select(installed: ab.deploy.Registry, args: dict[str, Any]) -> None:
    sel, error = _attempt(lambda: ab.select(registry=installed, **args))
    if error is not None:
        _refused("select", error)
        return
    assert sel is not None
    assert not args["has_kv_cache"]
    if args["backend"] is not None:
        assert sel.name == args["backend"]
        assert sel.source == "explicit"
    assert sel.candidates[0].verdict == "selected"
    assert sel.candidates[0].name == sel.name
    assert sel.backend.spec == args["spec"]
    expected = "off" if not args["strict"] else "skipped" if sel.platform.assumed else "passed"
    assert sel.canary.status == expected
    assert sel.explain().startswith(f"selected: {sel.name}")
    json.dumps(sel.to_dict())
    assert ab.select(registry=installed, **args) is sel, "the same request was decided twice"
    _accepted("select")


def test_fuzz_case_counts() -> None:
    """Runs last in this file: each property tried at least its floor of cases."""
    per_kind = Counter(key.split(":")[0] for key in CASES.elements())
    if not all(per_kind[kind] for kind in MIN_CASES):
        pytest.skip("run the whole file to count cases")
    for kind, floor in MIN_CASES.items():
        assert per_kind[kind] >= floor, f"{kind}: only {per_kind[kind]} cases"
        assert CASES[f"{kind}: accepted"] > 0, f"{kind}: nothing accepted"
