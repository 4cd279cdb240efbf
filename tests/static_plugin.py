"""An in-process plugin object for tests that register backends with `Registry.register_plugin`
instead of installing a distribution (see ``tests/plugin_site.py`` for that)."""

from __future__ import annotations

from collections.abc import Sequence

import attn_backends.plugin as abp


class StaticPlugin:
    """Registers the given backend classes, with their placements, at the host's API version.

    ``first_on``: a platform kind on which each backend stands right before ``torch-sdpa``
    (the one built-in every test registry holds), the usual way a test backend wins.
    """

    def __init__(
        self,
        *backends: object,
        placements: Sequence[abp.Placement] = (),
        first_on: str | None = None,
    ) -> None:
        self.backends = backends
        placed = [
            abp.Placement(str(getattr(b, "name", "")), before="torch-sdpa", platform=first_on)  # type: ignore[arg-type]
            for b in (backends if first_on is not None else ())
        ]  # names read only when asked for: a test backend's name may raise on purpose
        self.placements = (*placements, *placed)

    @abp.hookimpl
    def attn_backends_register(self, host_api_version: str) -> abp.PluginManifest:
        return abp.PluginManifest(
            api_version=abp.PLUGIN_API_VERSION,
            backends=list(self.backends),  # type: ignore[arg-type]
            placements=list(self.placements),
        )
