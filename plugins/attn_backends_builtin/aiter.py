"""``aiter-asm`` and ``aiter-nonasm``: AMD's aiter varlen flash attention, registered together.

Both share `AiterVarlenBackend` (views, cu_seqlens, flags, output, and the call built from the
installed aiter's own parameter lists); they differ only in the aiter function they call and in
the limits they declare, read from the amd-aiter source (0.1.7 to 0.1.20.post1):

* ``aiter-asm`` calls the ASM fmha v3 kernels (``fmha_v3_varlen_fwd``). aiter sends a varlen
  call there only for bf16, head dim 128, no bias/alibi/dropout/sliding window
  (``can_impl_fmha_v3_fwd`` in aiter/ops/mha.py), and ships the kernels for gfx942 and gfx950
  only (aiter_meta/hsa/gfx9*/fmha_v3_fwd); the group-mode kernels serve no mask and
  bottom-right causal. Anything else would fail inside aiter, so it is refused up front.
* ``aiter-nonasm`` calls the CK kernels (``mha_varlen_fwd``) for fp16 and bf16, any head dim
  that is a multiple of 8 up to 256 (the op does not pad; C++ checks, CK d-padding tiles), and
  the FP8 varlen entry point for per-tensor FP8 at head dim 128 in the arch's FP8 format. The
  CK op also takes sliding windows (both sides), the logit soft-cap and ALiBi (any slopes,
  causal or bidirectional), not ALiBi with the soft-cap (`_aiter_features`); FP8 takes none.

Neither declares ``fp8_preprocess``: aiter applies no RoPE and these backends rotate nothing
before quantising, so an FP8 spec with RoPE or logn is refused, never rotated in its stored
FP8 form.
"""

from __future__ import annotations

import torch

from attn_backends import AttentionSpec, Platform
from attn_backends.plugin import (
    AlibiSupport,
    Capabilities,
    PluginManifest,
    Reason,
    ReasonCode,
    SoftcapSupport,
    WindowSupport,
    dtype_name,
    hookimpl,
)

from ._aiter_binding import EntryPoint
from ._aiter_common import NATIVE_FP8, AiterVarlenBackend, local_cu_count
from ._aiter_features import feature_reasons

API_VERSION = "2.0"

ASM_GFX942_CU_COUNTS = frozenset({304, 80, 64})
"""gfx942 parts aiter ships ASM kernel objects for: MI300X/MI325X (304 CUs) and MI308X (80 or 64).
On any other CU count the kernel is never loaded (aiter_meta/hsa/gfx942/fmha_v3_fwd/codegen.py
``fmha_fwd_v3_kernel``: "TODO: return with error")."""

FP8_HEAD_DIM = 128
"""The only head dim aiter builds FP8 (fp8bf16) varlen kernels for (CK fmha_fwd.py receipt 200)."""


class AiterAsmBackend(AiterVarlenBackend):
    name = "aiter-asm"
    capabilities = Capabilities(
        platforms=frozenset({"rocm"}),
        rocm_archs=frozenset({"gfx942", "gfx950"}),
        dtypes=frozenset({torch.bfloat16}),
        head_dims=frozenset({128}),
        gqa=True,
        causal=True,
        bidirectional=True,
        needs_contiguous=False,
        requires=("aiter",),
    )

    def entry_point(self, spec: AttentionSpec) -> EntryPoint:
        return "fmha_v3_varlen_fwd"

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        cus = local_cu_count(platform) if platform.arch == "gfx942" else None
        if cus is None or cus in ASM_GFX942_CU_COUNTS:
            return []
        return [
            Reason(
                ReasonCode.ARCH,
                "aiter ships gfx942 ASM attention kernels only for 304-CU (MI300X/MI325X) and "
                "80/64-CU (MI308X) parts",
                "arch",
                f"gfx942 with {cus} CUs",
                ", ".join(str(n) for n in sorted(ASM_GFX942_CU_COUNTS)) + " CUs",
            )
        ]


class AiterNonAsmBackend(AiterVarlenBackend):
    name = "aiter-nonasm"
    capabilities = Capabilities(
        platforms=frozenset({"rocm"}),
        rocm_archs=frozenset({"gfx90a", "gfx942", "gfx950"}),
        dtypes=frozenset(
            {torch.float16, torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e4m3fn}
        ),
        head_dims=frozenset(range(8, 257, 8)),
        gqa=True,
        causal=True,
        bidirectional=True,
        needs_contiguous=False,
        features=(WindowSupport(), SoftcapSupport(), AlibiSupport(with_softcap=False)),
        requires=("aiter",),
    )

    def entry_point(self, spec: AttentionSpec) -> EntryPoint:
        return "flash_attn_varlen_fp8_pertensor_func" if spec.is_fp8 else "mha_varlen_fwd"

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = feature_reasons(spec)
        if not spec.is_fp8:
            return reasons
        native = NATIVE_FP8.get(platform.arch or "")
        if platform.kind == "rocm" and native != spec.dtype:
            allowed = (
                f"{dtype_name(native)} on {platform.arch}"
                if native is not None
                else ", ".join(f"{dtype_name(d)} on {a}" for a, d in sorted(NATIVE_FP8.items()))
            )
            reasons.append(
                Reason(
                    ReasonCode.FP8,
                    "aiter builds its FP8 kernels for the arch's own FP8 format only",
                    "dtype",
                    f"{dtype_name(spec.dtype)} on {platform.arch}",
                    allowed,
                )
            )
        if spec.head_dim != FP8_HEAD_DIM:
            reasons.append(
                Reason(
                    ReasonCode.HEAD_DIM,
                    "aiter's FP8 varlen kernel serves head dim 128 only",
                    "head_dim",
                    str(spec.head_dim),
                    str(FP8_HEAD_DIM),
                )
            )
        return reasons


@hookimpl
def attn_backends_register(host_api_version: str) -> PluginManifest:
    return PluginManifest(api_version=API_VERSION, backends=[AiterAsmBackend, AiterNonAsmBackend])
