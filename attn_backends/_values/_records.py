"""Records as JSON: the one convention for numbers that are not finite, and canonical JSON
for decision fingerprints.

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
import re
from collections.abc import Mapping, Sequence

import torch

from ._dtypes import dtype_name

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


# Canonical JSON for decision fingerprints: values that compare equal print alike.

ABSENT = "<absent>"
"""Shown for a field that one fingerprint has and another lacks."""

_EXACT_INT_LIMIT = 2**53
"""Integral floats below this convert to int without losing a digit."""
_INT_TEXT = re.compile(r"[-+]?\d+")
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_DTYPE_TEXT: dict[str, str] = {
    str(value): dtype_name(value)
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}
"""``"torch.bfloat16"`` -> ``"bfloat16"`` for every dtype this torch defines."""


def canonical_number(value: int | float) -> int | float:
    """``10000.0`` -> ``10000``; other numbers unchanged."""
    if isinstance(value, float) and value.is_integer() and abs(value) < _EXACT_INT_LIMIT:
        return int(value)
    return value


def canonical_text(text: str) -> object:
    """A free-text value (a backend's detail) by meaning: numbers by value, dtypes by short name.

    Backends write details with ``str()``, so a theta may arrive as ``"10000"`` or ``"10000.0"``
    and a dtype as ``"torch.bfloat16"`` or ``"bfloat16"``.
    """
    stripped = text.strip()
    if _INT_TEXT.fullmatch(stripped):
        return int(stripped)
    if _FLOAT_TEXT.fullmatch(stripped):
        return canonical_number(float(stripped))
    return _DTYPE_TEXT.get(stripped, text)


def canonical(value: object) -> object:
    """``value`` with numbers and dtypes canonical and containers turned into JSON's own."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return canonical_number(value)
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, Mapping):
        return {str(key): canonical(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(item) for item in value), key=_dumps)
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    return str(value)


def _dumps(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def canonical_json(value: object) -> str:
    """The fingerprint text: canonical values, sorted keys, no optional whitespace."""
    return _dumps(canonical(value))


def _leaves(value: object, prefix: str, out: dict[str, object]) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            _leaves(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix or "<root>"] = value


def differing_fields(records: Sequence[object]) -> list[tuple[str, list[object]]]:
    """Dotted field paths whose values are not the same in all ``records``, with each record's
    value (`ABSENT` where a record lacks the field), in path order."""
    flat: list[dict[str, object]] = []
    for record in records:
        leaves: dict[str, object] = {}
        _leaves(record, "", leaves)
        flat.append(leaves)
    paths = sorted({path for leaves in flat for path in leaves})
    found = []
    for path in paths:
        values = [leaves.get(path, ABSENT) for leaves in flat]
        if len({_dumps(v) for v in values}) > 1:
            found.append((path, values))
    return found
