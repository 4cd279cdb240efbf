"""What the flashinfer-based backends (``flashinfer``, ``flashinfer-rope``, ``trt``) share.

One function each for: the fa2/fa3 decision, the JIT modules a spec needs, the host-side ragged
metadata, the 16-byte alignment rule of flashinfer's loads, and the per-device workspace. None
of it imports flashinfer, so the selector, ``describe`` and the GPU prebuild script can use it on
any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from attn_backends import AttentionSpec, QKVViews, split_views

FlashinferKernel = Literal["fa2", "fa3"]
JitKind = Literal["fa2", "fa3", "fmha_v2", "rope"]

PREFILL_HEAD_DIMS = frozenset({64, 128, 256})
"""Head dims of flashinfer's ragged prefill: fa3 asserts qk == vo in {64, 128, 256}
(hopper/prefill_sm90.cuh); fa2 needs a multiple of 64 and ships these three (aot.py)."""
FA3_HEAD_DIMS = frozenset({64, 128, 256})
SIXTEEN_BIT = frozenset({torch.float16, torch.bfloat16})
ALIGN_BYTES = 16
"""fa2 loads with 128-bit cp.async and fa3/FMHA v2 with TMA: base and row strides must be
16-byte aligned, or the kernels read the wrong bytes."""


@dataclass(frozen=True)
class KernelChoice:
    """The flashinfer prefill implementation picked for a spec on a device, and why."""

    backend: FlashinferKernel
    reason: str


def choose_kernel(spec: AttentionSpec, sm: int | None, fused_rope: bool) -> KernelChoice:
    """fa3 where flashinfer has it (sm90, 16-bit, head dim 64/128/256, no fused RoPE), else fa2.

    Decided here rather than by flashinfer's ``backend="auto"``: the choice is recorded, and
    ``auto`` is sticky per wrapper, so a later plan with RoPE would stay on fa3, which ignores
    RoPE without an error.
    """
    if fused_rope:
        return KernelChoice("fa2", "fused RoPE (ROPE_LLAMA) exists only in fa2; fa3 ignores it")
    if sm != 90:
        where = "an unknown architecture" if sm is None else f"sm{sm}"
        return KernelChoice("fa2", f"fa3 needs sm90 (Hopper); the device is {where}")
    if spec.dtype not in SIXTEEN_BIT:
        return KernelChoice("fa2", "fa3 serves fp16/bf16 here")
    if spec.head_dim not in FA3_HEAD_DIMS:
        return KernelChoice("fa2", f"fa3 has no head dim {spec.head_dim}")
    return KernelChoice("fa3", "sm90, 16-bit input, head dim 64/128/256, no fused RoPE")


def device_sm(device: torch.device) -> int | None:
    """Compute capability of a CUDA device as ``major * 10 + minor``; None off CUDA."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


@dataclass(frozen=True, order=True)
class JitModule:
    """One flashinfer JIT module a backend loads, in the terms of flashinfer's module key."""

    kind: JitKind
    dtype: str
    """``float16`` or ``bfloat16``; ``any`` for ``rope``."""
    head_dim: int | None
    """None where one module holds every head dim (``fmha_v2`` per layout and dtype, ``rope``)."""
    rope: bool = False
    """pos_encoding_mode ROPE_LLAMA (fa2 only)."""

    def __str__(self) -> str:
        if self.kind == "rope":
            return "rope (apply_rope_pos_ids_inplace)"
        if self.kind == "fmha_v2":
            return f"fmha_v2 PACKED_QKV {self.dtype}"
        posenc = "ROPE_LLAMA" if self.rope else "NONE"
        return f"{self.kind} {self.dtype} d{self.head_dim} posenc={posenc}"


def nonempty_lengths(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Sequence lengths without the empty ones: they own no rows, so dropping them changes no
    offset, and the kernels never see a zero-length request."""
    return tuple(n for n in lengths if n > 0)


def prefix_sums(lengths: tuple[int, ...]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def host_indptr(lengths: tuple[int, ...]) -> torch.Tensor:
    """int32 CPU prefix sums; flashinfer's plan reads them on the host (no device sync)."""
    return torch.tensor(prefix_sums(lengths), dtype=torch.int32)


def is_aligned(rows: torch.Tensor) -> bool:
    """Whether the packed ``[tokens, width]`` rows meet the 16-byte rule (base and row stride).

    Column offsets of Q, K and V are multiples of ``head_dim`` elements, 16-byte aligned for
    every head dim these backends declare, so the rows decide.
    """
    size = rows.element_size()
    return rows.data_ptr() % ALIGN_BYTES == 0 and (rows.stride(0) * size) % ALIGN_BYTES == 0


def realigned(views: QKVViews, spec: AttentionSpec) -> QKVViews:
    """The views themselves when aligned (always for buffers torch allocates); otherwise views
    of one fresh, aligned copy of the rows."""
    if is_aligned(views.packed):
        return views
    rows = views.packed.clone(memory_format=torch.contiguous_format)
    q, k, v = split_views(rows, spec, rows.shape[0])
    return QKVViews(rows, q, k, v, views.fp8_scales)


class DeviceBuffers:
    """One uint8 scratch buffer per device, allocated on first use and then reused."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        buffer = self._buffers.get(device)
        if buffer is None:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            self._buffers[device] = buffer
        return buffer
