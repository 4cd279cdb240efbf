"""JSON output of ``attn-backends``: the library's one convention (`_json`), named for the CLI."""

from __future__ import annotations

from .._model._json import NOT_FINITE_SUFFIX, dumps, json_safe

__all__ = ["NOT_FINITE_SUFFIX", "dumps", "json_safe"]
