"""The plugin hook. Built-in and third-party backends register through the same one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pluggy

from .._backend._protocol import NoCachePrefill
from .._path._rope_passes import RopePass

PROJECT_NAME = "attn_backends"
ENTRY_POINT_GROUP = "attn_backends"
BUILTIN_DISTRIBUTION = "attn-backends"
"""This library's distribution (canonical name); its entry points into `BUILTIN_PACKAGE` are
the built-in plugins, which load first and whose names no other plugin may take."""
BUILTIN_PACKAGE = "attn_backends_builtin"
PLUGIN_API_VERSION = "1.0"
"""Version of the plugin API (hook + protocol + contract). A plugin built for another major
version is refused."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class PluginManifest:
    """What a plugin's hook returns: the API version it was built for, its backends, and the
    separate RoPE/logn passes it brings (`RopePass`).

    The passes are checked with the plugin and installed only if it loads; they leave with it
    (a registry replaced by ``reset_registry()`` included), so a plugin that fails leaves none
    behind. Any backend may then be served by them, ranked per platform like the core's.
    """

    api_version: str
    backends: Sequence[NoCachePrefill]
    rope_passes: Sequence[RopePass] = ()


class HookSpecs:
    """Hook specifications; pluggy validates every plugin against them."""

    @hookspec
    def attn_backends_register(self, host_api_version: str) -> PluginManifest:  # type: ignore[empty-body]
        """Return the backends this plugin provides.

        ``host_api_version`` is this library's `PLUGIN_API_VERSION`; a plugin may use it to
        adapt, and must state its own in the manifest.
        """
