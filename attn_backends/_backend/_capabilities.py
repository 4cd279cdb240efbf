"""Backend capabilities as data, and the generic check every backend's `supports` starts with."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch

from .._values._dtypes import dtype_name
from .._values._feature_table import FEATURES, FP8, Feature, FeatureSupport
from .._values._platform import Platform, PlatformKind
from .._values._reasons import Reason, ReasonCode
from .._values._spec import AttentionSpec, kernel_rope_fusable


def _names(values: frozenset[int] | frozenset[str] | frozenset[torch.dtype]) -> str:
    return ", ".join(
        sorted(dtype_name(v) if isinstance(v, torch.dtype) else str(v) for v in values)
    )


_ANY = {"none": "any"}
"""Field metadata: ``None`` means any value, and `Capabilities.to_dict` says "any"."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared as data so that checks, docs and tests derive from it."""

    platforms: frozenset[PlatformKind]
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int] | None = field(default=None, metadata=_ANY)
    """Exact head dims served; ``None`` means any head dim."""
    min_sm: int | None = None
    """Lowest CUDA compute capability (e.g. 80), for CUDA platforms."""
    max_sm: int | None = None
    rocm_archs: frozenset[str] | None = field(default=None, metadata=_ANY)
    """gfx architectures served on ROCm; ``None`` means any."""
    gqa: bool = True
    causal: bool = True
    bidirectional: bool = True
    needs_contiguous: bool = False
    """The kernel reads Q, K and V as dense tensors; the contract copies the views for it."""
    features: tuple[FeatureSupport, ...] = ()
    """The features served beyond the plain mask, one `FeatureSupport` value each with that
    feature's own limits: ``(WindowSupport(right=False), SoftcapSupport(), AlibiSupport(
    bidirectional=False))``. A spec using a feature not listed is refused (`_feature_table`)."""
    fused_rope: bool = False
    """Applies rotate-half RoPE over the whole head inside the kernel (no separate pass)."""
    fused_rope_max_seqlen: int | None = None
    """With ``fused_rope``: fuse only batches whose longest sequence is at most this many
    tokens; longer batches run the separate pass and the kernel without RoPE (a measured
    crossover; ``None``: every batch is fused)."""
    cuda_graph: bool = False
    """``forward`` can be captured in a CUDA graph once per bucket and re-planned in place for
    every batch that fits it (`PrefillBackend.prepare_graph`); backends without it are refused
    for graph mode with a ``cuda_graph`` reason."""
    requires: tuple[str, ...] = ()
    """Optional libraries (import names) the kernel needs."""

    def __post_init__(self) -> None:
        limit = self.fused_rope_max_seqlen
        if limit is not None and (not self.fused_rope or not isinstance(limit, int) or limit < 1):
            raise ValueError(
                f"fused_rope_max_seqlen={limit!r}: give a positive int together with "
                "fused_rope=True, or None"
            )

    @property
    def fp8(self) -> bool:
        return any(dtype.is_floating_point and dtype.itemsize == 1 for dtype in self.dtypes)

    def support(self, feature: Feature[S]) -> S | None:
        """The declared support of ``feature`` (its limits), or ``None`` when not declared."""
        kind = feature.support
        if kind is None:
            return None
        return next((s for s in self.features if isinstance(s, kind)), None)

    @property
    def fp8_preprocess(self) -> bool:
        """RoPE/logn on FP8 input is applied before quantising (`Fp8Support.preprocess`)."""
        declared = self.support(FP8)
        return declared is not None and declared.preprocess

    def fuses_rope(self, spec: AttentionSpec, max_seqlen: int) -> bool:
        """Whether a batch whose longest sequence has ``max_seqlen`` tokens runs fused RoPE."""
        if not (self.fused_rope and kernel_rope_fusable(spec)):
            return False
        limit = self.fused_rope_max_seqlen
        return limit is None or max_seqlen <= limit

    def to_dict(self) -> dict[str, object]:
        """Every field (derived from the dataclass: a new field is listed without an edit
        here), each feature under its name with its limits, and ``fp8``."""
        out = {
            f.name: _jsonable(value)
            if (value := getattr(self, f.name)) is not None
            else f.metadata.get("none")
            for f in fields(self)
        }
        out["features"] = {s.feature: s.to_dict() for s in self.features}
        out["fp8"] = self.fp8
        return out


S = TypeVar("S", bound=FeatureSupport)


def _jsonable(value: object) -> Any:
    """A declared value as JSON: sets sorted (dtypes by name), ``None`` for "any" sets as
    ``"any"``."""
    if isinstance(value, frozenset):
        return sorted(dtype_name(v) if isinstance(v, torch.dtype) else v for v in value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def check_platform(caps: Capabilities, platform: Platform) -> list[Reason]:
    """Reasons the backend cannot run on this machine at all, whatever the request."""
    reasons: list[Reason] = []
    if platform.kind not in caps.platforms:
        reasons.append(
            Reason(
                ReasonCode.PLATFORM,
                f"does not run on {platform.kind}",
                "platform",
                platform.kind,
                _names(frozenset(caps.platforms)),
            )
        )
    elif platform.kind == "cuda":
        sm = platform.sm
        low = caps.min_sm if caps.min_sm is not None else 0
        high = caps.max_sm if caps.max_sm is not None else 10**6
        if sm is None or not low <= sm <= high:
            if caps.max_sm is None:
                allowed = f"sm{low} or newer"
            elif caps.min_sm is None:
                allowed = f"up to sm{high}"
            else:
                allowed = f"sm{low}..sm{high}"
            reasons.append(
                Reason(
                    ReasonCode.ARCH,
                    "CUDA architecture not served",
                    "arch",
                    str(platform.arch),
                    allowed,
                )
            )
    elif (
        platform.kind == "rocm"
        and caps.rocm_archs is not None
        and platform.arch not in caps.rocm_archs
    ):
        reasons.append(
            Reason(
                ReasonCode.ARCH,
                "ROCm architecture not served",
                "arch",
                str(platform.arch),
                _names(caps.rocm_archs),
            )
        )
    missing = [lib for lib in caps.requires if not platform.has_library(lib)]
    if missing:
        reasons.append(
            Reason(
                ReasonCode.LIBRARY_MISSING,
                f"needs {', '.join(missing)}, not installed",
                "libraries",
                "absent",
                ", ".join(missing),
            )
        )
    return reasons


def check_capabilities(caps: Capabilities, spec: AttentionSpec, platform: Platform) -> list[Reason]:
    """Every reason the declared capabilities rule the request out; empty when they fit."""
    reasons = check_platform(caps, platform)
    if spec.dtype not in caps.dtypes:
        code = ReasonCode.FP8 if spec.is_fp8 else ReasonCode.DTYPE
        reasons.append(
            Reason(
                code, "input dtype not served", "dtype", dtype_name(spec.dtype), _names(caps.dtypes)
            )
        )
    if caps.head_dims is not None and spec.head_dim not in caps.head_dims:
        reasons.append(
            Reason(
                ReasonCode.HEAD_DIM,
                "head dim not served",
                "head_dim",
                str(spec.head_dim),
                _names(caps.head_dims),
            )
        )
    if spec.is_gqa and not caps.gqa:
        reasons.append(
            Reason(
                ReasonCode.GQA,
                "grouped-query attention not served",
                "num_kv_heads",
                f"{spec.num_heads}/{spec.num_kv_heads}",
                "num_kv_heads == num_heads",
            )
        )
    if spec.causal and not caps.causal:
        reasons.append(
            Reason(ReasonCode.CAUSAL, "causal masking not served", "causal", "True", "False")
        )
    if not spec.causal and not caps.bidirectional:
        reasons.append(
            Reason(
                ReasonCode.BIDIRECTIONAL,
                "bidirectional attention not served",
                "causal",
                "False",
                "True",
            )
        )
    for feature in FEATURES:
        reasons += feature.reasons(caps.support(feature), spec)
    return reasons
