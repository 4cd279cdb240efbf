"""Loads backend plugins from the entry-point group and keeps every failure on record.

pluggy registers and validates the plugins; this module adds what pluggy does not do: each
plugin is imported, validated and called on its own, so one broken plugin is recorded with its
error and never stops the others. The environment's allow and block lists
(`PluginPolicy`) decide which plugins are imported at all.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import pluggy

from ._capabilities import Capabilities
from ._hooks import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, PROJECT_NAME, HookSpecs, PluginManifest
from ._protocol import NoCachePrefill

logger = logging.getLogger("attn_backends")

PLUGINS_ENV = "ATTN_BACKENDS_PLUGINS"
"""Comma list of plugin (entry-point) names allowed to load; unset or blank means all."""
DISABLE_ENV = "ATTN_BACKENDS_DISABLE"
"""Comma list of plugin or backend names switched off."""

PluginStatus = Literal["loaded", "failed", "incompatible", "disabled"]


def _names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


@dataclass(frozen=True)
class PluginPolicy:
    """Which plugins may load and which plugins or backends are off, read from the environment.

    The registry applies it when importing entry points (a plugin that is not allowed is never
    imported); the selector applies it again on every decision, so a backend switched off after
    loading is still refused, with a `ReasonCode.DISABLED` reason in the record.
    """

    allow: frozenset[str] | None = None
    """Plugin names allowed to load (``$ATTN_BACKENDS_PLUGINS``); ``None`` means all."""
    disable: frozenset[str] = frozenset()
    """Plugin or backend names switched off (``$ATTN_BACKENDS_DISABLE``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginPolicy:
        env = os.environ if environ is None else environ
        allow_text = env.get(PLUGINS_ENV, "")
        allow = _names(allow_text) if allow_text.strip() else None
        return cls(allow, _names(env.get(DISABLE_ENV, "")))

    def plugin_refusal(self, plugin: str) -> str | None:
        """Why the plugin may not load, or None."""
        if plugin in self.disable:
            return f"plugin {plugin!r} is listed in ${DISABLE_ENV}"
        if self.allow is not None and plugin not in self.allow:
            allowed = ",".join(sorted(self.allow))
            return f"plugin {plugin!r} is not in ${PLUGINS_ENV}={allowed}"
        return None

    def backend_refusal(self, backend: str, plugin: str) -> str | None:
        """Why the backend may not be selected, or None."""
        if backend in self.disable:
            return f"backend {backend!r} is listed in ${DISABLE_ENV}"
        return self.plugin_refusal(plugin)

    def to_dict(self) -> dict[str, object]:
        return {
            PLUGINS_ENV: sorted(self.allow) if self.allow is not None else None,
            DISABLE_ENV: sorted(self.disable),
        }

    def describe(self) -> str:
        allow = ",".join(sorted(self.allow)) if self.allow is not None else "(all)"
        disable = ",".join(sorted(self.disable)) or "(none)"
        return f"${PLUGINS_ENV}={allow}; ${DISABLE_ENV}={disable}"


@dataclass(frozen=True)
class PluginRecord:
    """The outcome of loading one plugin, kept for ``list`` and ``explain``.

    ``error`` says why a plugin failed, was refused or disabled; on a loaded plugin it lists
    the backends it offered that were refused (e.g. a taken name).
    """

    name: str
    source: str
    status: PluginStatus
    backends: tuple[str, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "source": self.source,
            "status": self.status,
            "backends": list(self.backends),
            "error": self.error,
        }


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend and the plugin it came from; ``order`` breaks priority ties."""

    backend: NoCachePrefill
    plugin: str
    order: int


@dataclass(frozen=True)
class RegistrySnapshot:
    """Entries and records read together under the lock, with the generation they belong to."""

    generation: int
    entries: tuple[BackendEntry, ...]
    records: tuple[PluginRecord, ...]


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


_serials = itertools.count()


@dataclass
class Registry:
    """All backends known to this process. Thread-safe; ``generation`` changes on every edit.

    ``serial`` identifies the registry for the selection cache (an ``id()`` can be reused).
    """

    _pm: pluggy.PluginManager = field(init=False)
    _entries: dict[str, BackendEntry] = field(default_factory=dict, init=False)
    _records: list[PluginRecord] = field(default_factory=list, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False)
    generation: int = field(default=0, init=False)
    serial: int = field(default_factory=lambda: next(_serials), init=False)

    def __post_init__(self) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(HookSpecs)

    def load_entry_points(
        self, group: str = ENTRY_POINT_GROUP, *, policy: PluginPolicy | None = None
    ) -> list[PluginRecord]:
        """Import and register every plugin of the entry-point group, one at a time.

        ``policy`` defaults to `PluginPolicy.from_env`; a plugin it refuses is recorded as
        ``disabled`` and never imported. Returns the records of this call.
        """
        rules = PluginPolicy.from_env() if policy is None else policy
        eps = sorted(
            importlib.metadata.entry_points(group=group),
            key=lambda ep: (ep.dist.name if ep.dist is not None else "", ep.name),
        )
        out: list[PluginRecord] = []
        with self._lock:
            for ep in eps:
                dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown"
                source = f"entry point {ep.name} = {ep.value} ({dist})"
                refusal = rules.plugin_refusal(ep.name)
                if refusal is not None:
                    out.append(
                        self._record(PluginRecord(ep.name, source, "disabled", error=refusal))
                    )
                    continue
                try:
                    plugin = ep.load()
                except (Exception, SystemExit) as exc:
                    logger.warning("backend plugin %s failed to import: %s", ep.name, exc)
                    error = f"import failed: {_short_error(exc)}"
                    out.append(self._record(PluginRecord(ep.name, source, "failed", error=error)))
                    continue
                out.append(self.register_plugin(plugin, name=ep.name, source=source))
        return out

    def register_plugin(
        self, plugin: object, *, name: str, source: str = "in process"
    ) -> PluginRecord:
        """Register one plugin object (a module or an instance with the hook) in isolation."""
        with self._lock:
            if self._pm.has_plugin(name) or self._pm.is_registered(plugin):
                return self._record(
                    PluginRecord(
                        name,
                        source,
                        "failed",
                        error=f"a plugin named {name!r} or this same plugin object is "
                        "already registered",
                    )
                )
            try:
                self._pm.register(plugin, name=name)
                self._pm.check_pending()
            except Exception as exc:
                if self._pm.is_registered(plugin):
                    self._pm.unregister(plugin)
                return self._record(PluginRecord(name, source, "failed", error=_short_error(exc)))
            impls = [
                i
                for i in self._pm.hook.attn_backends_register.get_hookimpls()
                if i.plugin is plugin
            ]
            if not impls:
                self._pm.unregister(plugin)
                return self._record(
                    PluginRecord(
                        name,
                        source,
                        "failed",
                        error="no attn_backends_register hook implementation found "
                        "(decorate it with attn_backends.hookimpl)",
                    )
                )
            status, backends, error = self._call_hook(impls[0], name)
            if status != "loaded":
                self._pm.unregister(plugin)
                logger.warning("backend plugin %s %s: %s", name, status, error)
            return self._record(PluginRecord(name, source, status, backends, error))

    def _call_hook(
        self, impl: pluggy.HookImpl, name: str
    ) -> tuple[PluginStatus, tuple[str, ...], str | None]:
        """Call one hook implementation and register what it offers; never raises."""
        args = {"host_api_version": PLUGIN_API_VERSION}
        try:
            manifest = impl.function(**{a: args[a] for a in impl.argnames})
        except (Exception, SystemExit) as exc:
            return "failed", (), f"hook raised {_short_error(exc)}"
        if not isinstance(manifest, PluginManifest):
            return "failed", (), f"hook returned {type(manifest).__name__}, not a PluginManifest"
        if not isinstance(manifest.api_version, str):
            return "failed", (), f"api_version must be a str such as {PLUGIN_API_VERSION!r}"
        if _major(manifest.api_version) != _major(PLUGIN_API_VERSION):
            return (
                "incompatible",
                (),
                f"built for plugin API {manifest.api_version}, this host speaks "
                f"{PLUGIN_API_VERSION} (major versions differ)",
            )
        try:
            offered = list(manifest.backends)
        except Exception as exc:
            return "failed", (), f"manifest.backends is not a sequence: {_short_error(exc)}"
        added: list[str] = []
        problems: list[str] = []
        for backend in offered:
            ok, text = self._add_backend(backend, name)
            (added if ok else problems).append(text)
        if problems and not added:
            return "failed", (), "; ".join(problems)
        return "loaded", tuple(added), "; ".join(problems) or None

    def _add_backend(self, backend: object, plugin: str) -> tuple[bool, str]:
        """Register one offered backend: ``(True, name)``, or ``(False, why it was refused)``."""
        kind = type(backend).__name__
        try:
            if not isinstance(backend, NoCachePrefill):
                return False, f"{kind} does not implement NoCachePrefill"
            name = backend.name
            caps = backend.capabilities
        except Exception as exc:
            return False, f"{kind} raised while being inspected: {_short_error(exc)}"
        if not isinstance(name, str) or not name.strip():
            return False, f"{kind}.name must be a non-empty str, got {name!r}"
        if not isinstance(caps, Capabilities):
            return False, f"{kind}.capabilities must be a Capabilities, not {type(caps).__name__}"
        taken = self._entries.get(name)
        if taken is not None:
            return False, f"backend name {name!r} is taken by plugin {taken.plugin}"
        self._entries[name] = BackendEntry(backend, plugin, len(self._entries))
        self.generation += 1
        return True, name

    def _record(self, record: PluginRecord) -> PluginRecord:
        with self._lock:
            self._records.append(record)
            self.generation += 1
        return record

    def entries(self) -> list[BackendEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.order)

    def records(self) -> list[PluginRecord]:
        with self._lock:
            return list(self._records)

    def snapshot(self) -> RegistrySnapshot:
        with self._lock:
            return RegistrySnapshot(self.generation, tuple(self.entries()), tuple(self._records))

    def get(self, name: str) -> BackendEntry | None:
        with self._lock:
            return self._entries.get(name)


_default: Registry | None = None
_default_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _default
    with _default_lock:
        if _default is None:
            registry = Registry()
            registry.load_entry_points()
            _default = registry
        return _default


def reset_registry(registry: Registry | None = None) -> None:
    """Replace the process-wide registry (tests, or an engine that manages plugins itself).

    ``None`` makes the next `get_registry` load the entry points again, under the environment
    of that moment.
    """
    global _default
    with _default_lock:
        _default = registry
