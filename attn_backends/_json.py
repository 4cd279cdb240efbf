"""JSON output of ``attn-backends``: always valid JSON, even when a number is not finite.

Python's `json` writes ``NaN`` and ``Infinity``, which other parsers reject. A non-finite float
in a record becomes ``null``, and a sibling key ``<key>_not_finite`` keeps what it was
(``"nan"``, ``"inf"`` or ``"-inf"``), so a reader can tell "not measured" from "blew up".
"""

from __future__ import annotations

import json
import math

NOT_FINITE_SUFFIX = "_not_finite"


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


def dumps(record: object) -> str:
    """``record`` as indented, strictly valid JSON (no NaN/Infinity tokens)."""
    return json.dumps(_finite(record), indent=2, allow_nan=False)
