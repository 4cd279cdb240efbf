"""The native kernel's build cache and build lock, on CPU, without compiling anything.

torch's extension loader is replaced by a stand-in that takes torch's own ``build/lock`` file the
way torch does and writes a library file; a leftover lock makes the stand-in fail instead of
polling forever, as torch would. Other builders are real processes: forked children that take
the build lock, then are killed or keep it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import multiprocessing
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

import attn_backends as ab
import attn_backends.errors
from attn_backends._path import _native, _preprocess
from attn_backends._path._native._lock import build_lock
from attn_backends._path._preprocess import choose_preprocess

LIBRARY = "attn_backends_rope_logn.so"
OPERATOR = object()
FOREIGN_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")
# forked children only sleep and touch files; they never run torch
_fork = multiprocessing.get_context("fork")


@dataclass
class FakeTorchLoader:
    """Stands in for ``cpp_extension.load``: torch's baton protocol, then a library file."""

    builds: list[Path] = field(default_factory=list)

    def __call__(self, *, build_directory: str, **_: object) -> None:
        build = Path(build_directory)
        baton = FileBaton(str(build / "lock"))
        if not baton.try_acquire():
            raise AssertionError(f"torch would poll {build / 'lock'} forever")
        try:
            (build / LIBRARY).write_bytes(b"\x7fELF")
            self.builds.append(build)
        finally:
            baton.release()


@pytest.fixture
def loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeTorchLoader]:
    """A GPU machine with a compiler, as far as `_native` can tell, and a fresh cache."""
    fake = FakeTorchLoader()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(_native, "toolchain_problem", lambda: None)
    monkeypatch.setattr(_native, "_operator", lambda: OPERATOR)
    monkeypatch.setattr(_native, "_op", None)
    monkeypatch.setattr(cpp_extension, "load", fake)
    _native.clear_cache()
    _preprocess.clear_preprocess_cache()
    yield fake
    _native.clear_cache()
    _preprocess.clear_preprocess_cache()


def _hold_lock(dirs: _native.BuildDirs, mid_build: bool, ready: Event, seconds: float) -> None:
    """Child process: take the build lock (and torch's baton when mid-build), then keep it."""
    with build_lock(dirs.lock, dirs.baton, 5.0):
        if mid_build:
            os.close(os.open(dirs.baton, os.O_CREAT | os.O_EXCL))
        ready.set()
        time.sleep(seconds)


@pytest.fixture
def builder(loader: FakeTorchLoader) -> _native.BuildDirs:
    """The build directories, as another process would find them."""
    return _native.build_dirs()


def _start_holder(dirs: _native.BuildDirs, *, mid_build: bool, seconds: float) -> BaseProcess:
    ready = _fork.Event()
    child = _fork.Process(target=_hold_lock, args=(dirs, mid_build, ready, seconds))
    child.start()
    assert ready.wait(30), "the child never took the build lock"
    return child


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------- the lock


def test_first_build_makes_every_cache_directory_private(loader: FakeTorchLoader) -> None:
    old = os.umask(0)  # even with a permissive umask
    try:
        assert _native.load() is OPERATOR
    finally:
        os.umask(old)
    (build,) = loader.builds
    root = _native.cache_root()
    for path in (root.parent, root, build.parent, build, build.parent / "src"):
        assert _mode(path) == 0o700, path
        assert path.stat().st_uid == os.geteuid()
    assert _mode(build.parent / "build.lock") == 0o600
    assert not (build / "lock").exists()
    assert (build.parent / "build.lock").read_text() == "", "a clean exit leaves no owner"


def test_a_build_killed_part_way_is_recovered_with_a_warning(
    builder: _native.BuildDirs, loader: FakeTorchLoader, caplog: pytest.LogCaptureFixture
) -> None:
    child = _start_holder(builder, mid_build=True, seconds=60)
    child.kill()  # SIGKILL: no finally block runs, as when a job is killed mid-build
    child.join()
    assert builder.baton.exists(), "the killed build left torch's lock behind"
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        assert _native.load() is OPERATOR
    assert loader.builds == [builder.build]
    assert not builder.baton.exists()
    warning = caplog.text
    assert f"removing the stale native-kernel build lock {builder.baton}" in warning
    assert f"pid {child.pid} on host" in warning


def test_a_torch_lock_left_with_a_dead_owner_record_is_removed(
    builder: _native.BuildDirs, loader: FakeTorchLoader, caplog: pytest.LogCaptureFixture
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_pid = gone.pid
    record = f'{{"pid": {dead_pid}, "host": "somewhere", "started": 0}}'
    builder.lock.write_text(record)
    builder.baton.touch()
    with caplog.at_level(logging.WARNING, logger="attn_backends"):
        assert _native.unavailable_reason() is None
    assert f"pid {dead_pid} on host somewhere" in caplog.text
    assert not builder.baton.exists()


def test_a_live_builder_is_waited_for_until_it_finishes(
    builder: _native.BuildDirs, loader: FakeTorchLoader
) -> None:
    child = _start_holder(builder, mid_build=False, seconds=0.5)
    try:
        assert _native.load() is OPERATOR
    finally:
        child.join()
    assert child.exitcode == 0
    assert loader.builds == [builder.build]


def test_a_live_builder_that_never_finishes_ends_the_wait_with_a_named_error(
    builder: _native.BuildDirs, loader: FakeTorchLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_native, "BUILD_WAIT_S", 0.3)
    child = _start_holder(builder, mid_build=True, seconds=60)
    try:
        reason = _native.unavailable_reason()
        # the pre-processing choice falls back to torch and records why
        h200 = ab.Platform(kind="cuda", arch="sm90", device_name="H200")
        spec = ab.AttentionSpec(8, 8, 64, torch.float16, causal=True, rope=ab.RopeSpec(1e4))
        choice = choose_preprocess(spec, h200, fused_rope=False)
    finally:
        child.kill()
        child.join()
    assert reason is not None
    assert f"being built by another process (pid {child.pid} on host" in reason
    assert "running) and it did not finish within 0.3 s" in reason
    assert f"delete '{builder.lock}' and '{builder.baton}'" in reason
    assert loader.builds == []
    assert choice.mode == "torch"
    assert choice.fallback is not None and f"native: {reason}" in choice.fallback


def test_a_file_system_without_locks_is_a_named_error(
    builder: _native.BuildDirs, loader: FakeTorchLoader, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ab.errors.NativeBuildError, match="does not support file locks"):
        _native.load()
    assert loader.builds == []


def test_a_lock_file_deleted_by_hand_is_not_trusted(tmp_path: Path) -> None:
    lock, baton = tmp_path / "build.lock", tmp_path / "lock"
    with build_lock(lock, baton, 1.0):
        lock.unlink()  # as the timeout message advises when a builder is stuck
        with build_lock(lock, baton, 1.0):
            assert lock.exists()


# ---------------------------------------------------------------- who may write the cache


def test_a_group_writable_cache_directory_is_refused(
    loader: FakeTorchLoader, tmp_path: Path
) -> None:
    planted = tmp_path / "cache" / "attn_backends"
    planted.mkdir(parents=True)
    planted.chmod(0o770)
    reason = _native.unavailable_reason()
    assert reason is not None
    assert f"refusing the native-kernel cache directory {planted}" in reason
    assert "writable by group or others (mode 0o770)" in reason
    assert f"rm -rf '{planted}'" in reason
    assert loader.builds == []


@needs_root
def test_a_cache_directory_owned_by_another_user_is_refused(
    builder: _native.BuildDirs, loader: FakeTorchLoader
) -> None:
    native = _native.cache_root()
    os.chown(native, FOREIGN_UID, FOREIGN_UID)
    with pytest.raises(ab.errors.NativeBuildError, match=f"owned by uid {FOREIGN_UID}, not by you"):
        _native.load()
    assert loader.builds == []


@needs_root
def test_a_library_owned_by_another_user_is_not_loaded(
    builder: _native.BuildDirs, loader: FakeTorchLoader
) -> None:
    planted = builder.build / LIBRARY
    planted.write_bytes(b"\x7fELF")
    os.chown(planted, FOREIGN_UID, FOREIGN_UID)
    reason = _native.unavailable_reason()
    assert reason is not None
    assert f"refusing to load the native kernel library {planted}" in reason
    assert f"rm -f '{planted}'" in reason
    assert loader.builds == []


def test_a_library_writable_by_others_is_not_loaded_but_a_private_one_is(
    builder: _native.BuildDirs, loader: FakeTorchLoader
) -> None:
    library = builder.build / LIBRARY
    library.write_bytes(b"\x7fELF")
    library.chmod(0o666)
    with pytest.raises(ab.errors.NativeBuildError, match=r"writable by others \(mode 0o666\)"):
        _native.load()
    library.chmod(0o755)
    _native.clear_cache()
    assert _native.load() is OPERATOR


@pytest.mark.parametrize(("mode", "refused"), [(0o777, True), (0o1777, False), (0o775, False)])
def test_a_cache_base_anyone_may_rename_in_is_refused(
    loader: FakeTorchLoader, tmp_path: Path, mode: int, refused: bool
) -> None:
    base = tmp_path / "cache"
    base.mkdir()
    base.chmod(mode)
    reason = _native.unavailable_reason()
    if refused:
        assert reason is not None and "writable by every user (mode 0o777)" in reason
        assert not (base / "attn_backends").exists()
    else:
        assert reason is None


def test_a_cache_that_cannot_be_used_is_a_named_error_not_a_crash(
    builder: _native.BuildDirs, loader: FakeTorchLoader, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere.lock"
    elsewhere.touch()
    builder.lock.symlink_to(elsewhere)
    reason = _native.unavailable_reason()
    assert reason is not None
    assert f"the native-kernel cache {_native.cache_root()} cannot be used" in reason
    assert loader.builds == []


def test_both_operators_get_the_schema_argument_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed and the separate operator take the spec's arguments in the schema's order
    (heads, head_dim, rotary_dim, interleaved, theta, logn base), from one place."""
    calls: dict[str, tuple[object, ...]] = {}

    def packed_op(*args: object) -> None:
        calls["packed"] = args

    def qk_op(*args: object) -> None:
        calls["qk"] = args

    class Ops:
        rope_logn_qk_ = staticmethod(qk_op)

    monkeypatch.setattr(_native, "load", lambda: packed_op)
    monkeypatch.setattr(torch.ops, "attn_backends_native", Ops(), raising=False)
    spec = ab.AttentionSpec(
        8,
        2,
        128,
        torch.bfloat16,
        causal=True,
        rope=ab.RopeSpec(5e5, 64, interleaved=True),
        use_logn_attn=True,
        logn_base=4096,
    )
    q, k, cu = torch.empty(3, 8 * 128), torch.empty(3, 2 * 128), torch.tensor([0, 3])
    _native.rope_logn_(q, cu, 3, spec, unroll=2, target_threads_per_sm=1024)
    _native.rope_logn_qk_(q, k, cu, 3, spec)
    expected = (8, 2, 128, 64, True, 5e5, 4096.0)
    assert calls["packed"] == (q, cu, 3, *expected, 2, 1024)
    assert calls["qk"] == (q, k, cu, 3, *expected)
