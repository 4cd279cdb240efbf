"""RoPE scaling: how long-context models stretch the rotary frequencies.

`RopeScaling` names one of the scaling rules of Hugging Face transformers' RoPE table (the
``rope_type`` of a config's ``rope_parameters``, formerly ``rope_scaling``) with its parameters,
validated once. It computes, in float64, the two things a RoPE pass needs for a batch: the
inverse frequency of each rotated pair and the attention factor that multiplies cos and sin.

Two rules depend on the batch: ``dynamic`` (NTK) raises theta once the longest sequence passes
``max_position_embeddings``, and ``longrope`` switches from its short to its long factors once
it passes ``original_max_position_embeddings``. Like transformers, the length is the largest
position of the forward call plus one: for a packed batch, its longest sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, cast

from ._errors import SpecError
from ._numbers import finite_float, shown

RopeType = Literal["default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"]
ROPE_TYPES: tuple[RopeType, ...] = (
    "default",
    "linear",
    "dynamic",
    "yarn",
    "longrope",
    "llama3",
    "proportional",
)
LENGTH_DEPENDENT: frozenset[str] = frozenset({"dynamic", "longrope"})
"""Rules whose frequencies change with the batch's longest sequence."""

_USED: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor", "max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "short_factor",
            "long_factor",
        }
    ),
    "llama3": frozenset(
        {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}
    ),
    "proportional": frozenset({"factor", "partial_rotary_factor"}),
}
"""The fields each rule reads; every other field must stay at its default."""
_REQUIRED: dict[str, tuple[str, ...]] = {
    "dynamic": ("max_position_embeddings",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
_HF_TYPE_ALIASES: dict[str, RopeType] = {"mrope": "default"}
"""Multimodal RoPE on text positions (every axis the same position) is plain RoPE."""


FACTOR_RANGE = (1e-6, 1e6)
"""Bounds of every stretch and divisor (``factor``, ``short_factor``/``long_factor``,
``beta_fast``/``beta_slow``; real models use 1 to 64). Within them every frequency and every
angle over any int32 position stays far inside float64, and dynamic NTK's stretched theta cannot
overflow."""
MAX_CONTEXT = 2**53
"""Largest context length (``original_max_position_embeddings``, ``max_position_embeddings``):
the rules divide by it as a float64, which holds ints up to 2**53 exactly."""
MAX_ATTENTION_FACTOR = 16.0
"""Largest multiplier of cos and sin (real models use about 1 to 1.5): it multiplies rotated
Q and K in the input dtype (float16 ends at 65504) and so the scores by its square."""


def _is_number(value: object) -> bool:
    return finite_float(value) is not None


def _positive(name: str, value: object, example: str) -> None:
    number = finite_float(value)
    if number is None or number <= 0:
        raise SpecError(
            f"RopeScaling.{name} must be a positive finite number ({example}), got {shown(value)}"
        )


def _in_factor_range(name: str, value: object, example: str) -> None:
    low, high = FACTOR_RANGE
    number = finite_float(value)
    if number is None or not low <= number <= high:
        raise SpecError(
            f"RopeScaling.{name} must be a number in [{low:g}, {high:g}] ({example}; beyond "
            f"that range RoPE's frequencies overflow or vanish), got {shown(value)}"
        )


def _context_length(name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_CONTEXT:
        raise SpecError(
            f"RopeScaling.{name} must be a positive int of at most 2**53 ({example}), got "
            f"{shown(value)}"
        )


def _factors(name: str, value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)):
        items: tuple[object, ...] = ()
    else:
        try:
            items = tuple(cast("tuple[object, ...]", value))
        except TypeError:
            raise SpecError(
                f"RopeScaling.{name} must be a sequence of positive numbers (one per rotated "
                f"pair), got {shown(value)}"
            ) from None
    low, high = FACTOR_RANGE
    numbers = [finite_float(x) for x in items]
    if not numbers or not all(x is not None and low <= x <= high for x in numbers):
        raise SpecError(
            f"RopeScaling.{name} must hold one number in [{low:g}, {high:g}] per rotated pair "
            f"(rotary_dim / 2 of them), got {shown(value)}"
        )
    return tuple(cast(float, x) for x in numbers)


def _yarn_mscale(scale: float, weight: float) -> float:
    """YaRN's magnitude correction ``0.1 * weight * ln(scale) + 1`` (1 without stretching)."""
    return 1.0 if scale <= 1.0 else 0.1 * weight * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling rule of transformers' table and its parameters (see the README).

    Frozen and hashable: it is part of `RopeSpec`, which keys the selector's caches. Each rule
    reads only its own fields (``_USED``); the others must stay at their defaults, so that two
    equal rules compare equal. Build it from a config with `RopeScaling.from_hf`.
    """

    rope_type: RopeType = "default"
    factor: float = 1.0
    """Context stretch: positions are effectively divided by it (linear), or it shapes the
    rule (dynamic, yarn, llama3); for longrope only the default attention factor reads it."""
    original_max_position_embeddings: int | None = None
    """Pre-training context length (yarn, longrope, llama3)."""
    max_position_embeddings: int | None = None
    """Context length beyond which dynamic NTK starts raising theta (dynamic only)."""
    attention_factor: float | None = None
    """Explicit cos/sin multiplier (yarn, longrope); ``None`` derives it from ``factor``."""
    beta_fast: float = 32.0
    """YaRN: pairs turning more than this many times over the original context keep their
    frequency."""
    beta_slow: float = 1.0
    """YaRN: pairs turning fewer times than this are interpolated fully (divided by factor)."""
    mscale: float | None = None
    """YaRN (DeepSeek): with ``mscale_all_dim``, the attention factor is the ratio of two
    magnitude corrections."""
    mscale_all_dim: float | None = None
    truncate: bool = True
    """YaRN: round the ramp's ends to whole pair indices (floor / ceil)."""
    low_freq_factor: float | None = None
    """llama3: wavelengths above ``original / low_freq_factor`` are divided by ``factor``."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below ``original / high_freq_factor`` are kept; between, smoothed."""
    short_factor: tuple[float, ...] | None = None
    """longrope: per-pair divisors up to the original context length."""
    long_factor: tuple[float, ...] | None = None
    """longrope: per-pair divisors for batches longer than the original context."""
    partial_rotary_factor: float = 1.0
    """proportional: the leading share of the pairs that rotate (frequencies keep the
    exponent of the whole head); the rest get frequency 0."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise SpecError(
                f"RopeScaling.rope_type must be one of {', '.join(ROPE_TYPES)}; got "
                f"{shown(self.rope_type)}"
            )
        used = _USED[self.rope_type]
        for f in fields(self):
            if f.name == "rope_type" or f.name in used:
                continue
            if getattr(self, f.name) != f.default:
                users = sorted(t for t, names in _USED.items() if f.name in names)
                raise SpecError(
                    f"RopeScaling.{f.name} is not used by rope_type {self.rope_type!r}; leave it "
                    f"at {f.default!r} or choose a rope_type that reads it ({', '.join(users)})"
                )
        for name in _REQUIRED.get(self.rope_type, ()):
            if getattr(self, name) is None:
                raise SpecError(f"rope_type {self.rope_type!r} needs RopeScaling.{name}; set it")
        _in_factor_range("factor", self.factor, "e.g. 4.0 for a context stretched 4x")
        for name in ("original_max_position_embeddings", "max_position_embeddings"):
            value = getattr(self, name)
            if value is not None:
                _context_length(name, value, "a context length such as 32768")
        if self.attention_factor is not None:
            _positive("attention_factor", self.attention_factor, "or None to derive it")
        _in_factor_range("beta_fast", self.beta_fast, "YaRN's default is 32")
        _in_factor_range("beta_slow", self.beta_slow, "YaRN's default is 1")
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and not _is_number(value):
                raise SpecError(
                    f"RopeScaling.{name} must be a finite number or None, got {shown(value)}"
                )
        if not isinstance(self.truncate, bool):
            raise SpecError(
                f"RopeScaling.truncate must be True or False, got {shown(self.truncate)}"
            )
        if self.rope_type == "llama3":
            _positive("low_freq_factor", self.low_freq_factor, "Llama 3.1 uses 1")
            _positive("high_freq_factor", self.high_freq_factor, "Llama 3.1 uses 4")
            if cast(float, self.high_freq_factor) <= cast(float, self.low_freq_factor):
                raise SpecError(
                    f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                    f"low_freq_factor ({self.low_freq_factor}), e.g. 4 and 1"
                )
        if self.rope_type == "longrope":
            short = _factors("short_factor", self.short_factor)
            long = _factors("long_factor", self.long_factor)
            if len(short) != len(long):
                raise SpecError(
                    f"RopeScaling.short_factor has {len(short)} entries and long_factor "
                    f"{len(long)}; give both one entry per rotated pair (rotary_dim / 2)"
                )
            object.__setattr__(self, "short_factor", short)
            object.__setattr__(self, "long_factor", long)
        p = finite_float(self.partial_rotary_factor)
        if p is None or not 0 <= p <= 1:
            raise SpecError(
                "RopeScaling.partial_rotary_factor must be in [0, 1] (e.g. 0.25; 0 rotates "
                f"nothing), got {shown(self.partial_rotary_factor)}"
            )
        self._check_attention_scaling()

    def _check_attention_scaling(self) -> None:
        """The cos/sin multiplier, given or derived, is one every backend computes with."""
        derives_from_log = self.rope_type == "longrope" and self.attention_factor is None
        if derives_from_log and self.factor > 1 and self.original_max_position_embeddings == 1:
            raise SpecError(
                "longrope derives its attention factor from log(original_max_position_"
                "embeddings), which is 0 for a context of 1: give the real original context "
                "length, or set attention_factor"
            )
        try:
            value = self.attention_scaling
        except ZeroDivisionError:
            raise SpecError(
                f"yarn's attention factor divides by 0.1 * mscale_all_dim * ln(factor) + 1, which "
                f"is 0 for mscale_all_dim {self.mscale_all_dim} and factor {self.factor:g}: give "
                "the model's mscale_all_dim (DeepSeek: equal to mscale, e.g. 0.707) or "
                "attention_factor"
            ) from None
        if not 0 < value <= MAX_ATTENTION_FACTOR:  # NaN fails too
            source = (
                "RopeScaling.attention_factor"
                if self.attention_factor is not None
                else f"the attention factor that {self.rope_type} derives from factor "
                f"{self.factor:g}, mscale {self.mscale} and mscale_all_dim {self.mscale_all_dim}"
            )
            raise SpecError(
                f"{source} is {value:g}; it must be in (0, {MAX_ATTENTION_FACTOR:g}]: cos and sin "
                "multiply Q and K by it in the input dtype (real models use about 1 to 1.5)"
            )

    @property
    def is_plain(self) -> bool:
        """Plain theta RoPE: what the native and fused kernels compute."""
        return self.rope_type == "default"

    @property
    def length_dependent(self) -> bool:
        """The frequencies depend on the batch's longest sequence (dynamic, longrope)."""
        return self.rope_type in LENGTH_DEPENDENT

    def rotating_pairs(self, rotary_dim: int) -> int:
        """How many of the ``rotary_dim / 2`` pairs turn at all: all of them, except for
        ``proportional``, whose trailing pairs get frequency 0."""
        if self.rope_type == "proportional":
            return int(self.partial_rotary_factor * rotary_dim // 2)
        return rotary_dim // 2

    def check_rotary_dim(self, rotary_dim: int) -> None:
        """Refuse a rule that cannot apply to ``rotary_dim`` rotated dims."""
        pairs = rotary_dim // 2
        if self.rope_type == "longrope":
            assert self.short_factor is not None  # required for longrope
            if len(self.short_factor) != pairs:
                raise SpecError(
                    f"longrope has {len(self.short_factor)} short/long factors but rotary_dim "
                    f"{rotary_dim} has {pairs} pairs; give one factor per pair"
                )
        if self.rope_type == "dynamic" and rotary_dim <= 2:
            raise SpecError(
                f"dynamic NTK scaling needs rotary_dim > 2 (its theta exponent is d / (d - 2)), "
                f"got {rotary_dim}"
            )

    @property
    def attention_scaling(self) -> float:
        """The multiplier of cos and sin (so of both rotated Q and K): 1 except yarn/longrope."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.rope_type == "yarn":
            if self.mscale and self.mscale_all_dim:
                return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                    self.factor, self.mscale_all_dim
                )
            return _yarn_mscale(self.factor, 1.0)
        if self.rope_type == "longrope":
            if self.factor <= 1.0:
                return 1.0
            original = cast(int, self.original_max_position_embeddings)
            return math.sqrt(1.0 + math.log(self.factor) / math.log(original))
        return 1.0

    def inverse_frequencies(self, theta: float, rotary_dim: int, seq_len: int) -> list[float]:
        """Float64 angle per position step of each of the ``rotary_dim / 2`` pairs.

        ``seq_len`` is the batch's longest sequence (read by dynamic and longrope only).
        """
        self.check_rotary_dim(rotary_dim)
        d = rotary_dim
        pairs = range(d // 2)
        plain = [theta ** (-2.0 * i / d) for i in pairs]
        kind = self.rope_type
        if kind == "default":
            return plain
        if kind == "linear":
            return [w / self.factor for w in plain]
        if kind == "dynamic":
            limit = cast(int, self.max_position_embeddings)
            length = max(seq_len, limit)
            stretched = theta * (self.factor * length / limit - (self.factor - 1.0)) ** (
                d / (d - 2)
            )
            return [stretched ** (-2.0 * i / d) for i in pairs]
        if kind == "yarn":
            return self._yarn(theta, d, plain)
        if kind == "longrope":
            original = cast(int, self.original_max_position_embeddings)
            chosen = self.long_factor if seq_len > original else self.short_factor
            return [w / s for w, s in zip(plain, cast("tuple[float, ...]", chosen), strict=True)]
        if kind == "llama3":
            return self._llama3(plain)
        rotating = self.rotating_pairs(d)
        return [w / self.factor if i < rotating else 0.0 for i, w in enumerate(plain)]

    def _yarn(self, theta: float, d: int, plain: list[float]) -> list[float]:
        """Blend, per pair, the original frequency (fast pairs) with it divided by ``factor``
        (slow pairs) along a linear ramp between the pairs that turn ``beta_fast`` and
        ``beta_slow`` times over the original context."""
        original = cast(int, self.original_max_position_embeddings)

        def pair_turning(turns: float) -> float:
            # Solve original * theta**(-2i/d) / (2 pi) == turns for i.
            return d * math.log(original / (2.0 * math.pi * turns)) / (2.0 * math.log(theta))

        start, stop = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
        if self.truncate:
            start, stop = math.floor(start), math.ceil(stop)
        start, stop = max(start, 0), min(stop, d - 1)
        if start == stop:
            stop += 0.001  # a ramp of zero width would divide by zero
        out = []
        for i, w in enumerate(plain):
            interpolated = min(1.0, max(0.0, (i - start) / (stop - start)))
            out.append(w * (1.0 - interpolated) + (w / self.factor) * interpolated)
        return out

    def _llama3(self, plain: list[float]) -> list[float]:
        """Keep short wavelengths, divide long ones by ``factor``, and blend linearly in
        ``original / wavelength`` between the two thresholds."""
        original = cast(int, self.original_max_position_embeddings)
        low, high = cast(float, self.low_freq_factor), cast(float, self.high_freq_factor)
        out = []
        for w in plain:
            wavelength = 2.0 * math.pi / w
            if wavelength < original / high:
                out.append(w)
            elif wavelength > original / low:
                out.append(w / self.factor)
            else:
                kept = (original / wavelength - low) / (high - low)
                out.append(kept * w + (1.0 - kept) * w / self.factor)
        return out

    def to_dict(self) -> dict[str, object]:
        """The rule and the fields it reads (HF's key names), for records and fingerprints."""
        out: dict[str, object] = {"rope_type": self.rope_type}
        for f in fields(self):
            if f.name in _USED[self.rope_type]:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_hf(
        cls,
        rope_parameters: Mapping[str, Any] | None,
        *,
        max_position_embeddings: int | None = None,
        original_max_position_embeddings: int | None = None,
    ) -> RopeScaling:
        """The rule of a transformers config's RoPE dict.

        Takes ``config.rope_parameters`` (transformers 5) or ``config.rope_scaling`` (older:
        ``type`` for ``rope_type``); ``None`` or ``{}`` is plain RoPE. ``max_position_embeddings``
        is the config's: dynamic needs it, and yarn/longrope derive a missing factor from it.
        ``original_max_position_embeddings`` given here wins over the dict's, as transformers
        does for a config that keeps it outside the dict (Phi-3); failing both, transformers
        falls back to ``max_position_embeddings``, and so does this.
        """
        if rope_parameters is not None and not isinstance(rope_parameters, Mapping):
            raise SpecError(
                "rope_parameters must be a dict such as {'rope_type': 'linear', 'factor': 4.0} "
                f"or None, got {type(rope_parameters).__name__}"
            )
        params = dict(rope_parameters or {})
        if any(isinstance(v, Mapping) for v in params.values()):
            raise SpecError(
                "rope_parameters is nested by layer type; build one RopeSpec per layer type from "
                "its own dict, e.g. RopeScaling.from_hf(rope_parameters['full_attention'], ...)"
            )
        raw_type = params.get("rope_type", params.get("type", "default"))
        if not isinstance(raw_type, str):
            raise SpecError(
                f"rope_type must be a string, one of {', '.join(ROPE_TYPES)}; got a "
                f"{type(raw_type).__name__}"
            )
        kind = _HF_TYPE_ALIASES.get(raw_type, raw_type)
        if kind not in ROPE_TYPES:
            raise SpecError(
                f"rope_type {shown(raw_type)} is not supported; the rope types are "
                f"{', '.join(ROPE_TYPES)}"
            )
        used = _USED[kind]
        kw: dict[str, Any] = {"rope_type": kind}
        original = original_max_position_embeddings or params.get(
            "original_max_position_embeddings"
        )
        if "original_max_position_embeddings" in used:
            kw["original_max_position_embeddings"] = original or max_position_embeddings
        if "factor" in used:
            factor = params.get("factor")
            if factor is None and kind in ("yarn", "longrope"):
                if not (max_position_embeddings and kw["original_max_position_embeddings"]):
                    raise SpecError(
                        f"{kind} without 'factor' derives it as max_position_embeddings / "
                        "original_max_position_embeddings; pass max_position_embeddings or set "
                        "'factor'"
                    )
                _context_length("max_position_embeddings", max_position_embeddings, "the config's")
                original = kw["original_max_position_embeddings"]
                _context_length("original_max_position_embeddings", original, "e.g. 4096")
                factor = max_position_embeddings / original
            elif factor is None and kind == "proportional":
                factor = 1.0
            elif factor is None:
                raise SpecError(f"rope_type {kind!r} needs 'factor' in rope_parameters")
            kw["factor"] = factor
        if kind == "dynamic":
            kw["max_position_embeddings"] = max_position_embeddings
        if kind in ("yarn", "longrope"):
            kw["attention_factor"] = params.get("attention_factor")
        if kind == "yarn":
            # transformers treats a missing or zero beta as its default (32 / 1), and an explicit
            # null truncate as no truncation.
            kw["beta_fast"] = params.get("beta_fast") or 32.0
            kw["beta_slow"] = params.get("beta_slow") or 1.0
            kw["mscale"] = params.get("mscale")
            kw["mscale_all_dim"] = params.get("mscale_all_dim")
            kw["truncate"] = bool(params.get("truncate", True))
        if kind == "longrope":
            kw["short_factor"] = params.get("short_factor")
            kw["long_factor"] = params.get("long_factor")
        if kind == "llama3":
            kw["low_freq_factor"] = params.get("low_freq_factor")
            kw["high_freq_factor"] = params.get("high_freq_factor")
        if kind == "proportional":
            # A missing or null share is transformers' default, 1; an explicit 0 rotates none.
            share = params.get("partial_rotary_factor")
            kw["partial_rotary_factor"] = 1.0 if share is None else share
        return cls(**kw)
