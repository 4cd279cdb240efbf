"""Where the selector runs: device kind, architecture and which optional libraries exist.

Detection never imports a GPU library; it asks the package metadata, so it is cheap and safe
on a bare CPU machine.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from ._errors import PlatformError

PlatformKind = Literal["cpu", "cuda", "rocm"]
PLATFORM_KINDS: tuple[PlatformKind, ...] = ("cpu", "cuda", "rocm")


@dataclass(frozen=True)
class Platform:
    """A machine as the selector sees it.

    ``assumed`` is True for a dry run (``platform="cuda:sm90"``): library checks are then
    assumed to pass, and the decision record says so.
    """

    kind: PlatformKind
    arch: str | None = None
    """``sm90`` style for CUDA, ``gfx942`` style for ROCm, ``None`` for CPU."""
    device_name: str | None = None
    libraries: tuple[tuple[str, str | None], ...] = field(default=())
    """(import name, version or None when absent), sorted; empty when ``assumed``."""
    assumed: bool = False

    def __str__(self) -> str:
        return self.kind if self.arch is None else f"{self.kind}:{self.arch}"

    @property
    def sm(self) -> int | None:
        """CUDA compute capability as an int (``sm90`` -> 90), else None."""
        if self.kind != "cuda" or self.arch is None:
            return None
        match = re.fullmatch(r"sm_?(\d+)a?", self.arch)
        return int(match.group(1)) if match else None

    def library_version(self, name: str) -> str | None:
        """Installed version of an optional library, None when absent."""
        return dict(self.libraries).get(name)

    def has_library(self, name: str) -> bool:
        return self.assumed or self.library_version(name) is not None

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "arch": self.arch,
            "device_name": self.device_name,
            "libraries": dict(self.libraries),
            "assumed": self.assumed,
        }


_required: set[str] = set()
_required_lock = threading.Lock()


def note_required_libraries(names: Iterable[str]) -> None:
    """Add libraries a registered backend ``requires`` to those every `detect_platform` probes.

    The registry calls this when a backend registers, so a third-party kernel library counts as
    present wherever the platform is detected (selection, ``attn-backends list``, the
    conformance suite). The core names no library itself: what is probed is what backends
    declare.
    """
    with _required_lock:
        _required.update(names)


def clear_required_libraries() -> None:
    """Forget the libraries noted by `note_required_libraries`: a replaced registry's backends
    must not keep widening every later probe (tests, an engine that manages plugins itself)."""
    with _required_lock:
        _required.clear()


def _present(import_name: str) -> bool:
    """Whether ``import_name`` can be imported, without importing it.

    For a dotted name only the top-level package is looked up: finding ``pkg.sub`` would import
    ``pkg``, and probing must never run a library's code. A finder that raises means absent.
    """
    top = import_name.partition(".")[0]
    if top in sys.modules:
        return sys.modules[top] is not None
    try:
        return importlib.util.find_spec(top) is not None
    except Exception:  # a broken meta-path finder or package; probing must not fail
        return False


@functools.cache
def _distribution_of(top: str) -> str:
    """The distribution that installs the top-level package ``top`` (first one), else ``top``.

    Used when the distribution is named otherwise than the package (``flashinfer`` ships as
    ``flashinfer-python``); cached, since it reads every installed distribution's file list once.
    """
    try:
        found = importlib.metadata.packages_distributions().get(top)
    except Exception:  # unreadable metadata of some unrelated distribution
        return top
    return found[0] if found else top


@functools.lru_cache(maxsize=256)
def _installed_version(import_name: str) -> str:
    top = import_name.partition(".")[0]
    try:
        try:
            return importlib.metadata.version(top)
        except importlib.metadata.PackageNotFoundError:
            return importlib.metadata.version(_distribution_of(top))
    except Exception:  # not found, or malformed metadata: present, version unknown
        return "unknown"


def _library_version(import_name: str) -> str | None:
    """Installed version of a library, ``None`` when absent, ``"unknown"`` without metadata.

    Presence is checked on every call (cheap, and a test may install a module meanwhile); the
    version, read from package metadata, is cached.
    """
    return _installed_version(import_name) if _present(import_name) else None


def probe_libraries(names: Iterable[str] = ()) -> tuple[tuple[str, str | None], ...]:
    """Versions of the given optional libraries without importing them."""
    return tuple(sorted((name, _library_version(name)) for name in set(names)))


def detect_platform(
    device: torch.device | str | None = None, *, extra_libraries: Iterable[str] = ()
) -> Platform:
    """The platform of ``device``; ``None`` means the current accelerator, else the CPU.

    The libraries probed are those registered backends require (see
    `note_required_libraries`) and ``extra_libraries`` (the selector passes its registry's), so
    a third-party kernel library counts as present when it is installed.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    with _required_lock:
        required = tuple(_required)
    libraries = probe_libraries((*required, *extra_libraries))
    if dev.type != "cuda":
        return Platform(kind="cpu", device_name=None, libraries=libraries)
    props = torch.cuda.get_device_properties(dev)
    if torch.version.hip is not None:
        arch = str(props.gcnArchName).split(":")[0]
        return Platform(kind="rocm", arch=arch, device_name=props.name, libraries=libraries)
    return Platform(
        kind="cuda",
        arch=f"sm{props.major}{props.minor}",
        device_name=props.name,
        libraries=libraries,
    )


_PLATFORM_RE = re.compile(r"^(cpu|cuda|rocm)(?::([A-Za-z0-9_]+))?$")


def parse_platform(text: str) -> Platform:
    """Parse ``cpu``, ``cuda:sm90`` or ``rocm:gfx942`` into an assumed (dry-run) platform."""
    match = _PLATFORM_RE.match(text.strip().lower())
    if match is None:
        raise PlatformError(
            f"cannot parse platform {text!r}; use cpu, cuda:sm<major><minor> (e.g. cuda:sm90) "
            "or rocm:gfx<id> (e.g. rocm:gfx942)"
        )
    kind, arch = match.group(1), match.group(2)
    if kind == "cpu":
        if arch is not None:
            raise PlatformError(f"cpu takes no architecture, got {text!r}")
        return Platform(kind="cpu", assumed=True)
    if arch is None:
        raise PlatformError(
            f"{kind} needs an architecture, e.g. {kind}:{'sm90' if kind == 'cuda' else 'gfx942'}"
        )
    if kind == "cuda":
        sm = re.fullmatch(r"sm_?(\d{2,3})(a?)", arch)
        if sm is None:
            raise PlatformError(f"CUDA architecture must look like sm90 or sm_90, got {arch!r}")
        return Platform(kind="cuda", arch=f"sm{sm.group(1)}{sm.group(2)}", assumed=True)
    if re.fullmatch(r"gfx[0-9a-f]+", arch) is None:
        raise PlatformError(f"ROCm architecture must look like gfx942, got {arch!r}")
    return Platform(kind="rocm", arch=arch, assumed=True)


# `indexed`: a device as tensors report it, so device comparisons mean what they say.


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` becomes ``cuda:<current device>``; others unchanged."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev
