"""An in-process plugin object for tests that register backends with `Registry.register_plugin`
instead of installing a distribution (see ``tests/plugin_site.py`` for that)."""

from __future__ import annotations

import attn_backends as ab
import attn_backends.plugin as abp


class StaticPlugin:
    """Registers the given backend instances, at API version 1.0."""

    def __init__(self, *backends: ab.NoCachePrefill) -> None:
        self.backends = backends

    @abp.hookimpl
    def attn_backends_register(self, host_api_version: str) -> abp.PluginManifest:
        return abp.PluginManifest(api_version="1.0", backends=list(self.backends))
