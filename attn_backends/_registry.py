"""Loads backend plugins from the entry-point group and keeps every failure on record.

pluggy registers and validates the plugins; this module adds what pluggy does not do: each
plugin is imported, validated and called on its own, so one broken plugin is recorded with its
error and never stops the others.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from dataclasses import dataclass, field
from typing import Literal

import pluggy

from ._hooks import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, PROJECT_NAME, HookSpecs, PluginManifest
from ._protocol import NoCachePrefill

logger = logging.getLogger("attn_backends")

PluginStatus = Literal["loaded", "failed", "incompatible"]


@dataclass(frozen=True)
class PluginRecord:
    """The outcome of loading one plugin, kept for ``list`` and ``explain``."""

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


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Registry:
    """All backends known to this process. Thread-safe; ``generation`` changes on every edit."""

    _pm: pluggy.PluginManager = field(init=False)
    _entries: dict[str, BackendEntry] = field(default_factory=dict, init=False)
    _records: list[PluginRecord] = field(default_factory=list, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False)
    generation: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(HookSpecs)

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Import and register every plugin of the entry-point group, one at a time."""
        eps = sorted(
            importlib.metadata.entry_points(group=group),
            key=lambda ep: (ep.dist.name if ep.dist is not None else "", ep.name),
        )
        for ep in eps:
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown dist"
            source = f"entry point {ep.name} = {ep.value} ({dist})"
            try:
                plugin = ep.load()
            except Exception as exc:
                logger.warning("backend plugin %s failed to import: %s", ep.name, exc)
                self._record(PluginRecord(ep.name, source, "failed", error=_short_error(exc)))
                continue
            self.register_plugin(plugin, name=ep.name, source=source)

    def register_plugin(self, plugin: object, *, name: str, source: str = "in process") -> PluginRecord:
        """Register one plugin object (a module or an instance with the hook) in isolation."""
        with self._lock:
            try:
                self._pm.register(plugin, name=name)
                self._pm.check_pending()
            except Exception as exc:
                if self._pm.is_registered(plugin):
                    self._pm.unregister(plugin)
                return self._record(PluginRecord(name, source, "failed", error=_short_error(exc)))
            impl = next(
                (i for i in self._pm.hook.attn_backends_register.get_hookimpls() if i.plugin is plugin),
                None,
            )
            if impl is None:
                self._pm.unregister(plugin)
                return self._record(
                    PluginRecord(name, source, "failed",
                                 error="no attn_backends_register hook implementation found")
                )
            backends: list[str] = []
            problems: list[str] = []
            failure = self._call_hook(impl, name, backends, problems)
            if failure is not None:
                self._pm.unregister(plugin)
                return self._record(PluginRecord(name, source, *failure))
            if problems and not backends:
                self._pm.unregister(plugin)
                return self._record(PluginRecord(name, source, "failed", error="; ".join(problems)))
            error = "; ".join(problems) if problems else None
            return self._record(PluginRecord(name, source, "loaded", tuple(backends), error))

    def _call_hook(
        self, impl: pluggy.HookImpl, name: str, backends: list[str], problems: list[str]
    ) -> tuple[PluginStatus, tuple[str, ...], str] | None:
        """Call one hook implementation; a fatal failure is returned, per-backend ones noted."""
        args = {"host_api_version": PLUGIN_API_VERSION}
        try:
            manifest = impl.function(**{a: args[a] for a in impl.argnames})
        except Exception as exc:
            logger.warning("backend plugin %s raised in its hook: %s", name, exc)
            return ("failed", (), f"hook raised {_short_error(exc)}")
        if not isinstance(manifest, PluginManifest):
            return ("failed", (), f"hook returned {type(manifest).__name__}, not a PluginManifest")
        if _major(manifest.api_version) != _major(PLUGIN_API_VERSION):
            return (
                "incompatible",
                (),
                f"built for plugin API {manifest.api_version}, this host speaks "
                f"{PLUGIN_API_VERSION} (major versions differ)",
            )
        for backend in manifest.backends:
            if not isinstance(backend, NoCachePrefill):
                problems.append(f"{type(backend).__name__} does not implement NoCachePrefill")
                continue
            taken = self._entries.get(backend.name)
            if taken is not None:
                problems.append(f"backend name {backend.name!r} is taken by plugin {taken.plugin}")
                continue
            self._entries[backend.name] = BackendEntry(backend, name, len(self._entries))
            backends.append(backend.name)
            self.generation += 1
        return None

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
    """Replace the process-wide registry (tests, or an engine that manages plugins itself)."""
    global _default
    with _default_lock:
        _default = registry
