"""A fake ``aiter`` module for CPU tests: real signatures, real argument checks, torch math.

It stands in for amd-aiter 0.1.7.post2.dev18, whose ``import aiter`` fails without ROCm. Four
varlen entry points are offered with the exact parameter lists of aiter/ops/mha.py (see the
``_sig_*`` stubs; ``test_fake_signatures_match_aiter_source`` compares them with the real source
when it is available). Every call is bound to its stub, so a wrong keyword raises ``TypeError``
as it would on the real module, then checked the way aiter checks it:

* the C++ ``TORCH_CHECK``s: dtypes, unit last-dim stride, int32 contiguous ``cu_seqlens`` on
  Q's device, ``Hq % Hk == 0``, head dim limits (aiter_meta/csrc/py_itfs_*/..._varlen_fwd*.cu);
* aiter's own isinstance checks of op arguments (``int``, ``float``, ``bool``...,
  aiter/jit/core.py:813-890): a Python int where a float is declared is refused;
* which kernels exist: the ASM kernels only for bf16 d128 (d192/128 on gfx950) on gfx942/gfx950
  and the right CU counts, the FP8 kernels only for the arch's FP8 dtype at d128.

Then it computes attention per sequence in float32 (GQA, bottom-right causal) and returns what
aiter returns. Output rows that no sequence covers are NaN, as uninitialised memory would be
garbage. Every call and every public attribute read is recorded.
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

AITER_VERSION = "0.1.7.post2.dev18"
ASM_ARCHS = frozenset({"gfx942", "gfx950"})
CK_ARCHS = frozenset({"gfx90a", "gfx942", "gfx950"})
ASM_GFX942_CU_COUNTS = frozenset({304, 80, 64})
NATIVE_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
E4M3 = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz})


# Signatures of aiter/ops/mha.py (amd-aiter 0.1.7.post2.dev18). Only names, order, defaults and
# declared types matter; bodies are never run.


def _sig_mha_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
) -> None: ...


def _sig_fmha_v3_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    min_seqlen_q: int,
    dropout_p: float,
    softmax_scale: float,
    logits_soft_cap: float,
    zero_tensors: bool,
    is_causal: bool,
    window_size_left: int,
    window_size_right: int,
    return_softmax_lse: bool,
    return_dropout_randval: bool,
    how_v3_bf16_cvt: int,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
) -> None: ...


def _sig_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    dropout_p=0.0,
    softmax_scale=None,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1),
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    how_v3_bf16_cvt=1,
    block_table=None,
    out=None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
) -> None: ...


def _sig_flash_attn_varlen_fp8_pertensor_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1),
    softmax_scale=None,
) -> None: ...


SIGNATURES: dict[str, Callable[..., None]] = {
    "mha_varlen_fwd": _sig_mha_varlen_fwd,
    "fmha_v3_varlen_fwd": _sig_fmha_v3_varlen_fwd,
    "flash_attn_varlen_func": _sig_flash_attn_varlen_func,
    "flash_attn_varlen_fp8_pertensor_func": _sig_flash_attn_varlen_fp8_pertensor_func,
}
"""Public name -> stub with the real parameter list."""


def _bind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bind a call to the real signature (TypeError on a wrong name), defaults filled in."""
    bound = inspect.signature(SIGNATURES[name]).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _check_types(name: str, arguments: dict[str, Any]) -> None:
    """aiter's isinstance check of op arguments against the declared types."""
    hints = typing.get_type_hints(SIGNATURES[name])
    for param, value in arguments.items():
        hint = hints.get(param)
        if hint is None:
            continue
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed = tuple(t for t in options if t is not type(None))
        if value is None and type(None) in options:
            continue
        if not isinstance(value, allowed):
            raise TypeError(f"{name}: {param} needs to be {hint} but got {type(value)}")


@dataclass(frozen=True)
class Call:
    """One recorded call: the public function and its arguments by parameter name."""

    name: str
    args: dict[str, Any]


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
    if a["block_table"] is not None or a["bias"] is not None or a["alibi_slopes"] is not None:
        raise NotImplementedError("the fake serves no block_table, bias or alibi")
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
    left, right = a["window_size_left"], a["window_size_right"]
    left = -1 if left >= a["max_seqlen_k"] else left
    right = -1 if right >= a["max_seqlen_k"] else right
    if (left, right) != (-1, -1):
        raise NotImplementedError("the fake serves no sliding window")
    return left, right


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cuq: list[int],
    cuk: list[int],
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """Float32 varlen attention; causal is bottom-right aligned as in aiter."""
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
        if causal:
            i = torch.arange(lq)[:, None]
            j = torch.arange(lk)[None, :]
            scores = scores.masked_fill(j > i + (lk - lq), float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
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


@dataclass
class FakeAiter:
    """The fake library for one GPU: arch and CU count decide which kernels exist."""

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
        mod.flash_attn_varlen_func = self.flash_attn_varlen_func  # type: ignore[attr-defined]
        mod.flash_attn_varlen_fp8_pertensor_func = (  # type: ignore[attr-defined]
            self.flash_attn_varlen_fp8_pertensor_func
        )
        mod.dtypes = types.SimpleNamespace(  # type: ignore[attr-defined]
            fp8=self.fp8, bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32
        )
        return mod

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = _bind(name, args, kwargs)
        self.calls.append(Call(name, bound))
        return bound

    # The two compiled ops (what the backends call).

    def mha_varlen_fwd(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return self._ck(self._record("mha_varlen_fwd", args, kwargs))

    def fmha_v3_varlen_fwd(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return self._asm(self._record("fmha_v3_varlen_fwd", args, kwargs))

    # The Python wrappers (aiter/ops/mha.py:2380 and :2730), routing as aiter does.

    def flash_attn_varlen_func(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        a = self._record("flash_attn_varlen_func", args, kwargs)
        if a["return_lse"] or a["return_attn_probs"] or a["out"] is not None:
            raise NotImplementedError("the fake returns the output only")
        q, v = a["q"], a["v"]
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else q.shape[-1] ** -0.5
        op = {
            **{n: a[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")},
            **{n: a[n] for n in ("max_seqlen_q", "max_seqlen_k", "min_seqlen_q", "dropout_p")},
            "softmax_scale": scale,
            "logits_soft_cap": a["logits_soft_cap"],
            "zero_tensors": False,
            "is_causal": a["causal"],
            "window_size_left": a["window_size"][0],
            "window_size_right": a["window_size"][1],
            "return_softmax_lse": False,
            "return_dropout_randval": False,
            "out": None,
            "block_table": a["block_table"],
            "bias": a["bias"],
            "alibi_slopes": a["alibi_slopes"],
            "gen": None,
        }
        asm = (
            a["bias"] is None
            and a["alibi_slopes"] is None
            and a["dropout_p"] == 0.0
            and v.shape[-1] == 128
            and (q.shape[-1] == 128 or (self.gfx == "gfx950" and q.shape[-1] == 192))
            and q.dtype == torch.bfloat16
            and a["cu_seqlens_q_padded"] is None
            and a["cu_seqlens_k_padded"] is None
        )
        if asm:
            return self._asm({**op, "how_v3_bf16_cvt": a["how_v3_bf16_cvt"]})[0]
        return self._ck({**op, "cu_seqlens_q_padded": None, "cu_seqlens_k_padded": None})[0]

    def flash_attn_varlen_fp8_pertensor_func(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        a = self._record("flash_attn_varlen_fp8_pertensor_func", args, kwargs)
        q = a["q"]
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else q.shape[-1] ** -0.5
        op = {
            **{n: a[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")},
            **{n: a[n] for n in ("max_seqlen_q", "max_seqlen_k", "min_seqlen_q")},
            "dropout_p": 0.0,
            "softmax_scale": scale,
            "logits_soft_cap": a["logits_soft_cap"],
            "zero_tensors": False,
            "is_causal": a["causal"],
            "window_size_left": int(a["window_size"][0]),
            "window_size_right": int(a["window_size"][1]),
            "return_softmax_lse": False,
            "return_dropout_randval": False,
            "out": None,
            "block_table": None,
            "bias": None,
            "alibi_slopes": None,
            "gen": None,
            "cu_seqlens_q_padded": None,
            "cu_seqlens_k_padded": None,
        }
        return self._ck(op)[0]

    # Kernel emulation.

    def _ck(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        _check_types("mha_varlen_fwd", a)
        cuq, cuk = _check_varlen(a)
        if self.gfx not in CK_ARCHS:
            raise _fail(f"no CK fmha kernels for {self.gfx}")
        q = a["q"]
        fp8 = q.dtype in E4M3
        if q.dtype not in (torch.float16, torch.bfloat16) and not fp8:
            raise _fail("FlashAttention only support fp16, bf16 and fp8_e4m3 data type")
        if fp8:
            if q.dtype != self.fp8:
                raise _fail(f"no fp8bf16 kernel for {q.dtype} on {self.gfx}")
            if q.shape[2] != 128 or a["v"].shape[2] != 128:
                raise _fail("aiter builds fp8bf16 varlen kernels for head dim 128 only")
            if a["min_seqlen_q"] or a["logits_soft_cap"] or a["return_softmax_lse"]:
                raise _fail("fp8 kernels have no skip, soft cap or lse variants")
        if a["dropout_p"] != 0.0 or a["return_dropout_randval"] or a["logits_soft_cap"] != 0.0:
            raise NotImplementedError("the fake serves no dropout or logits soft cap")
        if a["cu_seqlens_q_padded"] is not None or a["cu_seqlens_k_padded"] is not None:
            raise NotImplementedError("the fake serves no padded cu_seqlens")
        _window(a)
        out_dtype = torch.bfloat16 if fp8 else q.dtype
        return self._finish(a, cuq, cuk, out_dtype)

    def _asm(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        _check_types("fmha_v3_varlen_fwd", a)
        cuq, cuk = _check_varlen(a)
        q, v = a["q"], a["v"]
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise _fail("FlashAttention only support fp16 and bf16 data type")
        dims = (q.shape[2], v.shape[2])
        kernel = (
            self.gfx in ASM_ARCHS
            and q.dtype == torch.bfloat16
            and (dims == (128, 128) or (self.gfx == "gfx950" and dims == (192, 128)))
            and a["dropout_p"] == 0.0
            and a["how_v3_bf16_cvt"] in (0, 1, 2)
            and _window(a) == (-1, -1)
        )
        if not kernel:
            raise _fail("invalid argument for fmha_v3_varlen_fwd 3")
        if self.gfx == "gfx942" and self.cu_count not in ASM_GFX942_CU_COUNTS:
            raise _fail(f"no gfx942 ASM kernel objects for {self.cu_count} CUs")
        return self._finish(a, cuq, cuk, q.dtype)

    def _finish(
        self, a: dict[str, Any], cuq: list[int], cuk: list[int], out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        q = a["q"]
        out = attention(q, a["k"], a["v"], cuq, cuk, a["softmax_scale"], a["is_causal"])
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


def install(monkeypatch: pytest.MonkeyPatch, gfx: str = "gfx942", cu_count: int = 304) -> FakeAiter:
    """Put a fresh fake at ``sys.modules["aiter"]`` for one test; monkeypatch undoes it."""
    fake = FakeAiter(gfx=gfx, cu_count=cu_count)
    monkeypatch.setitem(sys.modules, "aiter", fake.module())
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
