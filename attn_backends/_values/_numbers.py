"""Numbers from untrusted values, and values shown briefly in error messages.

Python ints have no size limit, so ``math.isfinite(10**400)`` raises `OverflowError` instead of
answering; a config file or the command line can hand over such an int, a string, a bool or a
NaN. `finite_float` turns each into a float or ``None``, so that validators refuse them with the
named error they promise. `shown` keeps a 400-digit number or a deeply nested list from turning
that error's one line into a page (or into a `RecursionError`).
"""

from __future__ import annotations

import math
import reprlib

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel = 3
_BRIEF.maxlong = 24
_BRIEF.maxstring = 40
_BRIEF.maxother = 40


def finite_float(value: object) -> float | None:
    """``value`` as a finite float; ``None`` for anything else: bools, strings, NaN, infinities
    and ints beyond float range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def shown(value: object) -> str:
    """A short ``repr`` of a value for an error message: long numbers and strings cut in the
    middle, nesting cut at three levels."""
    return _BRIEF.repr(value)
