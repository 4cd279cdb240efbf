"""``flashinfer`` and ``flashinfer-rope``: flashinfer's ragged prefill on Q/K/V views.

``BatchPrefillWithRaggedKVCacheWrapper`` is planned once per batch in ``prepare`` (host int32
offsets, no device sync) and run per layer on strided views of the packed rows: no Q/K/V copy,
no cache, only the output is allocated. Per layer a plan calls the compiled kernel with the
argument list it fixed, where that call is known and proved (`_flashinfer_direct`), else the
wrapper's ``run``.

Plans own their state. A flashinfer wrapper keeps exactly one plan, so every plan holds a wrapper
of its own, leased from a process-wide pool keyed by device, stream and kernel implementation,
and returned to it when the plan is dropped. Each wrapper has its own int workspace (the plan's
metadata); the 128 MiB float workspace (flashinfer's recommended size, split-KV partial results)
is shared per device and stream (`StreamBuffers` says why that is safe). A pooled wrapper is
reused only once the device has run the metadata copy of its last plan (a `CompletionMarker`):
flashinfer stages that copy in a pinned host buffer that the next plan overwrites.

The kernel implementation is chosen as data (`choose_kernel`): fa3 on sm90 where flashinfer
has it, fa2 elsewhere; the choice is in the selector's decision record.

``flashinfer-rope`` is the same kernel with RoPE fused into it (``pos_encoding_mode=
"ROPE_LLAMA"``, fa2 only, since fa3 ignores RoPE without an error). The contract hands it the
RoPE only for rotate-half RoPE over the whole head without logn; for other specs it runs the
separate RoPE pass and this backend plans without ROPE_LLAMA, exactly like ``flashinfer``.
Fusing pays on short sequences only (it saves a memory pass, but fa2 is slower than fa3 on
Hopper as sequences grow), so it is decided per batch: batches whose longest sequence is at
most ``fused_rope_max_seqlen`` tokens run fused, longer ones the separate pass and fa3 (the
crossover measured by benchmarks/gpu/rope_crossover.py).

Graph mode (`prepare_graph`): one wrapper per bucket, built with ``use_cuda_graph=True`` over
fixed index buffers; ``update`` re-plans it in place, so a captured ``run`` replays any batch of
the bucket. fused RoPE is decided once per bucket, from its longest sequence.

Windows, soft-capping and ALiBi are ``plan`` arguments: ``window_left`` (keys
``i - window_left .. i``: left-only windows, planned causal whatever the spec's mask, since
they see no later key; windows reaching later keys are refused),
``logits_soft_cap`` (fa2 and fa3) and ``pos_encoding_mode="ALIBI"`` (fa2 only: fa3 ignores
it, so ALiBi always plans fa2). flashinfer computes BLOOM's slopes itself and adds
``slope * (j - i)``, the causal bias: custom slopes and bidirectional ALiBi are refused, and so
is ALiBi with soft-capping (flashinfer then applies the softmax scale twice).

Alignment: flashinfer assumes 16-byte aligned rows (128-bit and TMA loads). Buffers torch
allocates always are; a misaligned buffer (an odd storage offset or row stride) is copied once
into an aligned one rather than read wrongly.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from attn_backends import AttentionSpec, FMHAParams, GraphBucket, Platform
from attn_backends.errors import BackendFailure
from attn_backends.plugin import (
    AlibiSupport,
    AnyPlan,
    Capabilities,
    KernelModule,
    PluginManifest,
    PrefillBackend,
    QKVViews,
    SoftcapSupport,
    WindowSupport,
    dtype_name,
    hookimpl,
    preprocess_mode,
)

from ._flashinfer_common import (
    PREFILL_HEAD_DIMS,
    SIXTEEN_BIT,
    CompletionMarker,
    JitModule,
    KernelChoice,
    KernelVariant,
    StreamBuffers,
    StreamKey,
    choose_kernel,
    device_sm,
    host_indptr,
    is_aligned,
    nonempty_lengths,
    stream_key,
)
from ._flashinfer_direct import RowsRun, clear_verdicts, plan_run
from ._flashinfer_jit import kernel_module
from ._flashinfer_rope import FLASHINFER_ROPE

API_VERSION = "2.0"
WORKSPACE_BYTES = 128 << 20
KERNEL = "flashinfer.BatchPrefillWithRaggedKVCacheWrapper"
FUSED_ROPE_MAX_SEQLEN = 256
"""Longest sequence of a batch that ``flashinfer-rope`` still fuses RoPE for. Measured on an
H200 (benchmarks/gpu/rope_crossover.py, 2026-11-30; equal lengths, 16k tokens, 16/8 x 128 causal
bf16): fa2 with ROPE_LLAMA took 0.53-0.94x the time of the separate pass + fa3 up to 256 tokens
and 1.07x at 384, rising to 1.91x at 2048."""


PoolKey = tuple[torch.device, int, str]
"""Device, stream handle and kernel implementation (fa2/fa3) of a pooled wrapper."""


class WrapperPool:
    """Idle flashinfer wrappers, per device, stream and implementation.

    ``lease`` hands out an idle wrapper whose last plan's metadata copy has run (or a new one);
    the plan holding it gives it back when it is dropped. The pool grows to the number of plans
    alive at once and never shrinks below that: a wrapper is 8 MiB of device memory.
    """

    def __init__(self) -> None:
        self._idle: dict[PoolKey, list[tuple[Any, CompletionMarker]]] = {}
        self._lock = threading.RLock()
        """Reentrant: a plan gives its wrapper back from a finalizer, which the garbage
        collector may run on a thread that already holds the lock (inside `lease`)."""
        self.created = 0
        """Wrappers built so far (tests read it to see reuse)."""

    def lease(self, key: PoolKey, workspace: torch.Tensor) -> Any:
        # Any: flashinfer ships no type information.
        with self._lock:
            idle = self._idle.get(key, [])
            for i, (wrapper, marker) in enumerate(idle):
                if marker.done():
                    del idle[i]
                    return wrapper
            self.created += 1
        import flashinfer  # lazily: a GPU library

        return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            workspace, kv_layout="NHD", backend=key[2]
        )

    def give_back(self, key: PoolKey, wrapper: Any, marker: CompletionMarker) -> None:
        with self._lock:
            self._idle.setdefault(key, []).append((wrapper, marker))

    def idle(self, key: PoolKey) -> int:
        with self._lock:
            return len(self._idle.get(key, []))

    def clear(self) -> None:
        """Drop every idle wrapper (8 MiB of device memory each) once its last metadata copy
        has run; wrappers leased now come back as usual."""
        with self._lock:
            dropped = [marker for idle in self._idle.values() for _, marker in idle]
            self._idle.clear()
        for marker in dropped:
            marker.wait()


WORKSPACES = StreamBuffers(WORKSPACE_BYTES)
POOL = WrapperPool()
logger = logging.getLogger("attn_backends")
_announced: set[JitModule] = set()
_announced_lock = threading.Lock()


def announce_first_use(module: JitModule) -> None:
    """One INFO line the first time this process plans with a JIT module: flashinfer compiles
    it then if its cache lacks it, which takes minutes, so a stall is never silent."""
    with _announced_lock:
        if module in _announced:
            return
        _announced.add(module)
    logger.info(
        "flashinfer: first use of JIT module %s in this process; flashinfer compiles it now "
        "unless its cache has it (minutes on a new machine). Run `attn-backends warmup "
        "--preset NAME` (or attn_backends.warmup(specs)) at start-up to do this ahead of traffic",
        module,
    )


def clear_caches() -> None:
    """Reset this plugin's process-wide state: the stream workspaces, the idle wrappers, which
    JIT modules were announced (announced again on their next first use), and the direct
    kernel call's proofs (proved again on each module's next first call)."""
    WORKSPACES.clear()
    POOL.clear()
    with _announced_lock:
        _announced.clear()
    clear_verdicts()


@dataclass(frozen=True, eq=False)
class RaggedPlan:
    """The per-batch kernel plan: a wrapper of its own, planned for this batch."""

    wrapper: Any
    """flashinfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (untyped library object)."""
    choice: KernelChoice
    pos_encoding_mode: str
    indptr: torch.Tensor
    """Host int32 offsets of the non-empty sequences, as given to ``plan``."""
    stream: StreamKey
    """The device and stream the plan was made on; its float workspace is that stream's."""
    run: RowsRun
    """How each layer runs the kernel: ``wrapper.run``, or ``ragged_run`` with the argument
    list this plan fixed (`_flashinfer_direct`)."""


class GraphRagged:
    """The graph-mode state of one bucket: a CUDA-graph wrapper over fixed index buffers."""

    def __init__(
        self, wrapper: Any, choice: KernelChoice, pos_encoding_mode: str, indptr: torch.Tensor
    ) -> None:
        self.wrapper = wrapper
        self.choice = choice
        self.pos_encoding_mode = pos_encoding_mode
        self.indptr = indptr
        """Device int32 ``[slots + 1]`` the captured kernel reads; rewritten by each plan."""
        self.planned: CompletionMarker | None = None
        """Marks the metadata copy of the last plan; the next plan waits for it."""


def _pos_encoding(spec: AttentionSpec, fused_rope: bool) -> str:
    if spec.alibi is not None:
        return "ALIBI"
    return "ROPE_LLAMA" if fused_rope else "NONE"


def jit_module(spec: AttentionSpec, choice: KernelChoice, fused_rope: bool) -> JitModule:
    """The JIT module a plan for ``spec`` loads: its key holds the position encoding and
    whether the sliding window and soft-cap variants are compiled in."""
    return JitModule(
        choice.backend,
        dtype_name(spec.dtype),
        spec.head_dim,
        fused_rope,
        alibi=spec.alibi is not None,
        sliding_window=spec.window is not None,
        logit_softcap=spec.logit_softcap is not None,
    )


class FlashinferBackend(PrefillBackend):
    name = "flashinfer"
    capabilities = Capabilities(
        platforms=frozenset({"cuda"}),
        dtypes=SIXTEEN_BIT,
        head_dims=PREFILL_HEAD_DIMS,
        min_sm=80,
        cuda_graph=True,
        features=(
            WindowSupport(right=False),
            SoftcapSupport(),
            AlibiSupport(bidirectional=False, custom_slopes=False, with_softcap=False),
        ),
        requires=("flashinfer",),
    )

    @classmethod
    def _fusion_cases(cls, spec: AttentionSpec) -> tuple[bool, ...]:
        """Whether batches run fused RoPE: (False,), (True,), or (True, False) when the choice
        is made per batch by length."""
        caps = cls.capabilities
        if preprocess_mode(spec, caps.fused_rope) != "fused":
            return (False,)
        return (True,) if caps.fused_rope_max_seqlen is None else (True, False)

    def kernel_variant(self, spec: AttentionSpec, platform: Platform) -> KernelVariant:
        """fa2 or fa3 for each fusion case of ``spec`` on ``platform``, decided at bind."""
        sm = platform.sm
        return KernelVariant(
            sm, tuple((fused, choose_kernel(spec, sm, fused)) for fused in self._fusion_cases(spec))
        )

    def _kernel_for(self, sm: int | None, fused_rope: bool) -> KernelChoice:
        """The bound decision for a device of architecture ``sm`` (every device of the bound
        platform); chosen here only for a device of another architecture."""
        variant = self.binding.variant
        if isinstance(variant, KernelVariant) and variant.sm == sm:
            bound = variant.kernel(fused_rope)
            if bound is not None:
                return bound
        return choose_kernel(self.spec, sm, fused_rope)

    def describe(self, platform: Platform) -> dict[str, str]:
        spec = self.spec
        binding = self.binding_on(platform)
        variant = binding.variant
        assert isinstance(variant, KernelVariant)  # made by kernel_variant above
        cases = variant.cases
        choices = [choice for _, choice in cases]
        details = {
            **binding.details(),
            "kernel": KERNEL,
            "flashinfer_backend": choices[0].backend,
            "flashinfer_backend_reason": choices[0].reason,
            "pos_encoding_mode": _pos_encoding(spec, cases[0][0]),
            "workspace_bytes": str(WORKSPACE_BYTES),
            "plan_state": "a pooled wrapper per plan; float workspace per device and stream",
        }
        if len(cases) == 2:
            limit = self.capabilities.fused_rope_max_seqlen
            details["flashinfer_backend"] = (
                f"{choices[0].backend} for batches of max_seqlen <= {limit}, "
                f"else {choices[1].backend}"
            )
            details["flashinfer_backend_reason"] = (
                f"fused RoPE: {choices[0].reason}; without: {choices[1].reason}"
            )
            details["pos_encoding_mode"] = f"ROPE_LLAMA for max_seqlen <= {limit}, else NONE"
        return details

    @classmethod
    def jit_modules(cls, spec: AttentionSpec, sm: int) -> tuple[JitModule, ...]:
        """The flashinfer JIT modules this backend loads for ``spec`` on an ``sm`` device."""
        return tuple(
            jit_module(spec, choose_kernel(spec, sm, fused), fused)
            for fused in cls._fusion_cases(spec)
        )

    @classmethod
    def kernel_modules(cls, spec: AttentionSpec, device: torch.device) -> tuple[KernelModule, ...]:
        sm = device_sm(device)
        if sm is None:
            return ()
        return tuple(kernel_module(m) for m in cls.jit_modules(spec, sm))

    def accepts_rows(self, rows: torch.Tensor) -> bool:
        return is_aligned(rows)

    def _plan_wrapper(
        self,
        wrapper: Any,
        spec: AttentionSpec,
        indptr: torch.Tensor,
        fused_rope: bool,
        *,
        graph: bool = False,
    ) -> str:
        """Plan one batch on ``wrapper``. In graph mode split-KV is off: fa2 sizes its split
        buffers for the bucket's worst case (804 MB for 16k rows of 16/8 x 128 on an H200,
        past the 128 MiB workspace), and a plan must fit whatever batch the bucket holds."""
        mode = _pos_encoding(spec, fused_rope)
        rope_theta = spec.rope.theta if fused_rope and spec.rope is not None else None
        wrapper.plan(
            qo_indptr=indptr,
            kv_indptr=indptr,
            num_qo_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim_qk=spec.head_dim,
            head_dim_vo=spec.head_dim,
            # A window (left-only: right > 0 is refused) sees no later key, so it plans causal.
            causal=spec.causal or spec.window is not None,
            pos_encoding_mode=mode,
            sm_scale=spec.scale,
            rope_scale=1.0 if fused_rope else None,
            rope_theta=rope_theta,
            q_data_type=spec.dtype,
            kv_data_type=spec.dtype,
            o_data_type=spec.output_dtype,
            disable_split_kv=graph,
            window_left=spec.window.left if spec.window is not None else -1,
            logits_soft_cap=spec.logit_softcap,
        )
        return mode

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> RaggedPlan:
        sm = device_sm(params.device)
        choice = self._kernel_for(sm, fused_rope)
        module = jit_module(spec, choice, fused_rope)
        announce_first_use(module)
        stream = stream_key(params.device)
        key: PoolKey = (stream[0], stream[1], choice.backend)
        wrapper = POOL.lease(key, WORKSPACES.get(stream))
        indptr = host_indptr(nonempty_lengths(params.input_lengths))
        try:
            mode = self._plan_wrapper(wrapper, spec, indptr, fused_rope)
        except BaseException:
            POOL.give_back(key, wrapper, CompletionMarker(params.device))
            raise
        # sm90 and later: flashinfer's run launches with PDL there (device_support_pdl)
        run = plan_run(
            wrapper, module, spec.num_heads, spec.head_dim, pdl=sm is not None and sm >= 90
        )
        plan = RaggedPlan(wrapper, choice, mode, indptr, stream, run)
        weakref.finalize(plan, POOL.give_back, key, wrapper, CompletionMarker(params.device))
        return plan

    def plan_graph_kernel(
        self, spec: AttentionSpec, bucket: GraphBucket, device: torch.device, *, fused_rope: bool
    ) -> GraphRagged:
        import flashinfer  # lazily: a GPU library

        choice = self._kernel_for(device_sm(device), fused_rope)
        announce_first_use(jit_module(spec, choice, fused_rope))
        indptr = torch.zeros(bucket.slots + 1, dtype=torch.int32, device=device)
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            WORKSPACES.get(stream_key(device)),
            kv_layout="NHD",
            use_cuda_graph=True,
            qo_indptr_buf=indptr,
            kv_indptr_buf=indptr,
            backend=choice.backend,
        )
        return GraphRagged(wrapper, choice, _pos_encoding(spec, fused_rope), indptr)

    def replan_graph_kernel(
        self, spec: AttentionSpec, kernel: object, slots: tuple[int, ...]
    ) -> None:
        if not isinstance(kernel, GraphRagged):
            raise BackendFailure(f"{self.name} got a graph plan it did not make: {kernel!r}")
        if kernel.planned is not None:
            kernel.planned.wait()
        fused = kernel.pos_encoding_mode == "ROPE_LLAMA"
        self._plan_wrapper(kernel.wrapper, spec, host_indptr(slots), fused, graph=True)
        kernel.planned = CompletionMarker(kernel.indptr.device)

    def attend(self, views: QKVViews, plan: AnyPlan) -> torch.Tensor:
        kernel = plan.kernel
        if type(kernel) is RaggedPlan:
            return kernel.run(views.q, views.k, views.v)
        if type(kernel) is not GraphRagged:
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        out: torch.Tensor = kernel.wrapper.run(views.q, views.k, views.v)
        return out


class FlashinferRopeBackend(FlashinferBackend):
    name = "flashinfer-rope"
    capabilities = replace(
        FlashinferBackend.capabilities,
        fused_rope=True,
        fused_rope_max_seqlen=FUSED_ROPE_MAX_SEQLEN,
    )


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(
        api_version=API_VERSION,
        backends=[FlashinferBackend, FlashinferRopeBackend],
        rope_passes=[FLASHINFER_ROPE],  # flashinfer's in-place RoPE joins the separate passes
    )
