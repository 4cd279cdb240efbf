"""A build lock that a killed builder cannot leave behind, around torch's own.

torch's extension loader serialises builds with a ``lock`` file in the build directory that it
creates on entry and deletes on exit. A builder killed part-way never deletes it, and every later
process then polls for it forever: ``select()`` hangs. This lock wraps torch's:

* it is an ``flock`` on a file beside the build directory, which the kernel releases when its
  holder dies however it dies, so a dead builder never wedges the next one;
* whoever holds it is the only process in torch's loader for that directory, so a torch ``lock``
  file found by the holder was left by a killed build: it is removed, with a warning naming the
  build that left it (the holder writes its PID, host and start time into the lock file);
* waiting for a live builder is bounded: past ``wait_s`` the waiter gets `NativeBuildError`
  naming the builder and the files to delete if that builder is stuck.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from ..._values._errors import NativeBuildError

logger = logging.getLogger("attn_backends")

POLL_S = 0.1
"""How often a waiter retries the lock."""


@dataclass(frozen=True)
class Owner:
    """Who holds (or last held without releasing) the build lock."""

    pid: int
    host: str
    started: float
    """``time.time()`` when the lock was taken."""

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), time.time())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}, since {when}"


def read_owner(fd: int) -> Owner | None:
    """The owner record in the lock file; None when empty (released cleanly) or unreadable."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        data = json.loads(text) if text.strip() else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return Owner(int(data["pid"]), str(data["host"]), float(data["started"]))
    except (KeyError, TypeError, ValueError):
        return None


def _write_owner(fd: int, owner: Owner | None) -> None:
    os.ftruncate(fd, 0)
    if owner is not None:
        os.pwrite(fd, json.dumps(asdict(owner)).encode(), 0)
    os.fsync(fd)


def _is_alive_here(owner: Owner) -> bool | None:
    """Whether the owner's process runs (None: it is on another host, so this cannot tell)."""
    if owner.host != socket.gethostname():
        return None
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held_error(lock: Path, baton: Path, fd: int, wait_s: float) -> NativeBuildError:
    owner = read_owner(fd)
    if owner is None:
        who = "another process (it has not written its PID yet)"
    else:
        alive = _is_alive_here(owner)
        state = {True: "running", False: "no longer running", None: "on another host"}[alive]
        who = f"another process ({owner.describe()}; {state})"
    return NativeBuildError(
        f"the native RoPE/logn kernel is being built by {who} and it did not finish within "
        f"{wait_s:g} s; wait for it, or stop that build; if no build is running, delete "
        f"'{lock}' and '{baton}'"
    )


def _acquire(lock: Path, baton: Path, wait_s: float) -> int:
    """An open descriptor of ``lock`` holding its flock, waiting at most ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                error = _held_error(lock, baton, fd, wait_s)
                os.close(fd)
                raise error from None
            os.close(fd)
            time.sleep(POLL_S)
            continue
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise NativeBuildError(
                    f"the file system of {lock} does not support file locks ({exc.strerror}), "
                    "so concurrent builds could not be kept apart; point XDG_CACHE_HOME at a "
                    "local directory"
                ) from exc
            raise
        # the file may have been deleted (as _held_error advises) and recreated meanwhile: the
        # lock counts only on the file that is at the path now
        try:
            current = os.stat(lock, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


def _clear_stale_baton(baton: Path, previous: Owner | None) -> None:
    if not baton.exists():
        return
    left_by = previous.describe() if previous is not None else "a build that left no record"
    logger.warning(
        "removing the stale native-kernel build lock %s left by a build that did not finish "
        "(%s); building again",
        baton,
        left_by,
    )
    baton.unlink(missing_ok=True)


@contextmanager
def build_lock(lock: Path, baton: Path, wait_s: float) -> Iterator[None]:
    """Hold the build lock ``lock`` for a build whose torch lock file is ``baton``.

    Waits at most ``wait_s`` seconds for another builder, then raises `NativeBuildError`. Once
    held, a leftover ``baton`` is removed (its builder was killed) and this process is recorded
    as the owner until it leaves, however it leaves.
    """
    fd = _acquire(lock, baton, wait_s)
    try:
        _clear_stale_baton(baton, read_owner(fd))
        _write_owner(fd, Owner.me())
        try:
            yield
        finally:
            _write_owner(fd, None)
    finally:
        os.close(fd)
