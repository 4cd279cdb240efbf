"""The native kernel's build cache, private to the user and checked before anything is loaded.

The cache path is predictable (``$XDG_CACHE_HOME/attn_backends/native/<tag>``), and a shared
library found there is loaded into the process. So every directory this library creates there is
made with mode 0o700, and every one of them, created now or found from before, must belong to the
current user and be writable by nobody else; a library file must belong to the user and not be
writable by others. Otherwise another account could plant code that the next `select()` loads.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..._values._errors import NativeBuildError

CACHE_PARTS = ("attn_backends", "native")
"""The directories this library owns below the user's cache base, outermost first."""
LIBRARY_SUFFIXES = (".so", ".dylib", ".pyd")


def cache_base() -> Path:
    """The user's cache base: ``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"))


def _refuse(path: Path, why: str) -> NativeBuildError:
    return NativeBuildError(
        f"refusing the native-kernel cache directory {path}: {why}, so another user could plant "
        f"code that would be loaded; delete it (rm -rf '{path}') so that it is recreated private "
        "to you, or point XDG_CACHE_HOME at a directory only you can write"
    )


def check_base(base: Path) -> None:
    """The base is not ours to tighten, but if anyone may rename entries in it (writable by
    others without the sticky bit, as /tmp has), our private directories could be swapped."""
    mode = base.stat().st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise NativeBuildError(
            f"refusing the cache base {base}: it is writable by every user (mode "
            f"{stat.S_IMODE(mode):#o}) without the sticky bit, so the native-kernel cache in it "
            "could be replaced; point XDG_CACHE_HOME at a directory only you can write"
        )


def check_private_dir(path: Path) -> None:
    """Raise `NativeBuildError` unless ``path`` is a directory of the current user that group
    and others cannot write."""
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, "it is not a directory")
    uid = os.geteuid()
    if info.st_uid != uid:
        raise _refuse(path, f"it is owned by uid {info.st_uid}, not by you (uid {uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(
            path, f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):#o})"
        )


def private_dir(path: Path) -> Path:
    """``path`` made (mode 0o700) if missing, then checked by `check_private_dir`."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(
            f"cannot create the native-kernel cache directory {path} ({exc}); make its parent "
            "writable by you or point XDG_CACHE_HOME elsewhere"
        ) from exc
    check_private_dir(path)
    return path


def private_tree(base: Path, parts: tuple[str, ...]) -> Path:
    """``base/parts[0]/parts[1]/...``, each level made private and checked, outermost first, so
    no level can be swapped by someone else between its check and the next level's."""
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(
            f"cannot create the cache base {base} ({exc}); point XDG_CACHE_HOME at a writable "
            "directory"
        ) from exc
    check_base(base)
    path = base
    for part in parts:
        path = private_dir(path / part)
    return path


def check_library(path: Path) -> None:
    """Raise `NativeBuildError` unless the shared library ``path`` belongs to the current user
    and others cannot write it."""
    info = path.lstat()
    uid = os.geteuid()
    if stat.S_ISLNK(info.st_mode):
        why = "it is a symbolic link"
    elif info.st_uid != uid:
        why = f"it is owned by uid {info.st_uid}, not by you (uid {uid})"
    elif info.st_mode & stat.S_IWOTH:
        why = f"it is writable by others (mode {stat.S_IMODE(info.st_mode):#o})"
    else:
        return
    raise NativeBuildError(
        f"refusing to load the native kernel library {path}: {why}; delete it (rm -f '{path}') "
        "so that it is rebuilt, and check who can write to the cache"
    )


def check_libraries(build: Path) -> None:
    """`check_library` on every shared library in the build directory, before any is loaded."""
    for entry in sorted(build.iterdir()):
        if entry.name.endswith(LIBRARY_SUFFIXES):
            check_library(entry)
