"""A fake ``aiter`` module for CPU tests: one release's signatures, aiter's checks, torch math.

It stands in for one generation of amd-aiter (`tests.aiter_signatures.Release`), whose
``import aiter`` fails without ROCm. It offers the three varlen entry points the backends call
with that release's parameter lists, exposed the way the real package exposes them:

* the compiled ops ``mha_varlen_fwd`` and ``fmha_v3_varlen_fwd`` take ``(*args, **kwargs)`` in
  Python (aiter wraps them in ``torch_compile_guard``) and bind each call to the declared
  schema, so a missing or unknown argument raises ``RuntimeError`` as ``torch.ops`` does;
  their declared list is ``aiter.ops.mha``, which the fake maps to the release's stub module;
* the Python function ``flash_attn_varlen_fp8_pertensor_func`` shows its real signature and
  raises ``TypeError`` on a bad call.

Each call is then checked the way aiter checks it:

* the C++ ``TORCH_CHECK``s: dtypes, unit last-dim stride, int32 contiguous ``cu_seqlens`` on
  Q's device, ``Hq % Hk == 0``, head dim limits, descales all given or none;
* aiter's own isinstance checks of op arguments (aiter/jit/core.py ``check_args``): a Python
  int where a float is declared is refused;
* what the kernel reads through raw pointers: a descale must be a float32 one-element tensor on
  Q's device, or the kernel would read other bytes;
* which kernels exist: the ASM kernels only for bf16 d128 (d192/128 on gfx950) on gfx942/gfx950
  and the right CU counts, the FP8 kernels only for the arch's FP8 dtype at d128.

Then it computes attention per sequence in float32 (GQA, bottom-right causal) and returns what
aiter returns. Nothing hides a NaN: a row with no visible key is NaN, and output rows no
sequence covers are NaN, as uninitialised memory would be garbage. Every call and every public
attribute read is recorded.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any

import pytest
import torch
from attn_backends_builtin import _aiter_binding

from tests.aiter_signatures import NEWEST, Release

ASM_ARCHS = frozenset({"gfx942", "gfx950"})
CK_ARCHS = frozenset({"gfx90a", "gfx942", "gfx950"})
ASM_GFX942_CU_COUNTS = frozenset({304, 80, 64})
NATIVE_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
E4M3 = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz})
COMPILED_OPS = frozenset({"mha_varlen_fwd", "fmha_v3_varlen_fwd"})
FP8_ENTRY = "flash_attn_varlen_fp8_pertensor_func"
DESCALES = ("q_descale", "k_descale", "v_descale")


def stub_of(release: Release, name: str) -> Callable[..., Any]:
    """The release's declaration of ``name``: only its parameters matter, it is never run."""
    stub = vars(release.stubs)[name]
    assert callable(stub)
    return typing.cast(Callable[..., Any], stub)


def _check_types(stub: Callable[..., Any], name: str, arguments: dict[str, Any]) -> None:
    """aiter's isinstance check of op arguments against the declared types."""
    hints = typing.get_type_hints(stub)
    for param, value in arguments.items():
        hint = hints.get(param)
        if hint is None:
            continue
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = typing.get_args(hint) if union else (hint,)
        if value is None and type(None) in options:
            continue
        allowed = tuple(t for t in options if t is not type(None))
        if not isinstance(value, allowed):
            raise TypeError(f"{name}: {param} needs to be {hint} but got {type(value)}")


@dataclass(frozen=True)
class Call:
    """One recorded call: the public function, its arguments by parameter name (defaults
    filled in), and how many of them came positionally."""

    name: str
    args: dict[str, Any]
    positional: int


def _fail(message: str) -> RuntimeError:
    return RuntimeError(message)


def _check_varlen(a: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The checks the C++ varlen entry points make; returns host cu_seqlens q and k."""
    q, k, v = a["q"], a["k"], a["v"]
    for t in (q, k, v):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise _fail("q, k and v must be [tokens, heads, head_dim] tensors")
        if t.stride(-1) != 1:
            raise _fail("Input tensor must have contiguous last dimension")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise _fail("query, key and value must have the same dtype")
    if a["block_table"] is not None or a["bias"] is not None:
        raise NotImplementedError("the fake serves no block_table or bias")
    cu_k = a["cu_seqlens_k"]
    if cu_k is None:
        raise _fail("cu_seqlens_k is required without a block_table")
    for cu_name, cu in (("cu_seqlens_q", a["cu_seqlens_q"]), ("cu_seqlens_k", cu_k)):
        if cu.dtype != torch.int32:
            raise _fail(f"{cu_name} must have dtype int32")
        if cu.device != q.device:
            raise _fail(f"{cu_name} must be on the device of q")
        if not cu.is_contiguous() or cu.dim() != 1:
            raise _fail(f"{cu_name} must be contiguous and 1-D")
    cuq = [int(x) for x in a["cu_seqlens_q"].tolist()]
    cuk = [int(x) for x in cu_k.tolist()]
    if len(cuq) < 2 or len(cuk) != len(cuq):
        raise _fail("batch size must be positive and cu_seqlens_q/k of one length")
    hq, hk = q.shape[1], k.shape[1]
    if v.shape[1] != hk or v.shape[0] != k.shape[0] or hq % hk:
        raise _fail("Number of heads in key/value must divide number of heads in query")
    dq, dv = q.shape[2], v.shape[2]
    if k.shape[2] != dq or dq > 256 or dv > 256 or dq % 8 or dv % 8:
        raise _fail("head sizes must be multiples of 8 and at most 256")
    if cuq[-1] > q.shape[0] or cuk[-1] > k.shape[0]:
        raise _fail("cu_seqlens reach past the end of q/k: the kernel would read out of bounds")
    longest_q = max(b - a_ for a_, b in itertools.pairwise(cuq))
    longest_k = max(b - a_ for a_, b in itertools.pairwise(cuk))
    if a["max_seqlen_q"] < longest_q or a["max_seqlen_k"] < longest_k:
        raise _fail("max_seqlen below the longest sequence: the kernel grid would skip rows")
    return cuq, cuk


def _window(a: dict[str, Any]) -> tuple[int, int]:
    """The CK op's window after its own normalisation: a bound reaching past the longest key
    sequence is unbounded (-1), and ``is_causal`` forces ``right = 0``."""
    left, right = a["window_size_left"], a["window_size_right"]
    left = -1 if left >= a["max_seqlen_k"] else left
    right = -1 if right >= a["max_seqlen_k"] else right
    return (left, 0) if a["is_causal"] else (left, right)


def _check_no_window_or_sink(a: dict[str, Any]) -> None:
    if _window(a) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError("the fake serves no sliding window here")
    if a.get("sink_size", 0) != 0 or a.get("sink_ptr") is not None:
        raise NotImplementedError("the fake serves no attention sink")


def _alibi_slopes(a: dict[str, Any], q: torch.Tensor) -> list[float] | None:
    """The slopes the CK op reads: ``[Hq]`` (or ``[batch, Hq]``, not used here), last dim
    contiguous, on q's device (C++ checks), read through a float pointer (so float32)."""
    slopes = a.get("alibi_slopes")
    if slopes is None:
        return None
    if slopes.device != q.device or slopes.stride(-1) != 1:
        raise _fail("ALiBi slopes tensor must be on q's device with contiguous last dimension")
    if tuple(slopes.shape) != (q.shape[1],):
        raise NotImplementedError("the fake serves ALiBi slopes of shape [Hq] only")
    if slopes.dtype != torch.float32:
        raise _fail(f"alibi_slopes is read through a float pointer: float32, not {slopes.dtype}")
    return [float(x) for x in slopes.tolist()]


def _descales(a: dict[str, Any], q: torch.Tensor) -> tuple[float, float, float] | None:
    """The per-tensor descales the kernel would read, checked as its raw pointers need."""
    given = [a.get(name) for name in DESCALES]
    if all(t is None for t in given):
        return None
    if any(t is None for t in given):
        raise _fail("q_descale, k_descale, v_descale must be all provided or all not provided")
    values = []
    for name, t in zip(DESCALES, given, strict=True):
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.float32
            or t.numel() != 1
            or t.device != q.device
        ):
            raise _fail(
                f"{name} is read through a float pointer: it must be a float32 one-element "
                f"tensor on q's device, got {t!r}"
            )
        values.append(float(t.item()))
    return values[0], values[1], values[2]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cuq: list[int],
    cuk: list[int],
    scale: float,
    causal: bool,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    slopes: list[float] | None = None,
) -> torch.Tensor:
    """Float32 varlen attention as CK computes it, bottom-right aligned as in aiter.

    ``window`` is the op's normalised ``(left, right)``: key ``j`` is seen by query ``i`` when
    ``i' - left <= j <= i' + right`` with ``i' = i + lk - lq``, -1 unbounded. ``softcap`` > 0
    maps the scaled score ``s`` to ``softcap * tanh(s / softcap)``. ``slopes`` adds ALiBi as
    CK's position encoding does (ck_tile block_position_encoding): ``slope * j`` for a causal
    mask without a window, ``-slope * |i' - j|`` otherwise.

    A row that sees no key comes out NaN: in a no-cache prefill every causal row sees at least
    its own position, so such a row is a bug to surface, not a value to hide.
    """
    hq, hk = q.shape[1], k.shape[1]
    out = torch.full((q.shape[0], hq, v.shape[2]), float("nan"), dtype=torch.float32)
    for b in range(len(cuq) - 1):
        qs = q[cuq[b] : cuq[b + 1]].to(torch.float32)
        ks = k[cuk[b] : cuk[b + 1]].to(torch.float32).repeat_interleave(hq // hk, dim=1)
        vs = v[cuk[b] : cuk[b + 1]].to(torch.float32).repeat_interleave(hq // hk, dim=1)
        lq, lk = qs.shape[0], ks.shape[0]
        if lq == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        left, right = (window[0], 0) if causal else window
        if slopes is not None:
            vertical = causal and left < 0
            position = j.expand(lq, lk) if vertical else -(i - j).abs()
            scores = scores + torch.tensor(slopes)[:, None, None] * position
        if right >= 0:
            scores = scores.masked_fill(j > i + right, float("-inf"))
        if left >= 0:
            scores = scores.masked_fill(j < i - left, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[cuq[b] : cuq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vs)
    return out


class FakeAiterModule(types.ModuleType):
    """What ``sys.modules["aiter"]`` holds; notes every public attribute read."""

    def __init__(self, fake: FakeAiter) -> None:
        super().__init__("aiter")
        self._fake = fake

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            types.ModuleType.__getattribute__(self, "_fake").accessed.append(name)
        return types.ModuleType.__getattribute__(self, name)


class PythonFunction:
    """A plain Python aiter function: `inspect.signature` sees the release's parameter list."""

    def __init__(self, impl: Callable[..., Any], signature: inspect.Signature) -> None:
        self._impl = impl
        self.__signature__ = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl(*args, **kwargs)


@dataclass
class FakeAiter:
    """The fake library for one release on one GPU: arch and CU count decide which kernels
    exist."""

    release: Release = NEWEST
    gfx: str = "gfx942"
    cu_count: int = 304
    calls: list[Call] = field(default_factory=list)
    accessed: list[str] = field(default_factory=list)

    @property
    def fp8(self) -> torch.dtype:
        """``aiter.dtypes.fp8``: the arch's FP8 format, ``uint8`` where there is none."""
        return NATIVE_FP8.get(self.gfx, torch.uint8)

    def module(self) -> FakeAiterModule:
        mod = FakeAiterModule(self)
        mod.mha_varlen_fwd = self.mha_varlen_fwd  # type: ignore[attr-defined]
        mod.fmha_v3_varlen_fwd = self.fmha_v3_varlen_fwd  # type: ignore[attr-defined]
        mod.flash_attn_varlen_fp8_pertensor_func = PythonFunction(  # type: ignore[attr-defined]
            self.flash_attn_varlen_fp8_pertensor_func,
            inspect.signature(stub_of(self.release, FP8_ENTRY)),
        )
        mod.dtypes = types.SimpleNamespace(  # type: ignore[attr-defined]
            fp8=self.fp8, bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32
        )
        return mod

    def version_module(self) -> types.ModuleType:
        """``aiter._version``, as setuptools-scm writes it into a built aiter."""
        mod = types.ModuleType("aiter._version")
        mod.__version__ = self.release.version  # type: ignore[attr-defined]
        return mod

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Bind a call to the release's declaration (defaults filled in) and record it."""
        signature = inspect.signature(stub_of(self.release, name))
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            if name in COMPILED_OPS:
                # torch.ops binds a compiled op's call to its schema and raises RuntimeError.
                raise RuntimeError(f"aiter::{name}() {exc}") from exc
            raise
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        self.calls.append(Call(name, arguments, len(args)))
        return arguments

    # The two compiled ops.

    def mha_varlen_fwd(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        a = self._record("mha_varlen_fwd", args, kwargs)
        _check_types(stub_of(self.release, "mha_varlen_fwd"), "mha_varlen_fwd", a)
        return self._ck(a)

    def fmha_v3_varlen_fwd(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        a = self._record("fmha_v3_varlen_fwd", args, kwargs)
        _check_types(stub_of(self.release, "fmha_v3_varlen_fwd"), "fmha_v3_varlen_fwd", a)
        return self._asm(a)

    # The Python FP8 entry point, routed to the CK kernel as aiter routes it.

    def flash_attn_varlen_fp8_pertensor_func(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        a = self._record(FP8_ENTRY, args, kwargs)
        q = a["q"]
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else q.shape[-1] ** -0.5
        window = tuple(a["window_size"])
        op = {
            **{n: a[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")},
            **{n: a[n] for n in ("max_seqlen_q", "max_seqlen_k", "min_seqlen_q")},
            "dropout_p": 0.0,
            "softmax_scale": scale,
            "logits_soft_cap": a["logits_soft_cap"],
            "zero_tensors": False,
            "is_causal": a["causal"],
            "window_size_left": int(window[0]),
            "window_size_right": int(window[1]),
            "sink_size": int(window[2]) if len(window) == 3 else 0,
            "return_softmax_lse": False,
            "return_dropout_randval": False,
            "out": None,
            "block_table": None,
            "bias": None,
            "alibi_slopes": None,
            **{name: a.get(name) for name in DESCALES},
            "sink_ptr": a.get("sink_ptr"),
        }
        return self._ck(op)[0]

    # Kernel emulation.

    def _ck(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        cuq, cuk = _check_varlen(a)
        if self.gfx not in CK_ARCHS:
            raise _fail(f"no CK fmha kernels for {self.gfx}")
        q = a["q"]
        fp8 = q.dtype in E4M3
        if q.dtype not in (torch.float16, torch.bfloat16) and not fp8:
            raise _fail("FlashAttention only support fp16, bf16 and fp8_e4m3 data type")
        descales = _descales(a, q)
        if fp8:
            if q.dtype != self.fp8:
                raise _fail(f"no fp8bf16 kernel for {q.dtype} on {self.gfx}")
            if q.shape[2] != 128 or a["v"].shape[2] != 128:
                raise _fail("aiter builds fp8bf16 varlen kernels for head dim 128 only")
            if a["min_seqlen_q"] or a["logits_soft_cap"] or a["return_softmax_lse"]:
                raise _fail("fp8 kernels have no skip, soft cap or lse variants")
        elif descales is not None:
            raise _fail(f"no {q.dtype} kernel with per-tensor descales")
        if a["dropout_p"] != 0.0 or a["return_dropout_randval"]:
            raise NotImplementedError("the fake serves no dropout")
        if a.get("cu_seqlens_q_padded") is not None or a.get("cu_seqlens_k_padded") is not None:
            raise NotImplementedError("the fake serves no padded cu_seqlens")
        if a.get("sink_size", 0) != 0 or a.get("sink_ptr") is not None:
            raise NotImplementedError("the fake serves no attention sink")
        features = {
            "window": _window(a),
            "softcap": float(a["logits_soft_cap"]),
            "slopes": _alibi_slopes(a, q),
        }
        if fp8 and (features["window"] not in ((-1, -1), (-1, 0)) or features["slopes"]):
            raise NotImplementedError("the fake serves no window or ALiBi on FP8")
        scale, out_scale = a["softmax_scale"], 1.0
        if descales is not None:
            scale, out_scale = scale * descales[0] * descales[1], descales[2]
        out_dtype = torch.bfloat16 if fp8 else q.dtype
        return self._finish(a, cuq, cuk, out_dtype, scale, out_scale, **features)

    def _asm(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        cuq, cuk = _check_varlen(a)
        q, v = a["q"], a["v"]
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise _fail("FlashAttention only support fp16 and bf16 data type")
        if _descales(a, q) is not None:
            raise NotImplementedError("the fake serves no ASM descales")
        _check_no_window_or_sink(a)
        if a["logits_soft_cap"] != 0.0 or a["alibi_slopes"] is not None:
            raise _fail("invalid argument for fmha_v3_varlen_fwd: no soft cap or ALiBi kernels")
        dims = (q.shape[2], v.shape[2])
        kernel = (
            self.gfx in ASM_ARCHS
            and q.dtype == torch.bfloat16
            and (dims == (128, 128) or (self.gfx == "gfx950" and dims == (192, 128)))
            and a["dropout_p"] == 0.0
            and a["how_v3_bf16_cvt"] in (0, 1, 2)
        )
        if not kernel:
            raise _fail("invalid argument for fmha_v3_varlen_fwd 3")
        if self.gfx == "gfx942" and self.cu_count not in ASM_GFX942_CU_COUNTS:
            raise _fail(f"no gfx942 ASM kernel objects for {self.cu_count} CUs")
        return self._finish(a, cuq, cuk, q.dtype, a["softmax_scale"], 1.0)

    def _finish(
        self,
        a: dict[str, Any],
        cuq: list[int],
        cuk: list[int],
        out_dtype: torch.dtype,
        scale: float,
        out_scale: float,
        **features: Any,
    ) -> tuple[torch.Tensor, ...]:
        q = a["q"]
        out = attention(q, a["k"], a["v"], cuq, cuk, scale, a["is_causal"], **features)
        out = out * out_scale
        result = out.to(device=q.device, dtype=out_dtype)
        given = a["out"]
        if given is not None:
            if given.dtype != out_dtype or given.shape != result.shape or given.stride(-1) != 1:
                raise _fail("out must match [total_q, Hq, Dv], the output dtype and stride 1")
            result = given.copy_(result)
        lse = torch.empty(0, dtype=torch.float32, device=q.device)
        p = torch.empty(0, device=q.device)
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        return result, lse, p, rng


def install(
    monkeypatch: pytest.MonkeyPatch,
    gfx: str = "gfx942",
    cu_count: int = 304,
    release: Release = NEWEST,
) -> FakeAiter:
    """Put a fresh fake at ``sys.modules["aiter"]`` for one test; monkeypatch undoes it.

    ``aiter.ops.mha`` is the release's stub module (where the real package declares its ops)
    and ``aiter._version`` reports its version. The backends' bindings start empty, so what
    ``describe`` reports comes from this fake only.
    """
    fake = FakeAiter(release=release, gfx=gfx, cu_count=cu_count)
    monkeypatch.setitem(sys.modules, "aiter", fake.module())
    monkeypatch.setitem(sys.modules, "aiter.ops.mha", release.stubs)
    monkeypatch.setitem(sys.modules, "aiter._version", fake.version_module())
    monkeypatch.setattr(_aiter_binding, "_BOUND", {})
    return fake


class _FailingLoader(Loader):
    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        # What the real package raises from its JIT setup on a machine without ROCm.
        raise RuntimeError("ROCm version file not found")


class _FailingFinder(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> ModuleSpec | None:
        return ModuleSpec("aiter", _FailingLoader()) if fullname == "aiter" else None


def install_failing_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import aiter`` raise RuntimeError, as the real package does off ROCm."""
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder(), *sys.meta_path])
