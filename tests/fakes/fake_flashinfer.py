"""A fake ``flashinfer`` for CPU tests: real signatures, real argument checks, torch math.

It stands in for flashinfer-python 0.7.0.post1 and offers what the ``flashinfer``,
``flashinfer-rope`` and ``trt`` backends call: ``BatchPrefillWithRaggedKVCacheWrapper``
(constructor, ``plan``, ``run``) and ``flashinfer.prefill.trtllm_fmha_v2_prefill``. Every call
is bound to a stub with the real parameter list (``_sig_*``; ``test_fake_signatures_match_real``
compares them with an installed flashinfer), so a wrong keyword raises ``TypeError`` as it
would on the real library, then checked the way flashinfer checks it, or the way its kernels
would silently misbehave:

* ``plan``'s ``q_data_type`` defaults to float16; ``run`` refuses another dtype
  (``utils._check_cached_qkv_data_type``); ``q.size(0)`` must equal ``qo_indptr[-1]``;
* loads need unit last-dim stride and 16-byte aligned base and strides (128-bit cp.async in
  fa2, TMA in fa3 and FMHA v2): the fake raises where the kernel would read wrong bytes; the
  output of ``run`` must be dense (fa2 writes it with strides from the shape);
* fa3 ignores ``pos_encoding_mode="ROPE_LLAMA"`` and ``"ALIBI"`` without an error, as the real
  one does; windows, soft-cap and ALiBi follow flashinfer's default variant;
* FMHA v2 ``PACKED_QKV`` derives every stride from the shapes: ``qkv`` must be contiguous;
  ``cum_seq_lens`` are read as int32; any mask string but ``"padding"`` is causal.

Output rows no request covers stay NaN, as uninitialised memory would be garbage. Every call is
recorded with its arguments by parameter name.
"""

from __future__ import annotations

import enum
import inspect
import itertools
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

FLASHINFER_VERSION = "0.7.0.post1"
ALIGN = 16
SERVED_BACKENDS = ("auto", "fa2", "fa3")
POS_ENCODINGS = ("NONE", "ROPE_LLAMA", "ALIBI")


# Signatures of flashinfer 0.7.0.post1 (prefill.py:3601, 3808, 4472, 6615). Only names, order
# and defaults matter; bodies are never run.


def _sig_wrapper_init(
    self: Any,
    float_workspace_buffer: torch.Tensor,
    kv_layout: str = "NHD",
    use_cuda_graph: bool = False,
    qo_indptr_buf: torch.Tensor | None = None,
    kv_indptr_buf: torch.Tensor | None = None,
    custom_mask_buf: torch.Tensor | None = None,
    mask_indptr_buf: torch.Tensor | None = None,
    backend: str = "auto",
    jit_args: list[Any] | None = None,
    jit_kwargs: dict[str, Any] | None = None,
    variant_owns_mask: bool = False,
) -> None: ...


def _sig_plan(
    self: Any,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_vo: int | None = None,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    causal: bool = False,
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    q_data_type: str | torch.dtype = "float16",
    kv_data_type: str | torch.dtype | None = None,
    o_data_type: str | torch.dtype | None = None,
    non_blocking: bool = True,
    prefix_len_ptr: torch.Tensor | None = None,
    token_pos_in_items_ptr: torch.Tensor | None = None,
    token_pos_in_items_len: int = 0,
    max_item_len_ptr: torch.Tensor | None = None,
    fixed_split_size: int | None = None,
    disable_split_kv: bool = False,
    seq_lens: torch.Tensor | None = None,
    seq_lens_q: torch.Tensor | None = None,
    max_token_per_sequence: int | None = None,
    max_sequence_kv: int | None = None,
    v_indptr: torch.Tensor | None = None,
    o_indptr: torch.Tensor | None = None,
) -> None: ...


def _sig_run(
    self: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *args: Any,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    o_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    enable_pdl: bool | None = None,
    kv_cache_sf: Any = None,
) -> Any: ...


def _sig_trtllm_fmha_v2_prefill(
    qkv: Any,
    input_layout: str,
    workspace_buffer: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    bmm1_scale: float,
    bmm2_scale: float,
    batch_size: int,
    cum_seq_lens_q: torch.Tensor,
    cum_seq_lens_kv: torch.Tensor,
    block_tables: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | str | None = None,
    sinks: list[torch.Tensor] | None = None,
    pos_encoding_mode: str | None = None,
    logits_soft_cap_scale: float | None = None,
    mask_mode: str = "causal",
    window_left: int = -1,
    chunked_attention_size: int = 0,
    save_softmax_stats: bool = False,
    skip_softmax_threshold_scale_factor: float = 0,
) -> Any: ...


SIGNATURES: dict[str, Callable[..., Any]] = {
    "BatchPrefillWithRaggedKVCacheWrapper.__init__": _sig_wrapper_init,
    "BatchPrefillWithRaggedKVCacheWrapper.plan": _sig_plan,
    "BatchPrefillWithRaggedKVCacheWrapper.run": _sig_run,
    "prefill.trtllm_fmha_v2_prefill": _sig_trtllm_fmha_v2_prefill,
}
"""Qualified real name -> stub with the real parameter list."""


# flashinfer 0.7.4, the newest release in the supported range, appends parameters to ``plan``
# and ``run`` (all with defaults). The fake binds calls to the 0.7.0.post1 lists, the oldest in
# the range, so a keyword only newer releases take fails here; these lists let the signature
# check compare whichever release is installed.


def _appended(stub: Callable[..., Any], after: str, *names: tuple[str, Any]) -> Callable[..., Any]:
    """A stub whose parameter list is ``stub``'s with parameters ``(name, default)`` inserted
    after ``after``, of the same kind as it."""
    params = list(inspect.signature(stub).parameters.values())
    at = [p.name for p in params].index(after) + 1
    extra = [inspect.Parameter(n, params[at - 1].kind, default=d) for n, d in names]

    def newer(*args: Any, **kwargs: Any) -> Any: ...

    newer.__signature__ = inspect.Signature(params[:at] + extra + params[at:])  # type: ignore[attr-defined]
    return newer


_sig_plan_074 = _appended(
    _sig_plan,
    "o_indptr",
    ("qo_indptr_cpu", None),
    ("kv_indptr_cpu", None),
    ("uniform_q_len", None),
    ("use_token_head_sf", False),
)
_sig_run_074 = _appended(_sig_run, "return_lse", ("lse_base", "log2"), ("lse_layout", "NH"))


SIGNATURES_BY_VERSION: dict[str, dict[str, Callable[..., Any]]] = {
    FLASHINFER_VERSION: SIGNATURES,
    "0.7.4": {
        **SIGNATURES,
        "BatchPrefillWithRaggedKVCacheWrapper.plan": _sig_plan_074,
        "BatchPrefillWithRaggedKVCacheWrapper.run": _sig_run_074,
    },
}
"""Each supported release's parameter lists, for comparing the fake with the installed one."""


def _bind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bind a call to the real signature (TypeError on a wrong name), defaults filled in."""
    bound = inspect.signature(SIGNATURES[name]).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    return arguments


@dataclass(frozen=True)
class Call:
    """One recorded call: the real qualified name and its arguments by parameter name."""

    name: str
    args: dict[str, Any]


def _dtype(value: str | torch.dtype) -> torch.dtype:
    """flashinfer's ``canonicalize_torch_dtype``."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, value)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _check_loads(kernel: str, *tensors: torch.Tensor) -> None:
    """Unit last-dim stride, 16-byte aligned base and strides: what 128-bit and TMA loads need."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise RuntimeError(f"{kernel}: last dimension must be contiguous")
        size = t.element_size()
        strides = [s * size for s, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1]
        if t.data_ptr() % ALIGN or any(s % ALIGN for s in strides):
            raise RuntimeError(
                f"{kernel}: base or strides not {ALIGN}-byte aligned; the kernel's vector/TMA "
                "loads would read the wrong bytes"
            )


def rope_llama(x: torch.Tensor, theta: float, scale: float) -> torch.Tensor:
    """flashinfer's ROPE_LLAMA on one request ``[L, H, D]`` (float32): rotate-half over the
    whole head, frequency ``theta ** (-2i / D) / scale``, positions from 0."""
    d = x.shape[-1]
    half = d // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d) / scale
    angle = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * freq[None, :]
    cos = angle.cos().to(torch.float32)[:, None, :]
    sin = angle.sin().to(torch.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: list[int],
    scale: float,
    causal: bool,
    out: torch.Tensor,
    rope: tuple[float, float] | None = None,
    window_left: int = -1,
    soft_cap: float = 0.0,
    alibi: bool = False,
) -> None:
    """Float32 ragged self-attention written into ``out`` (rows no request covers untouched).

    Window, soft-cap and ALiBi as flashinfer's default variant computes them: keys
    ``>= i - window_left``; ALiBi adds ``slope * (j - i)`` to the scaled scores; the soft-cap
    then takes ``cap * tanh(x * scale / cap)`` of whatever it gets (scaling ALiBi's sum
    again)."""
    hq, hk = q.shape[1], k.shape[1]
    for start, end in itertools.pairwise(cu):
        if end == start:
            continue
        qs = q[start:end].to(torch.float32)
        ks = k[start:end].to(torch.float32)
        if rope is not None:
            qs, ks = rope_llama(qs, *rope), rope_llama(ks, *rope)
        ks = ks.repeat_interleave(hq // hk, dim=1)
        vs = v[start:end].to(torch.float32).repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks)
        n = end - start
        pos = torch.arange(n)
        distance = (pos[None, :] - pos[:, None]).to(torch.float32)
        if alibi:
            scores = scores * scale + flashinfer_alibi_slopes(hq)[:, None, None] * distance
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores * (scale / soft_cap))
        elif not alibi:
            scores = scores * scale
        if causal:
            scores = scores.masked_fill(distance > 0, float("-inf"))
        if window_left >= 0:
            scores = scores.masked_fill(distance < -window_left, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vs).to(
            out.dtype
        )


def flashinfer_alibi_slopes(heads: int) -> torch.Tensor:
    """flashinfer's own ALiBi slopes (utils.get_alibi_slopes), float32."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * (heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def _host(t: torch.Tensor, name: str) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor")
    return [int(x) for x in t.tolist()]


class _FakeRaggedWrapper:
    """``BatchPrefillWithRaggedKVCacheWrapper`` over CPU tensors (NHD, fa2/fa3 only)."""

    _fake: FakeFlashinfer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        a = _bind("BatchPrefillWithRaggedKVCacheWrapper.__init__", (self, *args), kwargs)
        self._fake.calls.append(Call("BatchPrefillWithRaggedKVCacheWrapper.__init__", a))
        workspace = a["float_workspace_buffer"]
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
            raise TypeError("float_workspace_buffer must be a uint8 tensor")
        if a["kv_layout"] != "NHD" or a["backend"] not in SERVED_BACKENDS:
            raise NotImplementedError("the fake serves kv_layout NHD with backend auto/fa2/fa3")
        if a["jit_args"] is not None or a["custom_mask_buf"] is not None:
            raise NotImplementedError("the fake serves no JIT variants or masks")
        self._graph_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._max_rows: int | None = None
        if a["use_cuda_graph"]:
            qo_buf, kv_buf = a["qo_indptr_buf"], a["kv_indptr_buf"]
            if not isinstance(qo_buf, torch.Tensor) or not isinstance(kv_buf, torch.Tensor):
                raise ValueError("qo_indptr_buf should be a torch.Tensor in cuda graph mode")
            if len(qo_buf) != len(kv_buf):
                raise ValueError("The length of kv_indptr_buf should be the same as qo_indptr_buf")
            self._graph_bufs = (qo_buf, kv_buf)
        self._backend: str = a["backend"]
        self._plan: dict[str, Any] | None = None
        self._float_workspace_buffer = workspace
        self.device = workspace.device

    def plan(self, *args: Any, **kwargs: Any) -> None:
        a = _bind("BatchPrefillWithRaggedKVCacheWrapper.plan", (self, *args), kwargs)
        self._fake.calls.append(Call("BatchPrefillWithRaggedKVCacheWrapper.plan", a))
        qo = _host(a["qo_indptr"], "qo_indptr")
        kv = _host(a["kv_indptr"], "kv_indptr")
        if a["qo_indptr"].dtype != a["kv_indptr"].dtype:
            raise ValueError("qo_indptr and kv_indptr must share a dtype (the module's IdType)")
        if qo != kv:
            raise NotImplementedError("the fake serves self-attention (qo_indptr == kv_indptr)")
        if a["pos_encoding_mode"] not in POS_ENCODINGS:
            raise KeyError(a["pos_encoding_mode"])
        if a["custom_mask"] is not None:
            raise NotImplementedError("the fake serves no custom mask")
        if a["num_qo_heads"] % a["num_kv_heads"]:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if self._graph_bufs is not None:
            # CUDA-graph mode, as flashinfer checks it: a fixed batch size, no more rows than
            # the first plan had, and the offsets copied into the fixed buffers in place.
            qo_buf, kv_buf = self._graph_bufs
            if len(qo) != len(qo_buf):
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                    f"{len(qo) - 1} mismatches the batch size set during initialization "
                    f"{len(qo_buf) - 1}."
                )
            if self._max_rows is None:
                self._max_rows = qo[-1]
            elif qo[-1] > self._max_rows:
                raise ValueError("The total number of rows in qo_indptr exceeds the first plan's")
            qo_buf.copy_(a["qo_indptr"])
            kv_buf.copy_(a["kv_indptr"])
        if self._backend == "auto":
            self._backend = "fa2"  # the fake knows no device; auto is sticky, as in flashinfer
        q_dtype = _dtype(a["q_data_type"])
        kv_dtype = _dtype(a["kv_data_type"]) if a["kv_data_type"] is not None else q_dtype
        o_dtype = _dtype(a["o_data_type"]) if a["o_data_type"] is not None else q_dtype
        self._plan = {**a, "cu": qo, "q_dtype": q_dtype, "kv_dtype": kv_dtype, "o_dtype": o_dtype}
        if self._graph_bufs is not None:
            # A captured run reads the offsets from the fixed buffer, whatever the host list says.
            self._plan["graph_indptr"] = self._graph_bufs[0]
        if self._fake.internals:
            self._keep_internals()

    def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        a = _bind("BatchPrefillWithRaggedKVCacheWrapper.run", (self, *args), kwargs)
        self._fake.calls.append(Call("BatchPrefillWithRaggedKVCacheWrapper.run", a))
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() before plan()")
        q, k, v = a["q"], a["k"], a["v"]
        if a["args"] or a["return_lse"] or a["lse"] is not None or a["kv_cache_sf"] is not None:
            raise NotImplementedError("the fake serves plain 16-bit runs without LSE")
        if q.dtype != plan["q_dtype"] or k.dtype != plan["kv_dtype"]:
            raise ValueError(
                f"The dtype of q {q.dtype} does not match the q_data_type {plan['q_dtype']} "
                "specified in plan function."
            )
        if q.size(0) != plan["cu"][-1]:
            raise ValueError(f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1]")
        if (q.size(1), k.size(1), v.size(1)) != (
            plan["num_qo_heads"],
            plan["num_kv_heads"],
            plan["num_kv_heads"],
        ):
            raise ValueError("head counts differ from the plan")
        head_dim_vo = plan["head_dim_vo"] or plan["head_dim_qk"]
        if q.size(2) != plan["head_dim_qk"] or v.size(2) != head_dim_vo:
            raise ValueError("head dims differ from the plan")
        _check_loads(self._backend, q, k, v)
        shape = (*q.shape[:-1], head_dim_vo)
        out: torch.Tensor | None = a["out"]
        if out is None:
            out = torch.empty(shape, dtype=plan["o_dtype"], device=q.device)
        elif tuple(out.shape) != shape or out.dtype != plan["o_dtype"] or out.device != q.device:
            raise ValueError(f"Invalid out: expected {shape} {plan['o_dtype']} on {q.device}")
        elif not out.is_contiguous():
            raise RuntimeError("out must be dense: the kernel writes it with strides from shape")
        sm_scale = plan["sm_scale"]
        if sm_scale is None:
            sm_scale = 1.0 / math.sqrt(q.size(-1))
        soft_cap = plan["logits_soft_cap"] or 0.0
        self._attend(q, k, v, out, plan["causal"], plan["window_left"], soft_cap, sm_scale)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        causal: bool,
        window_left: int,
        soft_cap: float,
        sm_scale: float,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> None:
        """The kernel on the planned batch, what ``run`` and ``ragged_run`` both end in."""
        plan = self._plan
        assert plan is not None
        out.fill_(float("nan"))
        rope = None
        if plan["pos_encoding_mode"] == "ROPE_LLAMA" and self._backend == "fa2":  # fa3: ignored
            scale = rope_scale if rope_scale is not None else plan["rope_scale"]
            theta = rope_theta if rope_theta is not None else plan["rope_theta"]
            rope = (theta if theta is not None else 1e4, scale if scale is not None else 1.0)
        cu = plan["cu"]
        if "graph_indptr" in plan:
            cu = [int(x) for x in plan["graph_indptr"].tolist()]
        attention(
            q,
            k,
            v,
            cu,
            sm_scale,
            causal,
            out,
            rope,
            window_left=window_left,
            soft_cap=soft_cap,
            alibi=plan["pos_encoding_mode"] == "ALIBI" and self._backend == "fa2",  # fa3: ignored
        )

    def _keep_internals(self) -> None:
        """The state flashinfer 0.7.x keeps on a planned wrapper, which its ``run`` reads to
        build ``ragged_run``'s argument list (prefill.py, ``run``)."""
        plan = self._plan
        assert plan is not None
        self._jit_module = None
        self._custom_mask_buf = None
        self._mask_indptr_buf = None
        self._variant_owns_mask = False
        self._causal = plan["causal"]
        self._window_left = plan["window_left"]
        self._logits_soft_cap = plan["logits_soft_cap"]
        self._sm_scale = plan["sm_scale"]
        self._rope_scale = plan["rope_scale"]
        self._rope_theta = plan["rope_theta"]
        self._cached_o_data_type = plan["o_dtype"]
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)
        self._plan_info = ("plan info", len(plan["cu"]))
        self._qo_indptr_buf = torch.tensor(plan["cu"], dtype=torch.int32)
        self._kv_indptr_buf = torch.tensor(plan["cu"], dtype=torch.int32)
        self._kv_layout = "NHD"
        self._prefix_len_ptr = None
        self._token_pos_in_items_ptr = None
        self._max_item_len_ptr = None
        self._token_pos_in_items_len = 0
        self._cached_module = types.SimpleNamespace(ragged_run=self._ragged_run)

    def _ragged_run(self, *args: Any) -> None:
        """The compiled module's ``ragged_run``: reads its 27 positional arguments where
        flashinfer 0.7.x's ``run`` puts them, checks each position's kind and computes the
        same kernel as ``run`` from them; ``ragged_order="swapped"`` reads the softmax scale
        and the soft cap from each other's places (a release whose list differs)."""
        self._fake.calls.append(Call("ragged_run", {"args": args}))
        if len(args) != RAGGED_RUN_ARITY:
            raise TypeError(f"ragged_run takes {RAGGED_RUN_ARITY} arguments, got {len(args)}")
        float_ws, int_ws, info, q, k, v, qo, kv, out, lse, mask, layout = args[:12]
        window_left, pdl, custom, mask_indptr, alibi, *items = args[12:20]
        soft_cap, sm_scale, rope_scale, rope_theta, items_len, k_sf, v_sf = args[20:]
        if self._fake.ragged_order == "swapped":
            soft_cap, sm_scale = sm_scale, soft_cap
        if float_ws is not self._float_workspace_buffer or int_ws is not self._int_workspace_buffer:
            raise RuntimeError("ragged_run: the workspaces are not this wrapper's")
        if (
            info is not self._plan_info
            or qo is not self._qo_indptr_buf
            or kv is not self._kv_indptr_buf
        ):
            raise RuntimeError("ragged_run: the plan info or offsets are not this plan's")
        if lse is not None or custom is not None or mask_indptr is not None or any(items):
            raise NotImplementedError("the fake serves no LSE, custom mask or item scoring")
        if k_sf is not None or v_sf is not None or items_len != 0:
            raise NotImplementedError("the fake serves no NVFP4 factors or item scoring")
        if mask not in (0, 1) or layout != 0 or type(pdl) is not bool:
            raise ValueError("ragged_run: mask mode, layout or PDL flag of the wrong kind")
        if not isinstance(alibi, torch.Tensor) or alibi.shape != (q.shape[1],):
            raise ValueError("ragged_run: the ALiBi slopes buffer has one slope per query head")
        if type(window_left) is not int or type(sm_scale) is not float:
            raise TypeError("ragged_run: window_left is an int and sm_scale a float")
        _check_loads(self._backend, q, k, v)
        if not isinstance(out, torch.Tensor) or not out.is_contiguous():
            raise RuntimeError("out must be dense: the kernel writes it with strides from shape")
        self._attend(
            q, k, v, out, mask == 1, window_left, soft_cap, sm_scale, rope_scale, rope_theta
        )


class MaskMode(enum.Enum):
    """``utils.MaskMode``, the values ``ragged_run`` reads."""

    NON_CAUSAL = 0
    CAUSAL = 1


class TensorLayout(enum.Enum):
    """``utils.TensorLayout``."""

    NHD = 0
    HND = 1


RAGGED_RUN_ARITY = 27
"""``ragged_run``'s positional arguments in flashinfer 0.7.x without a JIT variant."""


def _alibi_slopes_buffer(heads: int, device: torch.device) -> torch.Tensor:
    """``utils._get_cache_alibi_slopes_buf``: flashinfer's slopes, one per query head."""
    return flashinfer_alibi_slopes(heads).to(device)


def _trtllm_fmha_v2_prefill(fake: FakeFlashinfer, *args: Any, **kwargs: Any) -> torch.Tensor:
    a = _bind("prefill.trtllm_fmha_v2_prefill", args, kwargs)
    fake.calls.append(Call("prefill.trtllm_fmha_v2_prefill", a))
    if a["input_layout"] != "PACKED_QKV":
        raise NotImplementedError("the fake serves the PACKED_QKV layout")
    qkv = a["qkv"]
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError("PACKED_QKV expects shape [tokens, 3, num_heads, head_dim]")
    if not qkv.is_contiguous():
        raise RuntimeError("PACKED_QKV strides come from the shapes: a strided qkv is read wrongly")
    _check_loads("fmha_v2", qkv)
    for name in ("block_tables", "sinks", "pos_encoding_mode", "logits_soft_cap_scale"):
        if a[name] is not None:
            raise NotImplementedError(f"the fake serves no {name}")
    if a["window_left"] != -1 or a["chunked_attention_size"] or a["save_softmax_stats"]:
        raise NotImplementedError("the fake serves no window, chunking or softmax stats")
    if a["skip_softmax_threshold_scale_factor"] or a["mask_mode"].lower() == "custom":
        raise NotImplementedError("the fake serves no skip-softmax or custom mask")
    batch = a["batch_size"]
    cu_q, cu_kv, seq_lens = a["cum_seq_lens_q"], a["cum_seq_lens_kv"], a["seq_lens"]
    for name, t, n in (
        ("cum_seq_lens_q", cu_q, batch + 1),
        ("cum_seq_lens_kv", cu_kv, batch + 1),
        ("seq_lens", seq_lens, batch),
    ):
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() != n or t.device != qkv.device:
            raise RuntimeError(f"{name} must be int32 [{n}] on the qkv device (read as int*)")
    cu = [int(x) for x in cu_q.tolist()]
    if cu != [int(x) for x in cu_kv.tolist()] or cu[-1] > qkv.shape[0]:
        raise RuntimeError("PACKED_QKV needs equal q/kv offsets within the tokens")
    longest = max(b - a_ for a_, b in itertools.pairwise(cu))
    if a["max_q_len"] != a["max_kv_len"] or a["max_q_len"] < longest:
        raise RuntimeError("max_q_len must equal max_kv_len and cover the longest sequence")
    causal = a["mask_mode"].lower() != "padding"  # string_to_mask_type defaults to causal
    out: torch.Tensor | None = a["out"]
    shape = (qkv.shape[0], qkv.shape[2], qkv.shape[3])
    if out is None:
        dtype = _dtype(a["out_dtype"]) if a["out_dtype"] is not None else qkv.dtype
        out = torch.empty(shape, dtype=dtype, device=qkv.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise RuntimeError(f"out must be a dense {shape} tensor")
    out.fill_(float("nan"))
    q, k, v = qkv.unbind(1)
    attention(q, k, v, cu, a["bmm1_scale"], causal, out)
    out.mul_(a["bmm2_scale"])
    return out


@dataclass
class FakeFlashinfer:
    """One installed fake library: its modules and every call made to it, in order."""

    calls: list[Call] = field(default_factory=list)
    internals: bool = False
    """Whether a planned wrapper keeps the private state flashinfer's ``run`` reads and offers
    the compiled module's ``ragged_run`` (`_FakeRaggedWrapper._keep_internals`)."""
    ragged_order: str = "read"
    """``read``: ``ragged_run`` reads its arguments where 0.7.x puts them; ``swapped``: as a
    release whose list differs would."""

    def named(self, name: str) -> list[Call]:
        """The recorded calls of one function (``BatchPrefillWithRaggedKVCacheWrapper.plan``)."""
        return [c for c in self.calls if c.name == name]

    def modules(self) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
        wrapper = type(
            "BatchPrefillWithRaggedKVCacheWrapper", (_FakeRaggedWrapper,), {"_fake": self}
        )
        prefill = types.ModuleType("flashinfer.prefill")
        prefill.BatchPrefillWithRaggedKVCacheWrapper = wrapper  # type: ignore[attr-defined]

        def trtllm_fmha_v2_prefill(*args: Any, **kwargs: Any) -> torch.Tensor:
            return _trtllm_fmha_v2_prefill(self, *args, **kwargs)

        prefill.trtllm_fmha_v2_prefill = trtllm_fmha_v2_prefill  # type: ignore[attr-defined]
        root = types.ModuleType("flashinfer")
        root.__version__ = FLASHINFER_VERSION  # type: ignore[attr-defined]
        root.BatchPrefillWithRaggedKVCacheWrapper = wrapper  # type: ignore[attr-defined]
        root.prefill = prefill  # type: ignore[attr-defined]
        utils = types.ModuleType("flashinfer.utils")
        utils.MaskMode = MaskMode  # type: ignore[attr-defined]
        utils.TensorLayout = TensorLayout  # type: ignore[attr-defined]
        utils._get_cache_alibi_slopes_buf = _alibi_slopes_buffer  # type: ignore[attr-defined]
        root.utils = utils  # type: ignore[attr-defined]
        return root, prefill, utils


def install(monkeypatch: pytest.MonkeyPatch, *, internals: bool = False) -> FakeFlashinfer:
    """Put a fresh fake at ``sys.modules["flashinfer"]`` for one test; monkeypatch undoes it.

    The plugin's wrapper pool is swapped for an empty one too: wrappers leased under another
    test's fake must not serve this one; so are the direct call's proofs, made against
    another fake. ``internals``: see `FakeFlashinfer.internals`."""
    from attn_backends_builtin import _flashinfer_direct
    from attn_backends_builtin import flashinfer as plugin

    monkeypatch.setattr(plugin, "POOL", plugin.WrapperPool())
    monkeypatch.setattr(_flashinfer_direct, "_verdicts", {})
    monkeypatch.setattr(_flashinfer_direct, "_said", set())
    fake = FakeFlashinfer(internals=internals)
    root, prefill, utils = fake.modules()
    monkeypatch.setitem(sys.modules, "flashinfer", root)
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", prefill)
    monkeypatch.setitem(sys.modules, "flashinfer.utils", utils)
    return fake
