"""What the flashinfer-based backends (``flashinfer``, ``flashinfer-rope``, ``trt``) share.

One function each for: the fa2/fa3 decision, the JIT modules a spec needs, the host-side ragged
metadata, the 16-byte alignment rule of flashinfer's loads, and the per-device workspace. None
of it imports flashinfer, so the selector, ``describe`` and the GPU prebuild script can use it on
any machine.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Literal

import torch

from attn_backends import AttentionSpec

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


@dataclass(frozen=True)
class KernelVariant:
    """A bound spec's fa2/fa3 choice on one architecture, per fusion case, made at bind."""

    sm: int | None
    cases: tuple[tuple[bool, KernelChoice], ...]
    """``(fused_rope, choice)`` for each case the spec's batches can take, the fused one
    first; one case unless fusing depends on the batch's length."""

    def kernel(self, fused_rope: bool) -> KernelChoice | None:
        """The choice for batches that do (or do not) fuse RoPE; None for a case not bound."""
        return next((choice for fused, choice in self.cases if fused == fused_rope), None)


def choose_kernel(spec: AttentionSpec, sm: int | None, fused_rope: bool) -> KernelChoice:
    """fa3 where flashinfer has it (sm90, 16-bit, head dim 64/128/256, no fused RoPE), else fa2.

    Decided here rather than by flashinfer's ``backend="auto"``: the choice is recorded, and
    ``auto`` is sticky per wrapper, so a later plan with RoPE would stay on fa3, which ignores
    RoPE without an error.
    """
    if fused_rope:
        return KernelChoice("fa2", "fused RoPE (ROPE_LLAMA) exists only in fa2; fa3 ignores it")
    if spec.alibi is not None:
        return KernelChoice("fa2", "ALiBi exists only in fa2; fa3 ignores it")
    if sm != 90:
        where = "an unknown architecture" if sm is None else f"sm{sm}"
        return KernelChoice("fa2", f"fa3 needs sm90 (Hopper); the device is {where}")
    if spec.dtype not in SIXTEEN_BIT:
        return KernelChoice("fa2", "fa3 serves fp16/bf16 here")
    if spec.head_dim not in FA3_HEAD_DIMS:
        return KernelChoice("fa2", f"fa3 has no head dim {spec.head_dim}")
    return KernelChoice("fa3", "sm90, 16-bit input, head dim 64/128/256, no fused RoPE")


def device_sm(device: torch.device) -> int | None:
    """Compute capability of a CUDA device as ``major * 10 + minor``; None off CUDA. Asked
    of the driver once per device index (`_index_sm`): a batch's plan reads it, and the query
    costs tens of µs on every new batch."""
    if device.type != "cuda":
        return None
    index = device.index
    return _index_sm(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=64)
def _index_sm(index: int) -> int:
    """A device's compute capability never changes while the process runs."""
    major, minor = torch.cuda.get_device_capability(index)
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
    alibi: bool = False
    """pos_encoding_mode ALIBI (fa2 only)."""
    sliding_window: bool = False
    """The variant compiled with a sliding window (``window_left >= 0``)."""
    logit_softcap: bool = False
    """The variant compiled with logits soft-capping."""

    @property
    def pos_encoding(self) -> int:
        """flashinfer's ``PosEncodingMode`` value: 0 NONE, 1 ROPE_LLAMA, 2 ALIBI."""
        return 2 if self.alibi else int(self.rope)

    def __str__(self) -> str:
        if self.kind == "rope":
            return "rope (apply_rope_pos_ids_inplace)"
        if self.kind == "fmha_v2":
            return f"fmha_v2 PACKED_QKV {self.dtype}"
        posenc = ("NONE", "ROPE_LLAMA", "ALIBI")[self.pos_encoding]
        variants = "".join(
            f" {name}"
            for name, on in (("swa", self.sliding_window), ("softcap", self.logit_softcap))
            if on
        )
        return f"{self.kind} {self.dtype} d{self.head_dim} posenc={posenc}{variants}"


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
    every head dim these backends declare, so the rows decide. The contract asks once per
    buffer signature and hands a misaligned buffer over as one aligned copy.
    """
    size = rows.element_size()
    return rows.data_ptr() % ALIGN_BYTES == 0 and (
        rows.shape[0] <= 1 or (rows.stride(0) * size) % ALIGN_BYTES == 0
    )


StreamKey = tuple[torch.device, int]


def stream_key(device: torch.device) -> StreamKey:
    """The device and the handle of its current stream (0 off CUDA): work enqueued under one
    key runs in order, which is what makes sharing a scratch buffer under that key safe."""
    if device.type != "cuda":
        return device, 0
    return device, int(torch.cuda.current_stream(device).cuda_stream)


class CompletionMarker:
    """Whether the device work enqueued before it (on the current stream) has run.

    A CUDA event on CUDA devices; off CUDA, work is synchronous and the marker always done.
    """

    def __init__(self, device: torch.device) -> None:
        self._event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(torch.cuda.current_stream(device))

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class StreamBuffers:
    """One uint8 scratch buffer per device and stream, allocated on first use, then reused.

    Kernels that use the scratch (flashinfer's split-KV partial results, FMHA v2's tile
    counter) consume it before the next kernel of the same stream starts, so every plan made
    on a stream can share that stream's buffer; another stream gets its own, so kernels
    running concurrently never share one.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buffers: dict[StreamKey, torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, key: StreamKey) -> torch.Tensor:
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=key[0])
                self._buffers[key] = buffer
            return buffer

    def clear(self) -> None:
        """Forget every buffer: the next `get` allocates anew; a plan made before keeps the
        buffer it holds alive."""
        with self._lock:
            self._buffers.clear()
