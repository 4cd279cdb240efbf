"""The ranking table decides every built-in selection: for every conformance case of every
built-in backend, on every platform the built-ins serve, the winner is the backend of the first
row (read top to bottom) whose condition holds and whose backend accepts the spec, and the
record names that row. The expected winner is read from the table here, independently of the
selector's own walk."""

from __future__ import annotations

import pytest

import attn_backends as ab
import attn_backends.deploy
from attn_backends._select._ranking import RANKING, Row
from attn_backends.testing.cases import conformance_cases

PLATFORMS = (
    "cpu",
    "cuda:sm75",
    "cuda:sm80",
    "cuda:sm90",
    "cuda:sm100",
    "rocm:gfx90a",
    "rocm:gfx942",
    "rocm:gfx950",
)


def _builtins() -> dict[str, ab.deploy.BackendEntry]:
    entries = {e.name: e for e in ab.deploy.get_registry().entries() if e.builtin}
    assert {"torch-sdpa", "flashinfer", "flex", "aiter-asm"} <= set(entries)
    return entries


def _specs() -> list[ab.AttentionSpec]:
    """Every spec the built-ins' conformance cases make, once each."""
    seen: dict[str, ab.AttentionSpec] = {}
    for entry in _builtins().values():
        for case in conformance_cases(entry.capabilities):
            seen.setdefault(repr(case.spec), case.spec)
    return list(seen.values())


def _expected(spec: ab.AttentionSpec, platform: ab.Platform) -> tuple[str, int] | None:
    """The table read by hand: the first holding row whose backend accepts the spec."""
    entries = _builtins()
    for n, row in enumerate(RANKING, start=1):
        entry = entries.get(row.backend)
        if entry is None or not row.holds(spec, platform):
            continue
        if not entry.backend.supports(spec, platform):
            return row.backend, n
    return None


@pytest.mark.parametrize("where", PLATFORMS)
def test_every_builtin_selection_of_the_conformance_cases_is_a_row_of_the_table(
    where: str,
) -> None:
    platform = ab.parse_platform(where)
    decided = 0
    for spec in _specs():
        expected = _expected(spec, platform)
        if expected is None:
            with pytest.raises(ab.NoBackendError):
                ab.select(spec, platform=platform)
            continue
        name, row = expected
        sel = ab.select(spec, platform=platform)
        assert sel.name == name, (spec, where)
        chosen = next(c for c in sel.candidates if c.verdict == "selected")
        assert chosen.placed_by is not None and chosen.placed_by.startswith(f"row {row}: ")
        assert f"decided by: row {row}: {name} on " in sel.explain()
        decided += 1
    assert decided > 0, f"no conformance case was served on {where}"


def test_every_row_names_a_builtin_backend_and_no_row_repeats_itself() -> None:
    names = set(_builtins())
    assert {row.backend for row in RANKING} <= names
    keys = [(r.backend, r.platform, r.min_sm, r.max_sm, r.rope_fusable, r.masked) for r in RANKING]
    assert len(keys) == len(set(keys))
    assert all(isinstance(row, Row) and row.why for row in RANKING), "every row says why"


def test_backends_without_a_row_run_only_when_named() -> None:
    spec = ab.PRESETS["bert-base"]
    sm90 = ab.parse_platform("cuda:sm90")
    sel = ab.select(spec, platform=sm90)
    verdicts = {c.name: c.verdict for c in sel.candidates}
    assert verdicts["fa4"] == verdicts["headwise"] == "not ranked"
    assert ab.select(spec, platform=sm90, backend="fa4").name == "fa4"
