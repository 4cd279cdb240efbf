"""``flashinfer`` and ``flashinfer-rope``: flashinfer's ragged prefill on Q/K/V views.

``BatchPrefillWithRaggedKVCacheWrapper`` is planned once per batch in ``prepare`` (host int32
offsets, no device sync) and run per layer on strided views of the packed rows: no Q/K/V copy,
no cache, only the output is allocated. The wrapper and its 128 MiB workspace (flashinfer's
recommended size) live on the bound backend, one per device, and are reused by every batch.

The kernel implementation is chosen as data (`choose_kernel`): fa3 on sm90 where flashinfer
has it, fa2 elsewhere; the choice is in the selector's decision record.

``flashinfer-rope`` is the same kernel with RoPE fused into it (``pos_encoding_mode=
"ROPE_LLAMA"``, fa2 only, since fa3 ignores RoPE without an error). The contract hands it the
RoPE only for rotate-half RoPE over the whole head without logn; for other specs it runs the
separate RoPE pass and this backend plans without ROPE_LLAMA, exactly like ``flashinfer``.
Fusing pays on short sequences only (it saves a memory pass, but fa2 is slower than fa3 on
Hopper as sequences grow), so it is decided per batch: batches whose longest sequence is at
most ``fused_rope_max_seqlen`` tokens run fused, longer ones the separate pass and fa3 (the
crossover measured by scripts/gpu/rope_crossover.py). One wrapper per implementation and
device; they share the device's workspace, so a plan is valid until the next ``prepare`` on
that device.

Alignment: flashinfer assumes 16-byte aligned rows (128-bit and TMA loads). Buffers torch
allocates always are; a misaligned buffer (an odd storage offset or row stride) is copied once
into an aligned one rather than read wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from attn_backends import (
    AttentionSpec,
    BackendFailure,
    Capabilities,
    FMHAParams,
    ParamsError,
    Platform,
    PluginManifest,
    PrefillBackend,
    PrefillPlan,
    PriorityRule,
    QKVViews,
    hookimpl,
)
from attn_backends._contract import preprocess_mode
from attn_backends._dtypes import dtype_name

from ._flashinfer_common import (
    PREFILL_HEAD_DIMS,
    SIXTEEN_BIT,
    DeviceBuffers,
    JitModule,
    KernelChoice,
    choose_kernel,
    device_sm,
    host_indptr,
    nonempty_lengths,
    realigned,
)

API_VERSION = "1.0"
WORKSPACE_BYTES = 128 << 20
KERNEL = "flashinfer.BatchPrefillWithRaggedKVCacheWrapper"
FUSED_ROPE_MAX_SEQLEN = 256
"""Longest sequence of a batch that ``flashinfer-rope`` still fuses RoPE for. Measured on an
H200 (scripts/gpu/rope_crossover.py, 2026-11-30; equal lengths, 16k tokens, 16/8 x 128 causal
bf16): fa2 with ROPE_LLAMA took 0.53-0.94x the time of the separate pass + fa3 up to 256 tokens
and 1.07x at 384, rising to 1.91x at 2048."""


class _WrapperSlot:
    """A flashinfer wrapper for one kernel implementation on one device."""

    def __init__(self, wrapper: Any, choice: KernelChoice) -> None:
        # Any: flashinfer ships no type information.
        self.wrapper = wrapper
        self.choice = choice


class _DeviceSerial:
    """Counts plans per device. A wrapper keeps only its latest plan, and the wrappers of one
    device share its workspace, so `attend` refuses any plan a later ``prepare`` on the same
    device replaced."""

    def __init__(self) -> None:
        self.value = 0


@dataclass(frozen=True, eq=False)
class RaggedPlan:
    """The per-batch kernel plan: which wrapper, which of its plans, and what was planned."""

    slot: _WrapperSlot
    counter: _DeviceSerial
    serial: int
    choice: KernelChoice
    pos_encoding_mode: str
    indptr: torch.Tensor
    """Host int32 offsets of the non-empty sequences, as given to ``plan``."""


def _pos_encoding(fused_rope: bool) -> str:
    return "ROPE_LLAMA" if fused_rope else "NONE"


class FlashinferBackend(PrefillBackend):
    name = "flashinfer"
    capabilities = Capabilities(
        platforms=frozenset({"cuda"}),
        dtypes=SIXTEEN_BIT,
        head_dims=PREFILL_HEAD_DIMS,
        min_sm=80,
        requires=("flashinfer",),
        priority=(
            PriorityRule(
                "cuda",
                100,
                min_sm=80,
                note="fastest measured wherever RoPE is not fused: BERT-base 0.081 ms, BGE-M3 "
                "0.110 ms, attention of Qwen3-Embedding 0.465 ms (H200, docs/bench, 2026-11-30)",
            ),
        ),
    )

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        super().__init__(spec)
        self._workspaces = DeviceBuffers(WORKSPACE_BYTES)
        self._slots: dict[tuple[torch.device, str], _WrapperSlot] = {}
        self._serials: dict[torch.device, _DeviceSerial] = {}

    def _fusion_cases(self, spec: AttentionSpec) -> tuple[bool, ...]:
        """Whether batches run fused RoPE: (False,), (True,), or (True, False) when the choice
        is made per batch by length."""
        caps = self.capabilities
        if preprocess_mode(spec, caps.fused_rope) != "fused":
            return (False,)
        return (True,) if caps.fused_rope_max_seqlen is None else (True, False)

    def describe(self, platform: Platform) -> dict[str, str]:
        spec = self.bound_spec()
        cases = self._fusion_cases(spec)
        choices = [choose_kernel(spec, platform.sm, fused) for fused in cases]
        details = {
            **super().describe(platform),
            "kernel": KERNEL,
            "flashinfer_backend": choices[0].backend,
            "flashinfer_backend_reason": choices[0].reason,
            "pos_encoding_mode": _pos_encoding(cases[0]),
            "workspace_bytes": str(WORKSPACE_BYTES),
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

    def jit_modules(self, spec: AttentionSpec, sm: int) -> tuple[JitModule, ...]:
        """The flashinfer JIT modules this backend loads for ``spec`` on an ``sm`` device."""
        return tuple(
            JitModule(
                choose_kernel(spec, sm, fused).backend, dtype_name(spec.dtype), spec.head_dim, fused
            )
            for fused in self._fusion_cases(spec)
        )

    def _slot(self, device: torch.device, choice: KernelChoice) -> _WrapperSlot:
        slot = self._slots.get((device, choice.backend))
        if slot is None:
            import flashinfer  # lazily: a GPU library

            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspaces.get(device), kv_layout="NHD", backend=choice.backend
            )
            slot = _WrapperSlot(wrapper, choice)
            self._slots[(device, choice.backend)] = slot
        return slot

    def plan_kernel(
        self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool
    ) -> RaggedPlan:
        choice = choose_kernel(spec, device_sm(params.device), fused_rope)
        slot = self._slot(params.device, choice)
        indptr = host_indptr(nonempty_lengths(params.input_lengths))
        mode = _pos_encoding(fused_rope)
        rope_theta = spec.rope.theta if fused_rope and spec.rope is not None else None
        slot.wrapper.plan(
            qo_indptr=indptr,
            kv_indptr=indptr,
            num_qo_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim_qk=spec.head_dim,
            head_dim_vo=spec.head_dim,
            causal=spec.causal,
            pos_encoding_mode=mode,
            sm_scale=spec.scale,
            rope_scale=1.0 if fused_rope else None,
            rope_theta=rope_theta,
            q_data_type=spec.dtype,
            kv_data_type=spec.dtype,
            o_data_type=spec.output_dtype,
        )
        counter = self._serials.setdefault(params.device, _DeviceSerial())
        counter.value += 1
        return RaggedPlan(slot, counter, counter.value, choice, mode, indptr)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, RaggedPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        if kernel.serial != kernel.counter.value:
            raise ParamsError(
                f"{self.name}: this plan was replaced by a later prepare() on the same backend "
                "and device (flashinfer keeps one plan per wrapper); run forward() with the "
                "newest plan, or bind another backend instance for batches in flight together"
            )
        spec = plan.spec
        views = realigned(views, spec)
        out = torch.empty(views.q.shape, dtype=spec.output_dtype, device=views.q.device)
        kernel.slot.wrapper.run(views.q, views.k, views.v, out=out)
        return out


class FlashinferRopeBackend(FlashinferBackend):
    name = "flashinfer-rope"
    capabilities = replace(
        FlashinferBackend.capabilities,
        fused_rope=True,
        fused_rope_max_seqlen=FUSED_ROPE_MAX_SEQLEN,
        priority=(
            PriorityRule(
                "cuda",
                105,
                min_sm=90,
                max_sm=90,
                rope_fusable=True,
                note="above flashinfer for RoPE it fuses: fa3 + the separate pass on long "
                "batches, fused RoPE on short ones (short 256x64: 0.096 vs 0.181 ms; "
                "Qwen3-Embedding: 0.596 vs 0.613 ms; H200, docs/bench, 2026-11-30)",
            ),
            PriorityRule(
                "cuda",
                80,
                min_sm=80,
                note="below flashinfer: fusing not measured off Hopper, nothing to fuse here",
            ),
        ),
    )


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(
        api_version=API_VERSION, backends=[FlashinferBackend(), FlashinferRopeBackend()]
    )
