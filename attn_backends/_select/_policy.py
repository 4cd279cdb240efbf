"""The environment's allow and block lists for plugins and backends.

A plugin (an entry-point name) and a backend (a ``NoCachePrefill.name``) often share a name
(``torch-sdpa`` is both), so a plain name in ``$ATTN_BACKENDS_DISABLE`` switches off either;
``plugin:NAME`` and ``backend:NAME`` say which one is meant. A name that matches nothing is
almost always a typo, so `PluginPolicy.unmatched` reports it for a warning and the record.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

PLUGINS_ENV = "ATTN_BACKENDS_PLUGINS"
"""Comma list of plugin (entry-point) names allowed to load; unset or blank means all."""
DISABLE_ENV = "ATTN_BACKENDS_DISABLE"
"""Comma list of names switched off: ``NAME`` (a plugin or a backend), ``plugin:NAME``,
``backend:NAME``."""

PLUGIN_PREFIX = "plugin:"
BACKEND_PREFIX = "backend:"

Kind = Literal["plugin", "backend", "either"]


def _names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def _target(token: str) -> tuple[Kind, str]:
    """What a listed token names: ``plugin:x`` a plugin, ``backend:x`` a backend, ``x`` either."""
    if token.startswith(PLUGIN_PREFIX):
        return "plugin", token[len(PLUGIN_PREFIX) :].strip()
    if token.startswith(BACKEND_PREFIX):
        return "backend", token[len(BACKEND_PREFIX) :].strip()
    return "either", token


@dataclass(frozen=True)
class PluginPolicy:
    """Which plugins may load and which plugins or backends are off, read from the environment.

    The registry applies it when importing entry points (a plugin that is not allowed is never
    imported); the selector applies it again on every decision, so a backend switched off after
    loading is still refused, with a `ReasonCode.DISABLED` reason in the record.
    """

    allow: frozenset[str] | None = None
    """Plugin names allowed to load (``$ATTN_BACKENDS_PLUGINS``, ``plugin:`` prefix optional);
    ``None`` means all."""
    disable: frozenset[str] = frozenset()
    """Names switched off as listed (``$ATTN_BACKENDS_DISABLE``): plain, ``plugin:`` or
    ``backend:``."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginPolicy:
        env = os.environ if environ is None else environ
        allow_text = env.get(PLUGINS_ENV, "")
        allow = _names(allow_text) if allow_text.strip() else None
        return cls(allow, _names(env.get(DISABLE_ENV, "")))

    def _disabled(self, kind: Literal["plugin", "backend"], name: str) -> bool:
        return any(_target(token) in ((kind, name), ("either", name)) for token in self.disable)

    def _allowed(self, plugin: str) -> bool:
        if self.allow is None:
            return True
        return any(
            _target(token) in (("plugin", plugin), ("either", plugin)) for token in self.allow
        )

    def plugin_refusal(self, plugin: str) -> str | None:
        """Why the plugin may not load, or None."""
        if self._disabled("plugin", plugin):
            return f"plugin {plugin!r} is listed in ${DISABLE_ENV}"
        if self.allow is not None and not self._allowed(plugin):
            allowed = ",".join(sorted(self.allow))
            return f"plugin {plugin!r} is not in ${PLUGINS_ENV}={allowed}"
        return None

    def backend_refusal(self, backend: str, plugin: str) -> str | None:
        """Why the backend may not be selected, or None."""
        if self._disabled("backend", backend):
            return f"backend {backend!r} is listed in ${DISABLE_ENV}"
        return self.plugin_refusal(plugin)

    def unmatched(self, plugins: Iterable[str], backends: Iterable[str]) -> tuple[str, ...]:
        """Listed names (as written) that match no known plugin or registered backend."""
        known_plugins = frozenset(plugins)
        known_backends = frozenset(backends)

        def matches(token: str, allow_list: bool) -> bool:
            kind, name = _target(token)
            if kind == "plugin" or (allow_list and kind == "either"):
                return name in known_plugins
            if kind == "backend":
                return not allow_list and name in known_backends
            return name in known_plugins or name in known_backends

        listed = [(t, False) for t in self.disable] + [(t, True) for t in self.allow or ()]
        return tuple(sorted({token for token, allow in listed if not matches(token, allow)}))

    def to_dict(self) -> dict[str, object]:
        return {
            PLUGINS_ENV: sorted(self.allow) if self.allow is not None else None,
            DISABLE_ENV: sorted(self.disable),
        }

    def describe(self) -> str:
        allow = ",".join(sorted(self.allow)) if self.allow is not None else "(all)"
        disable = ",".join(sorted(self.disable)) or "(none)"
        return f"${PLUGINS_ENV}={allow}; ${DISABLE_ENV}={disable}"
