"""Attention features beyond the plain mask: local (sliding) windows and ALiBi biases.

Both are plain data on `AttentionSpec` (``window`` and ``alibi``); the spec validates them
against the rest of the layer. Positions are 0-based and restart with every sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._errors import SpecError


def _window_size(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


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
        _window_size("SlidingWindow.left", self.left, 0)
        _window_size("SlidingWindow.right", self.right, 0)

    @classmethod
    def causal(cls, sliding_window: int) -> SlidingWindow:
        """From ``config.sliding_window`` of Mistral, Qwen2, Gemma 2 or Gemma 3 (causal).

        Hugging Face keeps key ``j`` for query ``i`` when ``i - W < j <= i``: ``W`` keys
        counting the query itself.
        """
        size = _window_size("sliding_window", sliding_window, 1)
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
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    extra = num_heads - n
    slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * extra, 2)]
    return tuple(slopes)


@dataclass(frozen=True)
class AlibiSpec:
    """ALiBi: a per-head linear bias on the scores, added after the softmax scale.

    Causal specs add ``slope_h * (j - i)`` (BLOOM, MPT; the same softmax as BLOOM's
    ``slope_h * j``), bidirectional specs ``-slope_h * |i - j|`` (jina-embeddings-v2).
    """

    slopes: tuple[float, ...] | None = None
    """One slope per query head; ``None`` means `bloom_alibi_slopes` for the spec's heads."""

    def __post_init__(self) -> None:
        if self.slopes is None:
            return
        try:
            slopes = tuple(self.slopes)
        except TypeError:
            raise SpecError(
                f"AlibiSpec.slopes must be a sequence of floats or None, got {self.slopes!r}"
            ) from None
        bad = [
            s
            for s in slopes
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)
        ]
        if bad or not slopes:
            raise SpecError(
                "AlibiSpec.slopes must be finite numbers, one per query head (or None for "
                f"BLOOM's slopes); got {self.slopes!r}"
            )
        object.__setattr__(self, "slopes", tuple(float(s) for s in slopes))

    def slopes_for(self, num_heads: int) -> tuple[float, ...]:
        """The slope of each of the spec's ``num_heads`` query heads."""
        return self.slopes if self.slopes is not None else bloom_alibi_slopes(num_heads)

    def to_dict(self) -> dict[str, object]:
        return {"slopes": list(self.slopes) if self.slopes is not None else "bloom"}
