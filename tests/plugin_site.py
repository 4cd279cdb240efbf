"""A throw-away site directory holding plugin distributions, as pip would leave them.

Tests write real ``*.dist-info`` metadata (``METADATA`` + ``entry_points.txt``) and plugin
modules into a tmp directory on ``sys.path``, so `Registry.load_entry_points` discovers them
through `importlib.metadata` exactly as it discovers an installed wheel; nothing calls
``register_plugin`` by hand.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from attn_backends.plugin import ENTRY_POINT_GROUP


class PluginSite:
    """One tmp site directory; modules it wrote are dropped from ``sys.modules`` afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def add_module(self, name: str, source: str) -> None:
        """Write ``name.py`` (dedented ``source``) into the site."""
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        self.modules.append(name)

    def add_dist(
        self,
        dist: str,
        entry_points: Mapping[str, str],
        version: str = "1.0",
        path: Path | None = None,
    ) -> Path:
        """Write ``<dist>-<version>.dist-info`` with the entry points of our group."""
        info = (path or self.root) / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
        return info

    def forget(self) -> None:
        for name in self.modules:
            sys.modules.pop(name, None)


def open_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSite]:
    """Body of a ``site`` fixture: a `PluginSite` on ``sys.path`` for one test."""
    site = PluginSite(tmp_path / "site")
    site.root.mkdir()
    monkeypatch.syspath_prepend(str(site.root))
    yield site
    site.forget()
