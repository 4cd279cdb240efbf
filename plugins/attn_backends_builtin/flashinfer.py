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

from ._flashinfer_common import (
    PREFILL_HEAD_DIMS,
    SIXTEEN_BIT,
    DeviceBuffers,
    JitModule,
    KernelChoice,
    choose_kernel,
    device_sm,
    dtype_str,
    host_indptr,
    nonempty_lengths,
    realigned,
)

API_VERSION = "1.0"
WORKSPACE_BYTES = 128 << 20
KERNEL = "flashinfer.BatchPrefillWithRaggedKVCacheWrapper"


class _WrapperSlot:
    """A flashinfer wrapper on one device. It keeps only its latest plan, so the slot counts
    plans and `attend` refuses a plan that a later ``prepare`` replaced."""

    def __init__(self, wrapper: Any, choice: KernelChoice) -> None:
        # Any: flashinfer ships no type information.
        self.wrapper = wrapper
        self.choice = choice
        self.serial = 0


@dataclass(frozen=True, eq=False)
class RaggedPlan:
    """The per-batch kernel plan: which wrapper, which of its plans, and what was planned."""

    slot: _WrapperSlot
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
                note="fastest measured on GQA shapes, on views (H200, 2026-11-29)",
            ),
        ),
    )

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        super().__init__(spec)
        self._workspaces = DeviceBuffers(WORKSPACE_BYTES)
        self._slots: dict[torch.device, _WrapperSlot] = {}

    def _fused(self, spec: AttentionSpec) -> bool:
        return preprocess_mode(spec, self.capabilities.fused_rope) == "fused"

    def describe(self, platform: Platform) -> dict[str, str]:
        spec = self.bound_spec()
        fused = self._fused(spec)
        choice = choose_kernel(spec, platform.sm, fused)
        return {
            **super().describe(platform),
            "kernel": KERNEL,
            "flashinfer_backend": choice.backend,
            "flashinfer_backend_reason": choice.reason,
            "pos_encoding_mode": _pos_encoding(fused),
            "workspace_bytes": str(WORKSPACE_BYTES),
        }

    def jit_modules(self, spec: AttentionSpec, sm: int) -> tuple[JitModule, ...]:
        """The flashinfer JIT module this backend loads for ``spec`` on an ``sm`` device."""
        fused = self._fused(spec)
        choice = choose_kernel(spec, sm, fused)
        return (JitModule(choice.backend, dtype_str(spec.dtype), spec.head_dim, fused),)

    def _slot(self, device: torch.device, choice: KernelChoice) -> _WrapperSlot:
        slot = self._slots.get(device)
        if slot is None:
            import flashinfer  # lazily: a GPU library

            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspaces.get(device), kv_layout="NHD", backend=choice.backend
            )
            slot = _WrapperSlot(wrapper, choice)
            self._slots[device] = slot
        elif slot.choice.backend != choice.backend:
            raise BackendFailure(
                f"{self.name}: the wrapper on {device} runs {slot.choice.backend}, this plan "
                f"needs {choice.backend}; bind a new backend instance for this spec"
            )
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
        slot.serial += 1
        return RaggedPlan(slot, slot.serial, choice, mode, indptr)

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, RaggedPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        if kernel.serial != kernel.slot.serial:
            raise ParamsError(
                f"{self.name}: this plan was replaced by a later prepare() on the same backend "
                "(flashinfer keeps one plan per wrapper); run forward() with the newest plan, "
                "or bind another backend instance for batches in flight together"
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
        priority=(
            PriorityRule(
                "cuda",
                80,
                min_sm=80,
                note="fused-RoPE candidate, ranked below flashinfer until measured per shape: "
                "faster on short 256x64 (0.167 vs 0.216 ms), slower on Qwen3-Embedding "
                "(1.08 vs 0.60 ms) on H200, 2026-11-29",
            ),
        ),
    )


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(
        api_version=API_VERSION, backends=[FlashinferBackend(), FlashinferRopeBackend()]
    )
