"""The one JSON convention of this library for numbers that are not finite.

Python's `json` writes ``NaN`` and ``Infinity``, which other parsers reject. Everything this
library writes as JSON (the command line's output, a rank's decision sent to the other ranks,
decision fingerprints) goes through `json_safe`: a non-finite float in a record becomes
``null``, and a sibling key ``<key>_not_finite`` keeps what it was (``"nan"``, ``"inf"`` or
``"-inf"``), so a reader can tell "not measured" from "blew up". In a list there is no sibling
to hold it: the item is ``null``.
"""

from __future__ import annotations

import json
import math

NOT_FINITE_SUFFIX = "_not_finite"


def json_safe(value: object) -> object:
    """``value`` with every non-finite float replaced by the convention above."""
    return _finite(value)


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return _finite_dict(value)
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _finite_dict(record: dict[object, object]) -> dict[object, object]:
    out: dict[object, object] = {}
    for key, value in record.items():
        out[key] = _finite(value)
        if isinstance(value, float) and not math.isfinite(value):
            out[f"{key}{NOT_FINITE_SUFFIX}"] = str(value)
    return out


def dumps(record: object, *, indent: int | None = 2) -> str:
    """``record`` as strictly valid JSON (no NaN/Infinity tokens), indented unless
    ``indent=None``."""
    return json.dumps(_finite(record), indent=indent, allow_nan=False)
