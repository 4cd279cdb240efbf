"""Typed, validated description of one attention layer: what every backend decision keys on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ._dtypes import MODEL_DTYPES, dtype_name, is_fp8
from ._errors import SpecError
from ._feature_table import FEATURES
from ._features import AlibiSpec, HeadwiseConfig, SlidingWindow
from ._numbers import finite_float, shown
from ._rope_spec import MAX_ROPE_THETA as MAX_ROPE_THETA
from ._rope_spec import RopeSpec as RopeSpec
from ._rope_spec import check_flag

MAX_SOFTMAX_SCALE = 256.0
"""Largest softmax scale (``1 / sqrt(head_dim)`` is 0.04 to 0.35): some kernels multiply Q and
K by the scale's square root in the input dtype, and float16 ends at 65504."""


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(f"AttentionSpec.{name} must be a positive int, got {value!r}")


def _rope_for_head(rope: object, head_dim: int) -> RopeSpec | None:
    """``rope`` checked against the head; a RoPE that turns no pair is no RoPE (``None``), so
    that specs meaning the same compare, hash and fingerprint alike."""
    if rope is None:
        return None
    if not isinstance(rope, RopeSpec):
        raise SpecError(f"AttentionSpec.rope must be a RopeSpec or None, got {shown(rope)}")
    rotary_dim = rope.rotary_dim
    if rotary_dim is not None and rotary_dim > head_dim:
        raise SpecError(f"RopeSpec.rotary_dim ({rotary_dim}) exceeds head_dim ({head_dim})")
    if rotary_dim is None and head_dim % 2:
        raise SpecError(
            f"RoPE over the whole head needs an even head_dim, got {head_dim}; "
            "set RopeSpec.rotary_dim to the even number of rotated dims"
        )
    rotated = head_dim if rotary_dim is None else rotary_dim
    if rotated and rope.scaling is not None:
        rope.scaling.check_rotary_dim(rotated)
    if rotated == 0 or (rope.scaling is not None and rope.scaling.rotating_pairs(rotated) == 0):
        return None
    return rope


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer of the model, as the no-cache prefill path sees it.

    Frozen and hashable, so it keys the selector's cache. Validated when built: a spec that
    exists is consistent.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """Dtype of the packed QKV input. FP8 dtypes mean per-tensor-scaled FP8 input."""
    causal: bool
    rope: RopeSpec | None = None
    use_logn_attn: bool = False
    """Scale Q at 0-based position p by ``max(1, ln(p + 1) / ln(logn_base))`` (Qwen logn)."""
    logn_base: int | None = None
    """Training context length that logn scaling is relative to; required with logn."""
    softmax_scale: float | None = None
    """``None`` means ``1 / sqrt(head_dim)``."""
    use_mla: bool = False
    headwise: HeadwiseConfig | None = field(default=None)
    window: SlidingWindow | None = None
    """Local attention: the query at ``i`` sees keys ``i - left .. i + right`` only (within
    its sequence, and on top of the causal rule). ``None``: the whole sequence."""
    logit_softcap: float | None = None
    """Gemma 2 soft-capping: scaled scores become ``cap * tanh(scores / cap)`` before the
    bias, mask and softmax. ``None``: no capping."""
    alibi: AlibiSpec | None = None
    """ALiBi bias added to the (scaled, capped) scores; ``None``: no bias."""
    chunk_size: int | None = None
    """Chunked attention (Llama 4's ``attention_chunk_size``): the query at position ``i`` sees
    key ``j`` only when ``i // chunk_size == j // chunk_size`` (positions restart with every
    sequence), on top of the causal rule and every other mask term. ``None``: no chunks."""
    attention_sinks: bool = False
    """GPT-OSS attention sinks: each query head has a learned logit ``s_h`` that joins the
    softmax's denominator (``exp(s_h)`` beside the visible keys' ``exp(score)``) and contributes
    no value. The logits are the layer's weights, so they reach ``forward`` per layer
    (``forward(..., sinks=tensor)``, float ``[Hq]``); the spec only says that they come."""

    def __post_init__(self) -> None:
        _positive_int("num_heads", self.num_heads)
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        check_flag("AttentionSpec.causal", self.causal)
        check_flag("AttentionSpec.use_logn_attn", self.use_logn_attn)
        check_flag("AttentionSpec.use_mla", self.use_mla)
        check_flag("AttentionSpec.attention_sinks", self.attention_sinks)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in MODEL_DTYPES:
            allowed = ", ".join(sorted(dtype_name(d) for d in MODEL_DTYPES))
            raise SpecError(f"AttentionSpec.dtype must be one of {allowed}; got {self.dtype!r}")
        object.__setattr__(self, "rope", _rope_for_head(self.rope, self.head_dim))
        if self.use_logn_attn:
            if not isinstance(self.logn_base, int) or self.logn_base < 2:
                raise SpecError(
                    "use_logn_attn=True needs logn_base, the training context length (an int "
                    f">= 2, e.g. 8192); got {self.logn_base!r}"
                )
        elif self.logn_base is not None:
            raise SpecError("logn_base is set but use_logn_attn is False; set both or neither")
        if self.softmax_scale is not None:
            scale = finite_float(self.softmax_scale)
            if scale is None or not 0 < scale <= MAX_SOFTMAX_SCALE:
                raise SpecError(
                    "softmax_scale must be a positive finite float of at most "
                    f"{MAX_SOFTMAX_SCALE:g} (some kernels multiply Q and K by its square root in "
                    f"the input dtype), or None for 1/sqrt(head_dim); got "
                    f"{shown(self.softmax_scale)}"
                )
        self._check_features()

    def _check_features(self) -> None:
        """Each feature's value against the rest of the layer (`_feature_table`), then stored
        in its one canonical form."""
        for feature in FEATURES:
            feature.validate(self)
        for feature in FEATURES:
            object.__setattr__(self, feature.field, feature.canonical(self))

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        """Columns of the packed QKV row: ``(Hq + 2 * Hkv) * D``."""
        return self.q_width + 2 * self.kv_width

    @property
    def scale(self) -> float:
        """The softmax scale actually used."""
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    @property
    def output_dtype(self) -> torch.dtype:
        """Model dtype of the output: the input dtype, or bfloat16 for FP8 input."""
        return torch.bfloat16 if self.is_fp8 else self.dtype

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head (0 without RoPE)."""
        if self.rope is None:
            return 0
        return self.rope.rotary_dim if self.rope.rotary_dim is not None else self.head_dim

    @property
    def rope_fusable(self) -> bool:
        """The spec's pre-processing is RoPE alone that a fused-RoPE kernel computes:
        rotate-half over the whole head, no logn, input not FP8, and no ALiBi (a fused-RoPE
        kernel takes one position encoding)."""
        return (
            self.rope is not None
            and not self.rope.interleaved
            and self.rotary_dim == self.head_dim
            and not self.use_logn_attn
            and not self.is_fp8
            and self.alibi is None
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": dtype_name(self.dtype),
            "causal": self.causal,
            "rope": (
                {**self.rope.to_dict(), "rotary_dim": self.rotary_dim}
                if self.rope is not None
                else None
            ),
            "use_logn_attn": self.use_logn_attn,
            "logn_base": self.logn_base,
            "softmax_scale": self.scale,
            **{key: value for f in FEATURES for key, value in f.record(self).items()},
        }


def kernel_rope_fusable(spec: AttentionSpec) -> bool:
    """A fused-RoPE kernel computes the spec's RoPE: fusable and plain theta (no scaling)."""
    return spec.rope_fusable and spec.rope is not None and spec.rope.is_plain


def spec_masked(spec: AttentionSpec) -> bool:
    """The spec restricts or biases scores beyond causality: a sliding window or ALiBi."""
    return spec.window is not None or spec.alibi is not None


# Attention specs of the embedding/reranker models this path serves, by name.

PRESETS: Mapping[str, AttentionSpec] = MappingProxyType(
    {
        "bert-base": AttentionSpec(12, 12, 64, torch.bfloat16, causal=False),
        "bge-m3": AttentionSpec(16, 16, 64, torch.bfloat16, causal=False),
        "qwen3-embedding-0.6b": AttentionSpec(
            16, 8, 128, torch.bfloat16, causal=True, rope=RopeSpec(theta=1e6)
        ),
        "gte-qwen2-7b": AttentionSpec(28, 4, 128, torch.bfloat16, causal=True, rope=RopeSpec(1e6)),
        "short": AttentionSpec(16, 8, 128, torch.bfloat16, causal=True, rope=RopeSpec(theta=1e6)),
    }
)
"""Model name -> spec (bf16). BGE-M3 is XLM-R large-like in head shape; GTE-Qwen2-7B runs
bidirectional in some serving stacks, here causal as in its reference implementation."""
