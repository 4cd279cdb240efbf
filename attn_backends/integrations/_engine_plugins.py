"""The engine plugins as data: which engine, which versions they were tested on, what is
installed, and what happened when the engine loaded them.

An engine loads its plugins at startup in every process, and a plugin that raises there can
take the server down. So each plugin's registration runs through `guarded`: it registers only
an engine of a tested version, records what it did, and logs (never raises) what went wrong,
leaving the engine's own backends as they were. `engine_plugins` is what ``attn-backends list``
shows.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

__all__ = ["ENGINES", "EngineInfo", "EnginePluginStatus", "engine_plugins", "guarded"]

logger = logging.getLogger("attn_backends")


@dataclass(frozen=True)
class EngineInfo:
    """One engine this library plugs into."""

    engine: str
    """The engine's distribution name."""
    group: str
    """The entry-point group the engine loads plugins from at startup."""
    entry_point: str
    """This library's entry point in that group."""
    backend_name: str
    """The name the engine's attention-backend flag takes."""
    minimum: tuple[int, ...]
    """The oldest release tested (included)."""
    below: tuple[int, ...]
    """The first release not tested (excluded)."""

    @property
    def tested(self) -> str:
        return f">={_dotted(self.minimum)},<{_dotted(self.below)}"

    def admits(self, version: str) -> bool:
        """Whether ``version`` (a release string such as ``0.34.1.dev3+g00``) is tested."""
        release = _release(version)
        return release is not None and self.minimum <= release < self.below


ENGINES: dict[str, EngineInfo] = {
    "vllm": EngineInfo(
        engine="vllm",
        group="vllm.general_plugins",
        entry_point="attn_backends.integrations.vllm:register",
        backend_name="ATTN_BACKENDS",
        minimum=(0, 33),
        below=(0, 35),
    ),
    "sglang": EngineInfo(
        engine="sglang",
        group="sglang.srt.plugins",
        entry_point="attn_backends.integrations.sglang:register",
        backend_name="attn_backends",
        minimum=(0, 5, 23),
        below=(0, 6),
    ),
}
"""The engines and the release ranges the tests ran on (the extras in pyproject.toml pin
the same ranges)."""


@dataclass(frozen=True)
class EnginePluginStatus:
    """What ``attn-backends list`` says about one engine plugin."""

    engine: str
    tested: str
    installed: str | None
    """The engine's installed version, or None when it is not installed."""
    entry_point: bool
    """Whether this library's entry point is in the engine's group (the package metadata the
    engine reads at startup)."""
    state: str
    """``registered`` (in this process), ``ready`` (the engine will register it at startup),
    ``engine missing``, ``version untested``, ``entry point missing`` or ``failed``."""
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "tested": self.tested,
            "installed": self.installed,
            "entry_point": self.entry_point,
            "state": self.state,
            "detail": self.detail,
        }


_outcomes: dict[str, tuple[str, str]] = {}
"""engine -> (state, detail) of the registration this process ran."""
_lock = threading.Lock()


def installed_version(engine: str) -> str | None:
    try:
        return metadata.version(engine)
    except metadata.PackageNotFoundError:
        return None


def guarded(engine: str, register: Callable[[], str]) -> bool:
    """Run ``register`` (which returns what it registered) for ``engine`` if a tested release
    of it is installed; record and log the outcome. Never raises: the engine keeps its own
    backends whatever happens here."""
    info = ENGINES[engine]
    version = installed_version(engine)
    if version is None:
        state, detail = "engine missing", f"{engine} is not installed"
    elif not info.admits(version):
        state, detail = (
            "version untested",
            f"{engine} {version} is outside the tested range {info.tested}; "
            f"attn_backends registered nothing (install attn-backends[{engine}])",
        )
    else:
        try:
            state, detail = "registered", register()
        except Exception as exc:  # the engine must start with its own backends
            state, detail = "failed", f"{type(exc).__name__}: {exc}"
    with _lock:
        _outcomes[engine] = (state, detail)
    if state == "registered":
        logger.info("attn_backends: %s plugin: %s", engine, detail)
    else:
        logger.warning("attn_backends: %s plugin not registered: %s", engine, detail)
    return state == "registered"


def _has_entry_point(info: EngineInfo) -> bool:
    found = metadata.entry_points(group=info.group)
    return any(ep.value == info.entry_point for ep in found)


def engine_plugins() -> list[EnginePluginStatus]:
    """Each engine plugin's state on this machine, read from the installed packages (no engine
    is imported) and from any registration this process ran."""
    rows = []
    for name, info in ENGINES.items():
        version = installed_version(name)
        entry = _has_entry_point(info)
        with _lock:
            outcome = _outcomes.get(name)
        if outcome is not None:
            state, detail = outcome
        elif version is None:
            state, detail = "engine missing", f"pip install 'attn-backends[{name}]'"
        elif not info.admits(version):
            state, detail = "version untested", f"tested on {name} {info.tested}"
        elif not entry:
            state, detail = "entry point missing", "reinstall attn-backends"
        else:
            state, detail = "ready", f"select it with the backend name {info.backend_name}"
        rows.append(EnginePluginStatus(name, info.tested, version, entry, state, detail))
    return rows


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    if match is None:
        return None
    return tuple(int(x) for x in match.group(1).split("."))


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in release)
