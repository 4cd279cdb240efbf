"""Checks a backend's declarations once, when it registers, so selection can trust them.

A frozen dataclass does not check its field types: ``Capabilities(head_dims=16)`` constructs
fine and fails later, inside every `select`.
These functions list every problem instead, and the registry refuses that backend alone.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from .._values._feature_table import FEATURES, FeatureSupport
from .._values._platform import PLATFORM_KINDS
from ._capabilities import Capabilities

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")
"""Backend names: no spaces, commas or colons, which the environment lists use as syntax."""
_MODULE_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _fields_typed(cls: type, annotation: str) -> tuple[str, ...]:
    """The dataclass fields declared with ``annotation``, in declaration order: a flag added to
    the dataclass is checked without a list here to keep in step."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.type == annotation)


_CAPABILITY_FLAGS = _fields_typed(Capabilities, "bool")


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a backend, or None."""
    if not isinstance(name, str):
        return f"name must be a str, got {type(name).__name__}"
    if NAME_PATTERN.fullmatch(name) is None:
        return (
            f"name {name!r} must be 1-100 letters, digits or . _ + - (starting with a letter or "
            "digit), e.g. 'myvendor-fmha'"
        )
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _set_problem(field: str, value: object, element: type, optional: bool) -> str | None:
    if value is None and optional:
        return None
    kind = f"a frozenset of {element.__name__}" + (" or None" if optional else "")
    if not isinstance(value, frozenset):
        return f"{field} must be {kind}, got {type(value).__name__}"
    wrong = sorted(
        {
            type(v).__name__
            for v in value
            if not isinstance(v, element) or (element is int and isinstance(v, bool))
        }
    )
    if wrong:
        return f"{field} must be {kind}; it holds {', '.join(wrong)}"
    return None


def _sm_problems(owner: str, min_sm: object, max_sm: object) -> list[str]:
    problems = [
        f"{owner}.{field} must be an int (e.g. 80) or None, got {value!r}"
        for field, value in (("min_sm", min_sm), ("max_sm", max_sm))
        if value is not None and not _is_int(value)
    ]
    if not problems and isinstance(min_sm, int) and isinstance(max_sm, int) and min_sm > max_sm:
        problems.append(f"{owner}: min_sm {min_sm} is above max_sm {max_sm}")
    return problems


def capability_problems(caps: object) -> list[str]:
    """Every problem of a backend's declared capabilities; empty when they can be trusted."""
    if not isinstance(caps, Capabilities):
        return [f"capabilities must be a Capabilities, not {type(caps).__name__}"]
    problems: list[str] = []
    for field, value, element, optional in (
        ("platforms", caps.platforms, str, False),
        ("dtypes", caps.dtypes, torch.dtype, False),
        ("head_dims", caps.head_dims, int, True),
        ("rocm_archs", caps.rocm_archs, str, True),
    ):
        problem = _set_problem(f"capabilities.{field}", value, element, optional)
        if problem is not None:
            problems.append(problem)
    if isinstance(caps.platforms, frozenset) and not caps.platforms <= set(PLATFORM_KINDS):
        unknown = sorted(str(p) for p in caps.platforms - set(PLATFORM_KINDS))
        problems.append(
            f"capabilities.platforms holds {', '.join(unknown)}; use {', '.join(PLATFORM_KINDS)}"
        )
    problems += _sm_problems("capabilities", caps.min_sm, caps.max_sm)
    problems += [
        f"capabilities.{flag} must be True or False, got {value!r}"
        for flag in _CAPABILITY_FLAGS
        if not isinstance(value := getattr(caps, flag), bool)
    ]
    problems += feature_problems(caps.features)
    limit = caps.fused_rope_max_seqlen
    if limit is not None and not _is_int(limit):
        problems.append(f"capabilities.fused_rope_max_seqlen must be an int or None, got {limit!r}")
    if not isinstance(caps.requires, tuple) or not all(
        isinstance(lib, str) and _MODULE_PATTERN.fullmatch(lib) for lib in caps.requires
    ):
        problems.append(
            f"capabilities.requires must be a tuple of import names such as ('flashinfer',), "
            f"got {caps.requires!r}"
        )
    return problems


_KNOWN = {f.support: f.name for f in FEATURES if f.support is not None}
"""Each feature's support type, by the feature's name."""


def feature_problems(features: object) -> list[str]:
    """Problems of ``capabilities.features``: a tuple of `FeatureSupport` values of the
    features in the table, one per feature, whose limit flags are real bools."""
    if not isinstance(features, tuple):
        return [
            "capabilities.features must be a tuple of FeatureSupport values such as "
            f"(WindowSupport(),), got {type(features).__name__}"
        ]
    problems: list[str] = []
    seen: set[str] = set()
    for n, support in enumerate(features):
        name = _KNOWN.get(type(support))
        if not isinstance(support, FeatureSupport) or name is None:
            known = ", ".join(sorted(cls.__name__ for cls in _KNOWN))
            problems.append(
                f"capabilities.features[{n}] must be one of {known}, got {type(support).__name__}"
            )
            continue
        if name in seen:
            problems.append(f"capabilities.features lists {type(support).__name__} twice")
        seen.add(name)
        problems += [
            f"capabilities.features[{name}].{flag} must be True or False, got {value!r}"
            for flag in _fields_typed(type(support), "bool")
            if not isinstance(value := getattr(support, flag), bool)
        ]
    return problems
