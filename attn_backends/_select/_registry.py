"""Loads backend plugins from the entry-point group and keeps every failure on record.

pluggy validates each plugin against the hook specification; this module adds what pluggy does
not do. Each plugin's code (import, hook, the ``name`` and ``capabilities`` of its backends)
runs on its own through `call_plugin_code`: bounded in time, with anything it raises or a call
back into the registry recorded against that plugin alone. Declarations are read and checked
once, here, so the selector never meets a malformed one. The built-in plugins load first and
their names are reserved, so no installed distribution can stand in for them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import logging
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import pluggy

from .._backend._capabilities import Capabilities
from .._backend._protocol import BackendClass
from .._backend._validation import capability_problems, name_problem
from .._path._rope_passes import (
    RopePass,
    collecting,
    install,
    rope_pass_problems,
    withdraw,
    withdraw_registry,
)
from .._values._errors import PluginLoadError
from .._values._platform import PLATFORM_KINDS, clear_required_libraries, note_required_libraries
from ._hooks import (
    BUILTIN_DISTRIBUTION,
    BUILTIN_PACKAGE,
    ENTRY_POINT_GROUP,
    PLUGIN_API_VERSION,
    PROJECT_NAME,
    HookSpecs,
    Placement,
    PluginManifest,
)
from ._isolation import (
    PLUGIN_TIMEOUT_ENV,
    call_plugin_code,
    check_timeout,
    describe_exception,
    refuse_reentry,
    timeout_from_env,
)
from ._policy import DISABLE_ENV, PLUGINS_ENV, PluginPolicy

__all__ = [
    "DISABLE_ENV",
    "PLUGINS_ENV",
    "PLUGIN_TIMEOUT_ENV",
    "BackendEntry",
    "PluginPolicy",
    "PluginRecord",
    "PluginStatus",
    "Registry",
    "RegistrySnapshot",
    "get_registry",
    "reset_registry",
]

logger = logging.getLogger("attn_backends")

PluginStatus = Literal["loaded", "failed", "incompatible", "disabled"]
IN_PROCESS = "in process"


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
    rope_passes: tuple[str, ...] = ()
    """Names of the RoPE passes the plugin brought (installed while it stays loaded)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "source": self.source,
            "status": self.status,
            "backends": list(self.backends),
            "error": self.error,
            "rope_passes": list(self.rope_passes),
        }


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend, with its name and capabilities as read (once) at registration.

    The selector uses ``name`` and ``capabilities`` from here, never the backend's properties
    again, so a backend cannot rename itself or change its declarations after the checks.
    """

    name: str
    backend: BackendClass
    """The registered class: ``supports`` judges it, calling it binds it."""
    capabilities: Capabilities
    plugin: str
    order: int
    """Registration order: backends placed next to the same one go in this order."""
    origin: str = IN_PROCESS
    """Distribution and version the plugin came from (``attn-backends 0.1.0``), or in process."""
    builtin: bool = False
    placements: tuple[Placement, ...] = ()
    """Where the plugin placed this backend (a built-in is placed by the ranking table)."""


@dataclass(frozen=True)
class RegistrySnapshot:
    """Entries and records read together under the lock, with the generation they belong to."""

    generation: int
    entries: tuple[BackendEntry, ...]
    records: tuple[PluginRecord, ...]

    def required_libraries(self) -> tuple[str, ...]:
        """Every library some registered backend ``requires``; the platform probes these."""
        return tuple(sorted({lib for e in self.entries for lib in e.capabilities.requires}))


def _major(version: str) -> str:
    return version.split(".", 1)[0]


_MIGRATION = (
    "plugin API 2.0 registers backend classes (PluginManifest(backends=[MyBackend])), makes "
    "supports() and extra_reasons() classmethods, and places a backend with "
    "PluginManifest(placements=[Placement('my-backend', before='flashinfer')]) instead of "
    "Capabilities(priority=...) scores; see docs/plugin-guide.md"
)


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
    """Shipped by this library: its own distribution, pointing into its built-in package."""
    if ep.dist is None or _canonical(ep.dist.name) != BUILTIN_DISTRIBUTION:
        return False
    return ep.module == BUILTIN_PACKAGE or ep.module.startswith(BUILTIN_PACKAGE + ".")


@dataclass(frozen=True)
class _Offer:
    """One backend a plugin offered, with what was read from it once, already checked."""

    name: str
    backend: BackendClass
    capabilities: Capabilities
    placements: tuple[Placement, ...] = ()


@dataclass(frozen=True)
class _Inspection:
    """What a plugin's hook gave, as judged in the plugin thread."""

    status: PluginStatus
    offers: tuple[_Offer, ...] = ()
    problems: tuple[str, ...] = ()
    rope_passes: tuple[RopePass, ...] = ()
    """Checked passes: the manifest's, and any given to ``register_rope_pass`` meanwhile."""


def _offer(backend: object) -> _Offer | str:
    """Read one offered class's name and capabilities once and check them (plugin thread)."""
    if not isinstance(backend, type):
        kind = type(backend).__name__
        return (
            f"offered an instance of {kind}; plugin API {PLUGIN_API_VERSION} registers backend "
            f"classes: list {kind} itself"
        )
    kind = backend.__name__
    declared: Any = backend  # a plugin's class: its declarations are checked below
    try:
        name: object = declared.name
        caps: object = declared.capabilities
        judge: object = declared.supports
    except AttributeError as exc:
        if exc.obj is not backend:  # raised inside a declaration, not a missing one
            return f"{kind} raised while being inspected: {describe_exception(exc)}"
        return (
            f"{kind} is not a backend class: it has no {exc.name} (subclass "
            "attn_backends.plugin.PrefillBackend)"
        )
    except Exception as exc:
        return f"{kind} raised while being inspected: {describe_exception(exc)}"
    problem = name_problem(name)
    if problem is not None:
        return f"{kind}.{problem}"
    if not callable(judge):
        return f"{kind}.supports must be a classmethod (spec, platform) -> list[Reason]"
    problems = capability_problems(caps)
    if problems or not isinstance(name, str) or not isinstance(caps, Capabilities):
        return f"backend {name!r} ({kind}) refused: " + "; ".join(problems)
    return _Offer(name, cast(BackendClass, backend), caps)


def _placement_problem(placement: object, offered: frozenset[str]) -> str | None:
    """Why a manifest's placement cannot be used, or None."""
    if not isinstance(placement, Placement):
        return f"placements must hold Placement values, got {type(placement).__name__}"
    if placement.backend not in offered:
        return (
            f"{placement.describe()}: {placement.backend!r} is not a backend this plugin registers"
        )
    if (placement.before is None) == (placement.after is None):
        return f"Placement({placement.backend!r}) needs exactly one of before= and after="
    problem = name_problem(placement.anchor)
    if problem is not None:
        return f"{placement.describe()}: the backend it is placed next to: {problem}"
    if placement.anchor == placement.backend:
        return f"{placement.describe()}: a backend cannot be placed next to itself"
    if placement.platform is not None and placement.platform not in PLATFORM_KINDS:
        return (
            f"{placement.describe()}: platform must be one of {', '.join(PLATFORM_KINDS)} or None"
        )
    if not isinstance(placement.note, str):
        return f"Placement({placement.backend!r}).note must be a str"
    return None


def _placed(offers: list[_Offer], declared: list[object]) -> tuple[list[_Offer], list[str]]:
    """The offers with their checked placements attached, and the problems of the refused ones
    (a malformed placement leaves its backend chosen by name only, never the plugin refused)."""
    offered = frozenset(o.name for o in offers)
    problems: list[str] = []
    placements: dict[str, list[Placement]] = {}
    for placement in declared:
        problem = _placement_problem(placement, offered)
        if problem is not None:
            problems.append(f"placement refused: {problem}")
        elif isinstance(placement, Placement):
            placements.setdefault(placement.backend, []).append(placement)
    out = [
        _Offer(o.name, o.backend, o.capabilities, tuple(placements.get(o.name, ()))) for o in offers
    ]
    return out, problems


def _rope_passes_of(manifest: PluginManifest, given: tuple[RopePass, ...]) -> list[RopePass] | str:
    """The plugin's passes (manifest first, then those given to ``register_rope_pass``), or
    why they cannot be installed: one malformed pass refuses the plugin, never the table."""
    try:
        declared: list[object] = list(manifest.rope_passes)
    except Exception as exc:
        return f"manifest.rope_passes is not a sequence: {describe_exception(exc)}"
    passes: list[RopePass] = []
    problems: list[str] = []
    for candidate in [*declared, *given]:
        found = rope_pass_problems(candidate)
        if found:
            problems.extend(found)
        elif isinstance(candidate, RopePass) and candidate not in passes:
            passes.append(candidate)
    return "; ".join(problems) if problems else passes


def _inspect(plugin: object, name: str, early: tuple[RopePass, ...] = ()) -> _Inspection:
    """Validate the plugin with a private pluggy manager, call its hook, check the manifest.

    ``early`` are the passes the plugin gave ``register_rope_pass`` at import. Runs in the
    plugin thread: it touches no shared state, so a plugin that hangs here and finishes later
    changes nothing.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(HookSpecs)
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except Exception as exc:
        return _Inspection("failed", problems=(describe_exception(exc),))
    impls = [i for i in pm.hook.attn_backends_register.get_hookimpls() if i.plugin is plugin]
    if not impls:
        return _Inspection(
            "failed",
            problems=(
                "no attn_backends_register hook implementation found "
                "(decorate it with attn_backends.plugin.hookimpl)",
            ),
        )
    impl = impls[0]
    args = {"host_api_version": PLUGIN_API_VERSION}
    try:
        manifest, given = collecting(lambda: impl.function(**{a: args[a] for a in impl.argnames}))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plugin may raise anything; it is recorded
        return _Inspection("failed", problems=(f"hook raised {describe_exception(exc)}",))
    if not isinstance(manifest, PluginManifest):
        return _Inspection(
            "failed", problems=(f"hook returned {type(manifest).__name__}, not a PluginManifest",)
        )
    if not isinstance(manifest.api_version, str):
        return _Inspection(
            "failed", problems=(f"api_version must be a str such as {PLUGIN_API_VERSION!r}",)
        )
    if _major(manifest.api_version) != _major(PLUGIN_API_VERSION):
        return _Inspection(
            "incompatible",
            problems=(
                f"built for plugin API {manifest.api_version}, this host needs plugin API "
                f"{PLUGIN_API_VERSION} (major versions differ): {_MIGRATION}",
            ),
        )
    try:
        offered = list(manifest.backends)
    except Exception as exc:
        return _Inspection(
            "failed",
            problems=(f"manifest.backends is not a sequence: {describe_exception(exc)}",),
        )
    passes = _rope_passes_of(manifest, (*early, *given))
    if isinstance(passes, str):
        return _Inspection("failed", problems=(f"refused: {passes}",))
    try:
        declared: list[object] = list(manifest.placements)
    except Exception as exc:
        return _Inspection(
            "failed",
            problems=(f"manifest.placements is not a sequence: {describe_exception(exc)}",),
        )
    judged = [_offer(backend) for backend in offered]
    offers, problems = _placed([o for o in judged if isinstance(o, _Offer)], declared)
    problems = [o for o in judged if isinstance(o, str)] + problems
    return _Inspection("loaded", tuple(offers), tuple(problems), tuple(passes))


@dataclass(frozen=True)
class _State:
    """A copy of a registry's contents, to undo an interrupted load."""

    entries: dict[str, BackendEntry]
    records: list[PluginRecord]
    plugins: dict[str, object]
    reserved: set[str]
    next_order: int


_serials = itertools.count()


@dataclass
class Registry:
    """All backends known to this process. Thread-safe; ``generation`` changes on every edit.

    ``serial`` identifies the registry for the selection cache (an ``id()`` can be reused).
    ``plugin_timeout`` bounds each step of loading one plugin, in seconds (``None``:
    ``$ATTN_BACKENDS_PLUGIN_TIMEOUT``, else 10).
    """

    plugin_timeout: float | None = None
    _entries: dict[str, BackendEntry] = field(default_factory=dict, init=False)
    _records: list[PluginRecord] = field(default_factory=list, init=False)
    _plugins: dict[str, object] = field(default_factory=dict, init=False)
    """Loaded plugins by name, to refuse the same name or object twice."""
    _reserved: set[str] = field(default_factory=set, init=False)
    """Names kept for built-in plugins (their entry-point names), even when they did not load."""
    _next_order: int = field(default=0, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False)
    generation: int = field(default=0, init=False)
    serial: int = field(default_factory=lambda: next(_serials), init=False)

    def __post_init__(self) -> None:
        if self.plugin_timeout is not None:
            self.plugin_timeout = check_timeout(self.plugin_timeout)
        # the RoPE passes its plugins brought leave with a registry nobody holds any more
        weakref.finalize(self, withdraw_registry, self.serial)

    def _timeout(self) -> float:
        return self.plugin_timeout if self.plugin_timeout is not None else timeout_from_env()

    def load_entry_points(
        self, group: str = ENTRY_POINT_GROUP, *, policy: PluginPolicy | None = None
    ) -> list[PluginRecord]:
        """Import and register every plugin of the entry-point group, one at a time.

        Built-in plugins load first, whatever their names, and keep their names. ``policy``
        defaults to `PluginPolicy.from_env`; a plugin it refuses is recorded as ``disabled`` and
        never imported. Returns the records of this call. A `KeyboardInterrupt` raised while a
        plugin loads undoes this call and propagates: the registry is as it was, and loading
        can be tried again.
        """
        refuse_reentry("Registry.load_entry_points()")
        rules = PluginPolicy.from_env() if policy is None else policy
        eps = sorted(
            importlib.metadata.entry_points(group=group),
            key=lambda ep: (
                not _is_builtin(ep),
                ep.dist.name if ep.dist is not None else "",
                ep.name,
            ),
        )
        timeout = self._timeout()
        with self._lock:
            saved = self._saved()
            try:
                return self._load_all(eps, rules, timeout)
            except KeyboardInterrupt:
                self._restore(saved)
                raise

    def _load_all(
        self,
        eps: list[importlib.metadata.EntryPoint],
        rules: PluginPolicy,
        timeout: float,
    ) -> list[PluginRecord]:
        self._reserved.update(ep.name for ep in eps if _is_builtin(ep))
        out: list[PluginRecord] = []
        for ep in eps:
            builtin = _is_builtin(ep)
            origin = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "unknown"
            source = f"entry point {ep.name} = {ep.value} ({origin})"
            refusal = rules.plugin_refusal(ep.name)
            if refusal is not None:
                out.append(self._record(PluginRecord(ep.name, source, "disabled", error=refusal)))
                continue
            try:
                plugin, early = call_plugin_code(
                    functools.partial(collecting, ep.load),
                    timeout=timeout,
                    what=f"import of {ep.value}",
                )
            except PluginLoadError as exc:
                logger.warning("backend plugin %s failed to import: %s", ep.name, exc)
                error = f"import failed: {exc}"
                out.append(self._record(PluginRecord(ep.name, source, "failed", error=error)))
                continue
            out.append(self._register(plugin, ep.name, source, origin, builtin, timeout, early))
        return out

    def _saved(self) -> _State:
        return _State(
            dict(self._entries),
            list(self._records),
            dict(self._plugins),
            set(self._reserved),
            self._next_order,
        )

    def _restore(self, state: _State) -> None:
        for name in set(self._plugins) - set(state.plugins):
            withdraw((self.serial, name))
        self._entries = dict(state.entries)
        self._records = list(state.records)
        self._plugins = dict(state.plugins)
        self._reserved = set(state.reserved)
        self._next_order = state.next_order
        self.generation += 1

    def register_plugin(
        self, plugin: object, *, name: str, source: str = IN_PROCESS
    ) -> PluginRecord:
        """Register one plugin object (a module or an instance with the hook) in isolation."""
        refuse_reentry("Registry.register_plugin()")
        with self._lock:
            return self._register(plugin, name, source, IN_PROCESS, False, self._timeout())

    def _register(
        self,
        plugin: object,
        name: str,
        source: str,
        origin: str,
        builtin: bool,
        timeout: float,
        early: tuple[RopePass, ...] = (),
    ) -> PluginRecord:
        if name in self._plugins or any(p is plugin for p in self._plugins.values()):
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
            found = call_plugin_code(
                lambda: _inspect(plugin, name, early),
                timeout=timeout,
                what=f"hook of plugin {name}",
            )
        except PluginLoadError as exc:
            found = _Inspection("failed", problems=(str(exc),))
        owner = (self.serial, name)
        if found.status == "loaded":
            taken = install(owner, found.rope_passes)
            if taken is not None:
                found = _Inspection("failed", problems=(f"refused: {taken}",))
        added: list[str] = []
        problems = list(found.problems)
        for offer in found.offers:
            refusal = self._claim_name(offer.name, builtin, origin)
            if refusal is not None:
                problems.append(refusal)
                continue
            self._entries[offer.name] = BackendEntry(
                offer.name,
                offer.backend,
                offer.capabilities,
                name,
                self._next_order,
                origin,
                builtin,
                offer.placements,
            )
            self._next_order += 1
            note_required_libraries(offer.capabilities.requires)
            added.append(offer.name)
            self.generation += 1
        status = found.status
        if status == "loaded" and problems and not added:
            status = "failed"
        passes = tuple(p.name for p in found.rope_passes)
        if status == "loaded":
            self._plugins[name] = plugin
        else:
            withdraw(owner)  # a plugin that failed leaves nothing behind
            passes = ()
            logger.warning("backend plugin %s %s: %s", name, status, "; ".join(problems))
        error = "; ".join(problems) or None
        return self._record(PluginRecord(name, source, status, tuple(added), error, passes))

    def _claim_name(self, name: str, builtin: bool, origin: str) -> str | None:
        """Why a backend may not take ``name`` (taken, or kept for a built-in), else None.

        A built-in backend always gets its name: one registered earlier in process under it is
        removed, and its plugin's record says so.
        """
        taken = self._entries.get(name)
        if taken is not None and builtin and not taken.builtin:
            self._evict(taken, origin)
            return None
        if taken is not None:
            return (
                f"backend name {name!r} is taken by plugin {taken.plugin} ({taken.origin}); "
                f"the backend offered by {origin} needs another name"
            )
        if name in self._reserved and not builtin:
            return (
                f"backend name {name!r} is kept for the built-in plugin {name} "
                f"({BUILTIN_DISTRIBUTION}); the backend offered by {origin} needs another name"
            )
        return None

    def _evict(self, entry: BackendEntry, builtin_origin: str) -> None:
        del self._entries[entry.name]
        self.generation += 1
        note = (
            f"backend {entry.name!r} removed: the name belongs to a built-in backend "
            f"({builtin_origin})"
        )
        logger.warning("backend plugin %s: %s", entry.plugin, note)
        for i in range(len(self._records) - 1, -1, -1):
            rec = self._records[i]
            if rec.name == entry.plugin and rec.status == "loaded":
                left = tuple(b for b in rec.backends if b != entry.name)
                error = "; ".join(e for e in (rec.error, note) if e)
                status: PluginStatus = "loaded" if left else "failed"
                passes = rec.rope_passes
                if not left:
                    self._plugins.pop(entry.plugin, None)
                    withdraw((self.serial, entry.plugin))
                    passes = ()
                self._records[i] = PluginRecord(rec.name, rec.source, status, left, error, passes)
                return

    def _record(self, record: PluginRecord) -> PluginRecord:
        with self._lock:
            self._records.append(record)
            self.generation += 1
        return record

    def entries(self) -> list[BackendEntry]:
        refuse_reentry("Registry.entries()")
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.order)

    def records(self) -> list[PluginRecord]:
        refuse_reentry("Registry.records()")
        with self._lock:
            return list(self._records)

    def snapshot(self) -> RegistrySnapshot:
        refuse_reentry("Registry.snapshot()")
        with self._lock:
            return RegistrySnapshot(self.generation, tuple(self.entries()), tuple(self._records))

    def required_libraries(self) -> tuple[str, ...]:
        """Every library a registered backend ``requires``: pass these to `detect_platform`."""
        return self.snapshot().required_libraries()

    def get(self, name: str) -> BackendEntry | None:
        refuse_reentry("Registry.get()")
        with self._lock:
            return self._entries.get(name)


_default: Registry | None = None
_default_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use.

    A plugin calling it while it loads gets `ReentrantRegistryError` (recorded against that
    plugin). If loading is interrupted (`KeyboardInterrupt`), no registry is kept and the next
    call loads again.
    """
    refuse_reentry("get_registry()")
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
    of that moment. The RoPE passes the replaced registry's plugins brought are withdrawn.
    """
    refuse_reentry("reset_registry()")
    global _default
    with _default_lock:
        if _default is not None and _default is not registry:
            withdraw_registry(_default.serial)
            clear_required_libraries()  # the replaced backends' libraries need no more probing
        _default = registry
