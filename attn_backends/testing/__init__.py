"""The conformance suite every backend runs: cases derived from declared capabilities, each
checked against the float64 reference. Use it as a pytest plugin (``pytest --attn-backend
NAME``) or subclass `NoCachePrefillConformance` in your own tests."""

from __future__ import annotations

from .cases import ConformanceCase, RefusalCase, conformance_cases, refusal_cases
from .suite import NoCachePrefillConformance, make_qkv, run_case

__all__ = [
    "ConformanceCase",
    "NoCachePrefillConformance",
    "RefusalCase",
    "conformance_cases",
    "make_qkv",
    "refusal_cases",
    "run_case",
]
