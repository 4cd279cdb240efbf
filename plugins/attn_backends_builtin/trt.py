"""``trt``: TensorRT-LLM's FMHA v2 context kernels, through flashinfer's port.

The kernels come from ``flashinfer.prefill.trtllm_fmha_v2_prefill``. A native ``tensorrt_llm``
path is not implemented: no ``tensorrt_llm`` wheel could be obtained for the test machine, so
nothing here claims to use it.

Layout: ``PACKED_QKV`` on the packed rows viewed as ``[tokens, 3, H, D]``. The kernel derives
every stride from the shapes, so it needs dense rows; the backend asks the contract for
``dense-packed`` input, which is zero-copy when the engine's buffer is dense and one copy when
it is a strided slice. MHA only: for GQA the kernel's correct layouts (``SEPARATE_Q_K_V``,
``CONTIGUOUS_Q_KV``) need contiguous copies of Q, K and V, and with those copies it was slower
than ``flashinfer`` on views on an H200 (0.92 vs 0.54 ms on Qwen3-Embedding-0.6B, 0.32 vs
0.19 ms on 256 x 64 short sequences); strided views in ``SEPARATE_Q_K_V`` gave wrong numbers.

Limits read from flashinfer 0.7.0.post1: sm90 warp-specialized kernels for fp16/bf16 and head
dims 32..256 (``fmha_library.generate_jit_sources``; sm120 has other kernels, not declared
here); mask ``"padding"`` is bidirectional and ``"causal"`` causal, and any other string
silently becomes causal in the C++ (``string_to_mask_type``), so the mapping is explicit. The
fp16 kernels accumulate in fp16 (flashinfer forces fp32 accumulation for bf16 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from attn_backends import AttentionSpec, FMHAParams, Platform, PrefillPlan
from attn_backends.errors import BackendFailure
from attn_backends.plugin import (
    Capabilities,
    InputLayout,
    KernelModule,
    PluginManifest,
    PrefillBackend,
    QKVViews,
    dtype_name,
    hookimpl,
)

from ._flashinfer_common import (
    SIXTEEN_BIT,
    JitModule,
    StreamBuffers,
    device_sm,
    is_aligned,
    nonempty_lengths,
    prefix_sums,
    stream_key,
)
from ._flashinfer_jit import kernel_module

API_VERSION = "2.0"
KERNEL_SOURCE = "flashinfer.trtllm_fmha_v2_prefill"
INPUT_LAYOUT = "PACKED_QKV"
WORKSPACE_BYTES = 16 << 20
"""FMHA v2 carves a tile counter (and, for multi-CTA kernels, which flashinfer does not
enable, barriers and scratch) out of this; 16 MiB is ample."""
TRT_HEAD_DIMS = frozenset({32, 40, 48, 64, 80, 96, 104, 128, 160, 192, 256})
"""``head_size_qk_warpspec_values`` of flashinfer's sm90 FMHA v2 generator."""

TrtMask = Literal["causal", "padding"]
WORKSPACES = StreamBuffers(WORKSPACE_BYTES)
"""One workspace per device and stream: the tile counter inside is consumed by each kernel
before the next one of the same stream runs (see `StreamBuffers`)."""


def clear_caches() -> None:
    """Reset this plugin's process-wide state: the stream workspaces."""
    WORKSPACES.clear()


def trt_mask_mode(causal: bool) -> TrtMask:
    """FMHA v2's mask name for a spec: ``padding`` means no causal mask (only the ragged
    sequence bounds)."""
    return "causal" if causal else "padding"


@dataclass(frozen=True, eq=False)
class TrtPlan:
    """Device metadata for one batch: everything ``trtllm_fmha_v2_prefill`` takes besides the
    rows and the output."""

    workspace: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    batch_size: int
    max_seqlen: int
    mask_mode: TrtMask


class TrtBackend(PrefillBackend):
    name = "trt"
    capabilities = Capabilities(
        platforms=frozenset({"cuda"}),
        dtypes=SIXTEEN_BIT,
        head_dims=TRT_HEAD_DIMS,
        min_sm=90,
        max_sm=90,
        gqa=False,
        requires=("flashinfer",),
    )

    def input_layout(self, spec: AttentionSpec) -> InputLayout:
        return "dense-packed"

    def accepts_rows(self, rows: torch.Tensor) -> bool:
        return is_aligned(rows)

    def describe(self, platform: Platform) -> dict[str, str]:
        spec = self.spec
        return {
            **super().describe(platform),
            "kernel_source": KERNEL_SOURCE,
            "trt_input_layout": INPUT_LAYOUT,
            "mask_mode": trt_mask_mode(spec.causal),
            "native_tensorrt_llm": "not implemented",
        }

    @classmethod
    def jit_modules(cls, spec: AttentionSpec, sm: int) -> tuple[JitModule, ...]:
        """The flashinfer JIT module this backend loads: one per (layout, dtype)."""
        return (JitModule("fmha_v2", dtype_name(spec.dtype), None),)

    @classmethod
    def kernel_modules(cls, spec: AttentionSpec, device: torch.device) -> tuple[KernelModule, ...]:
        sm = device_sm(device)
        if sm is None:
            return ()
        return tuple(kernel_module(m) for m in cls.jit_modules(spec, sm))

    def plan_kernel(self, spec: AttentionSpec, params: FMHAParams, *, fused_rope: bool) -> TrtPlan:
        device = params.device
        lengths = nonempty_lengths(params.input_lengths)
        return TrtPlan(
            workspace=WORKSPACES.get(stream_key(device)),
            seq_lens=torch.tensor(lengths, dtype=torch.int32).to(device),
            cu_seqlens=torch.tensor(prefix_sums(lengths), dtype=torch.int32).to(device),
            batch_size=len(lengths),
            max_seqlen=max(lengths),
            mask_mode=trt_mask_mode(spec.causal),
        )

    def attend(self, views: QKVViews, plan: PrefillPlan) -> torch.Tensor:
        kernel = plan.kernel
        if not isinstance(kernel, TrtPlan):
            raise BackendFailure(f"{self.name} got a plan it did not make: {kernel!r}")
        spec = plan.spec
        rows = views.packed
        if not rows.is_contiguous():
            raise BackendFailure(f"{self.name} needs dense packed rows; the contract gave strided")
        from flashinfer.prefill import trtllm_fmha_v2_prefill  # lazily: a GPU library

        tokens = rows.shape[0]
        out = torch.empty(
            (tokens, spec.num_heads, spec.head_dim), dtype=spec.output_dtype, device=rows.device
        )
        trtllm_fmha_v2_prefill(
            qkv=rows.view(tokens, 3, spec.num_heads, spec.head_dim),
            input_layout=INPUT_LAYOUT,
            workspace_buffer=kernel.workspace,
            seq_lens=kernel.seq_lens,
            max_q_len=kernel.max_seqlen,
            max_kv_len=kernel.max_seqlen,
            bmm1_scale=spec.scale,
            bmm2_scale=1.0,
            batch_size=kernel.batch_size,
            cum_seq_lens_q=kernel.cu_seqlens,
            cum_seq_lens_kv=kernel.cu_seqlens,
            out=out,
            mask_mode=kernel.mask_mode,
        )
        return out


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[TrtBackend])
