"""The plugin hook. Built-in and third-party backends register through the same one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pluggy

from .._backend._protocol import BackendClass
from .._path._rope_passes import RopePass
from .._values._platform import PlatformKind

PROJECT_NAME = "attn_backends"
ENTRY_POINT_GROUP = "attn_backends"
BUILTIN_DISTRIBUTION = "attn-backends"
"""This library's distribution (canonical name); its entry points into `BUILTIN_PACKAGE` are
the built-in plugins, which load first and whose names no other plugin may take."""
BUILTIN_PACKAGE = "attn_backends_builtin"
PLUGIN_API_VERSION = "2.0"
"""Version of the plugin API (hook + protocol + contract). A plugin built for another major
version is refused with a reason naming the version it needs. 2.0: backends are registered as
classes and placed with `Placement` (1.0 registered instances that carried priority scores)."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class Placement:
    """Where a plugin's backend stands in selection: right before or right after a named one.

    The named backend's place is the ranking table's (`attn_backends explain` shows the rows),
    so a plugin's backend is considered only for requests that backend is considered for: it
    can never take over specs nobody asked it to serve. ``platform`` narrows it to one kind of
    machine. A backend without a `Placement` runs only when chosen by name.
    """

    backend: str
    before: str | None = None
    after: str | None = None
    platform: PlatformKind | None = None
    note: str = ""
    """Why it stands there (a measurement, a policy); shown by ``explain``."""

    @property
    def anchor(self) -> str:
        """The backend it is placed next to."""
        return self.before if self.before is not None else str(self.after)

    def describe(self) -> str:
        where = f"before {self.before}" if self.before is not None else f"after {self.after}"
        on = f" on {self.platform}" if self.platform is not None else ""
        text = f"{self.backend} {where}{on}"
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class PluginManifest:
    """What a plugin's hook returns: the API version it was built for, its backend classes,
    where they stand in selection (`Placement`), and the separate RoPE/logn passes it brings
    (`RopePass`).

    The passes are checked with the plugin and installed only if it loads; they leave with it
    (a registry replaced by ``reset_registry()`` included), so a plugin that fails leaves none
    behind. Any backend may then be served by them, ranked per platform like the core's.
    """

    api_version: str
    backends: Sequence[BackendClass]
    placements: Sequence[Placement] = ()
    rope_passes: Sequence[RopePass] = ()


class HookSpecs:
    """Hook specifications; pluggy validates every plugin against them."""

    @hookspec
    def attn_backends_register(self, host_api_version: str) -> PluginManifest:  # type: ignore[empty-body]
        """Return the backends this plugin provides.

        ``host_api_version`` is this library's `PLUGIN_API_VERSION`; a plugin may use it to
        adapt, and must state its own in the manifest.
        """
