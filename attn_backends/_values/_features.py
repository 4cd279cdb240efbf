"""The values of the attention features beyond the plain mask: local (sliding) windows, ALiBi
biases, rtp-llm's headwise masks, and the bounds every backend computes them within.

They are plain data on `AttentionSpec` (``window``, ``alibi``, ``headwise``, ``logit_softcap``,
``chunk_size``);
each feature's descriptor (`_feature_table`) validates them against the rest of the layer.
Positions are 0-based and restart with every sequence.

Every value a constructor accepts is one every backend declaring the feature computes without
overflow or NaN; where the math needs a bound, the constructor says it:

- window sides and headwise token counts: at most `MAX_WINDOW` (2**31 - 1), the int32 range
  the kernels take (flashinfer's ``window_left``, aiter's ``window_size_*``); a window wider than
  every sequence is the whole sequence (``window=None``); the chunk size likewise
  (`MAX_CHUNK_SIZE`);
- the soft-cap: within `SOFTCAP_RANGE`, see there;
- ALiBi slopes: from 0 to `MAX_ALIBI_SLOPE`, see there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._errors import SpecError

MAX_WINDOW = 2**31 - 1
"""Largest window side and headwise token count: the int32 range kernels take them in."""

MAX_CHUNK_SIZE = 2**31 - 1
"""Largest ``chunk_size``: positions and the chunk are int32 in the kernels' index math; a
chunk longer than every sequence is no chunk (``chunk_size=None``)."""

SOFTCAP_RANGE = (1e-6, 1e6)
"""Smallest and largest ``logit_softcap``. Kernels compute ``cap * tanh(score / cap)`` in
float32: a cap past float32's range (1e39) is inf there and gives ``inf * 0 = NaN``, one near
its smallest normal number (1e-38) makes ``score / cap`` overflow; within this range both stay
ordinary float32 numbers for every score. A larger cap changes no score a layer produces
(``None`` is no cap), a smaller one flattens every score to within float32's resolution."""

MAX_ALIBI_SLOPE = 1e6
"""Largest ALiBi slope. The bias ``-slope * distance`` is computed in float32 (sequences up to
2**31 tokens: at most 2.1e15, finite); a slope past float32's range (1e39) is inf there and
gives ``inf * 0 = NaN`` on the diagonal. Slopes are not negative: the bias is a penalty, and a
negative slope makes far keys' biases positive, which overflow a 16-bit dense mask to inf."""


_WIDER = "; a window wider than every sequence is the whole sequence: window=None"


def _window_size(
    name: str, value: object, minimum: int, maximum: int | None = None, hint: str = _WIDER
) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise SpecError(
            f"{name} must be at most {maximum} (2**31 - 1, the int32 range kernels take), got "
            f"{value!r}{hint}"
        )
    return value


def bounded_number(name: str, value: object, low: float, high: float, example: str) -> float:
    """``value`` as a float when it is an int or float within ``[low, high]``; a `SpecError`
    naming the bounds otherwise (NaN, inf and ints past float's range, such as 10**400,
    included: they compare without conversion)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not low <= value <= high  # NaN fails both comparisons
    ):
        shown = repr(value)
        shown = shown if len(shown) <= 40 else f"{shown[:20]}... ({len(shown)} characters)"
        raise SpecError(
            f"{name} must be a number from {_bound(low)} to {_bound(high)} ({example}), got {shown}"
        )
    return float(value)


def _bound(value: float) -> str:
    """1e6, 1e-6, 0: a bound as one writes it."""
    if value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:g}"
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


@dataclass(frozen=True)
class SlidingWindow:
    """The query at position ``i`` sees key ``j`` only when ``i - left <= j <= i + right``.

    On a causal spec the causal rule applies too, so ``right`` must be 0. Build it from a
    Hugging Face config with the classmethods, which carry each family's off-by-one:

    - `causal`: Mistral, Qwen2, Gemma 2, Gemma 3 (``sliding_window`` W: W keys, the query's
      own included, hence ``left = W - 1``);
    - `modernbert`: ModernBERT (``local_attention`` L: ``|i - j| <= L // 2``);
    - `gemma3_bidirectional`: Gemma 3 with ``use_bidirectional_attention`` (EmbeddingGemma;
      ``sliding_window`` S as written in config.json: ``|i - j| <= S // 2``).
    """

    left: int
    """Keys visible before the query (0: none)."""
    right: int
    """Keys visible after the query (0: none; must be 0 on a causal spec)."""

    def __post_init__(self) -> None:
        _window_size("SlidingWindow.left", self.left, 0, MAX_WINDOW)
        _window_size("SlidingWindow.right", self.right, 0, MAX_WINDOW)

    @classmethod
    def causal(cls, sliding_window: int) -> SlidingWindow:
        """From ``config.sliding_window`` of Mistral, Qwen2, Gemma 2 or Gemma 3 (causal).

        Hugging Face keeps key ``j`` for query ``i`` when ``i - W < j <= i``: ``W`` keys
        counting the query itself.
        """
        size = _window_size("sliding_window", sliding_window, 1, MAX_WINDOW + 1)
        return cls(left=size - 1, right=0)

    @classmethod
    def modernbert(cls, local_attention: int) -> SlidingWindow:
        """From ModernBERT's ``config.local_attention`` (128 for the released models).

        Hugging Face keeps ``|i - j| <= local_attention // 2`` on its local layers (its
        ``config.sliding_window`` is that half-width).
        """
        half = _window_size("local_attention", local_attention, 0) // 2
        return cls(left=half, right=half)

    @classmethod
    def gemma3_bidirectional(cls, sliding_window: int) -> SlidingWindow:
        """From ``sliding_window`` in config.json of a Gemma 3 model with
        ``use_bidirectional_attention`` (EmbeddingGemma: 512).

        Hugging Face stores ``S // 2 + 1`` on the loaded config and keeps
        ``|i - j| < S // 2 + 1``, that is ``|i - j| <= S // 2``. Pass the config.json value
        (a loaded config's ``to_dict()`` gives it back), not the converted attribute.
        """
        half = _window_size("sliding_window", sliding_window, 0) // 2
        return cls(left=half, right=half)

    def describe(self) -> str:
        return f"left={self.left},right={self.right}"

    def to_dict(self) -> dict[str, object]:
        return {"left": self.left, "right": self.right}


def bloom_alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi slopes for ``num_heads`` heads as BLOOM (and MPT, jina-embeddings-v2) define them.

    With ``n`` the largest power of two not above ``num_heads``: ``2 ** (-8 k / n)`` for
    ``k = 1 .. n``, then for the remaining heads every other slope of the ``2 n`` sequence,
    ``2 ** (-4 k / n)`` for ``k = 1, 3, 5, ...``.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise SpecError(f"bloom_alibi_slopes needs a positive int of heads, got {num_heads!r}")
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    extra = num_heads - n
    slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * extra, 2)]
    return tuple(slopes)


FLOAT32_SLOPE_TOLERANCE = 2.0**-22
"""Relative: two float32 units in the last place. Kernels read slopes as float32, and the same
slopes computed in float32 by another library (transformers' ``build_alibi_tensor`` raises a
float32 base to integer powers) land one unit away from the float64 values rounded."""


def same_slopes(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Whether two slope lists are one list as kernels read them (float32, within rounding)."""
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=FLOAT32_SLOPE_TOLERANCE, abs_tol=0.0)
        for x, y in zip(a, b, strict=True)
    )


@dataclass(frozen=True)
class AlibiSpec:
    """ALiBi: a per-head linear bias on the scores, added after the softmax scale.

    Causal specs add ``slope_h * (j - i)`` (BLOOM, MPT; the same softmax as BLOOM's
    ``slope_h * j``), bidirectional specs ``-slope_h * |i - j|`` (jina-embeddings-v2).

    On an `AttentionSpec`, slopes equal to BLOOM's for its heads (compared as every kernel reads
    them, in float32, within its rounding: transformers computes them in float32) are stored as
    ``None``, so one
    layer compares, hashes and fingerprints the same however it was written: ``AlibiSpec()``
    and BLOOM's slopes written out are one spec, across ranks too. ``None`` rather than the
    resolved list keeps the recorded form (``"bloom"``) and every earlier fingerprint.
    """

    slopes: tuple[float, ...] | None = None
    """One slope per query head, each from 0 to `MAX_ALIBI_SLOPE`; ``None`` means
    `bloom_alibi_slopes` for the spec's heads."""

    def __post_init__(self) -> None:
        if self.slopes is None:
            return
        try:
            slopes = tuple(self.slopes)
        except TypeError:
            raise SpecError(
                f"AlibiSpec.slopes must be a sequence of floats or None, got {self.slopes!r}"
            ) from None
        if not slopes:
            raise SpecError(
                "AlibiSpec.slopes must hold one slope per query head (or be None for BLOOM's "
                f"slopes); got {self.slopes!r}"
            )
        values = tuple(
            bounded_number(
                f"AlibiSpec.slopes[{n}]", s, 0.0, MAX_ALIBI_SLOPE, "BLOOM's are 2**-1 .. 2**-8"
            )
            for n, s in enumerate(slopes)
        )
        object.__setattr__(self, "slopes", values)

    def slopes_for(self, num_heads: int) -> tuple[float, ...]:
        """The slope of each of the spec's ``num_heads`` query heads."""
        return self.slopes if self.slopes is not None else bloom_alibi_slopes(num_heads)

    def to_dict(self) -> dict[str, object]:
        return {"slopes": list(self.slopes) if self.slopes is not None else "bloom"}


@dataclass(frozen=True)
class HeadwiseConfig:
    """Per-head attention pattern for long causal sequences (rtp-llm's headwise prefill).

    Retrieval heads keep full causal attention. Every other head lets the query at position
    ``p`` see key ``j`` only when ``j <= p`` and (``j < sink_token_num`` or
    ``p - j <= swa_token_num``): the sinks plus a window of ``swa_token_num + 1`` keys ending at
    the query. A sequence with fewer than ``seqlen_threshold`` tokens (or fewer than
    ``sink_token_num``) uses full attention on every head.
    """

    retrieval_heads: frozenset[int]
    """Query-head indices (0-based) that keep full attention."""
    sink_token_num: int = 4
    swa_token_num: int = 8192
    seqlen_threshold: int = 16384

    def __post_init__(self) -> None:
        try:
            heads = frozenset(self.retrieval_heads)
        except TypeError:
            raise SpecError(
                "HeadwiseConfig.retrieval_heads must be a set of head indices, got "
                f"{self.retrieval_heads!r}"
            ) from None
        object.__setattr__(self, "retrieval_heads", heads)
        if any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in heads):
            raise SpecError("HeadwiseConfig.retrieval_heads must be non-negative head indices")
        for name, value in (
            ("sink_token_num", self.sink_token_num),
            ("swa_token_num", self.swa_token_num),
            ("seqlen_threshold", self.seqlen_threshold),
        ):
            _window_size(f"HeadwiseConfig.{name}", value, 0, MAX_WINDOW, hint="")

    def is_full_for(self, seq_len: int) -> bool:
        """Whether a sequence of this length runs full attention on every head."""
        return seq_len < self.seqlen_threshold or seq_len < self.sink_token_num

    def to_dict(self) -> dict[str, object]:
        return {
            "retrieval_heads": sorted(self.retrieval_heads),
            "sink_token_num": self.sink_token_num,
            "swa_token_num": self.swa_token_num,
            "seqlen_threshold": self.seqlen_threshold,
        }
