"""flashinfer's ragged prefill kernel, as the legacy path and the raw baseline call it by hand.

What the ``flashinfer`` backends decide about that kernel (fa2 or fa3, the workspace size) comes
from the flashinfer plugin itself, so that every path loads the very module the backend loads
(and a prebuild compiled), never a second one chosen by ``auto``, and never a stale copy of the
rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from attn_backends_builtin._flashinfer_common import choose_kernel, device_sm
from attn_backends_builtin.flashinfer import KERNEL, WORKSPACE_BYTES

from attn_backends import AttentionSpec, FMHAParams

from .paths import Skip

RaggedKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]`` over the batch's sequences."""

RAGGED_KERNEL = KERNEL
"""The library class called here, as the flashinfer backends' decision records name it
(``kernel``): a plan whose record names it runs the kernel the raw baseline calls."""


def kernel_name(spec: AttentionSpec, device: torch.device, *, fused_rope: bool = False) -> str:
    """``fa3`` or ``fa2``: the flashinfer plugin's own choice for ``spec`` on ``device``."""
    return choose_kernel(spec, device_sm(device), fused_rope).backend


def flashinfer_ragged(
    spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool = False
) -> RaggedKernel | Skip:
    """flashinfer's ragged prefill kernel, planned for this batch as the backend plans it, with
    RoPE in the kernel (``ROPE_LLAMA``, fa2) when ``fused_rope``; the kernel is the wrapper's
    own bound ``run``, with nothing of ours around it; a `Skip` when it cannot run here."""
    try:
        import flashinfer  # untyped GPU library: its objects are Any
    except ImportError as exc:
        return Skip(f"flashinfer is not installed ({exc})")
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=params.device)
    name = kernel_name(spec, params.device, fused_rope=fused_rope)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=name)
    indptr = torch.tensor(params.cu_seqlens_host, dtype=torch.int32)  # host: plan reads it there
    rope_theta = spec.rope.theta if fused_rope and spec.rope is not None else None
    wrapper.plan(
        indptr,
        indptr,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        causal=spec.causal,
        pos_encoding_mode="ROPE_LLAMA" if fused_rope else "NONE",
        sm_scale=spec.scale,
        rope_scale=1.0 if fused_rope else None,
        rope_theta=rope_theta,
        q_data_type=spec.dtype,
        kv_data_type=spec.dtype,
        o_data_type=spec.output_dtype,
    )
    kernel: RaggedKernel = wrapper.run
    return kernel
