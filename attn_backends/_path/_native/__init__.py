"""Build-on-first-use loader of the native RoPE/logn kernel in ``csrc/``.

CPU machines never compile it. On a CUDA or ROCm machine the first `load` builds it with
torch's extension loader (hipified automatically on ROCm) into a cache directory keyed by the
sources and the torch build, so later processes only load it. It registers the torch operator
``attn_backends_native::rope_logn_``. Any failure becomes one `NativeBuildError`, remembered
for the process, so a machine without a compiler pays the check once.

The cache is private to the user and checked before a library in it is loaded
(`_cache`); builds are serialised by a lock that a killed builder cannot leave held, and
a wait for another builder is bounded (`_lock`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..._values._errors import NativeBuildError
from ..._values._spec import AttentionSpec
from ._cache import CACHE_PARTS, cache_base, check_libraries, private_dir, private_tree
from ._lock import build_lock

logger = logging.getLogger("attn_backends")

SOURCES = ("rope_logn.h", "rope_logn.cu", "rope_logn_binding.cpp")
MAX_ROTARY_DIM = 512
"""Largest rotary_dim the kernel serves (``2 * kMaxRotaryHalf`` in ``csrc/rope_logn.h``)."""
NATIVE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_EXTENSION = "attn_backends_rope_logn"
_FLAGS = ("-O3",)
BUILD_WAIT_S = 600.0
"""How long a process waits for another one building the same kernel before it gives up (and
the pre-processing falls back to torch); a build takes about a minute."""

_lock = threading.Lock()
_op: Any = None
"""The loaded operator (a torch OpOverloadPacket: untyped, it comes from ``torch.ops``)."""
_error: NativeBuildError | None = None


def source_dir() -> Path:
    """``csrc/`` inside the installed package (wheel), else beside it (source checkout)."""
    here = Path(__file__).resolve().parents[2]  # the package root, above _path/_native/
    for candidate in (here / "csrc", here.parent / "csrc"):
        if all((candidate / name).is_file() for name in SOURCES):
            return candidate
    raise NativeBuildError(
        "the native kernel sources (csrc/" + ", csrc/".join(SOURCES) + ") are not installed "
        "with attn_backends; reinstall the package with its package data"
    )


def cache_root() -> Path:
    """Where builds live: ``$XDG_CACHE_HOME/attn_backends/native`` (``~/.cache`` by default)."""
    return cache_base().joinpath(*CACHE_PARTS)


def toolchain_problem() -> str | None:
    """Why the kernel cannot be built here, or None. Cheap: runs no compiler."""
    if not torch.cuda.is_available():
        return (
            "no CUDA or ROCm device is visible (torch.cuda.is_available() is False); the native "
            "kernel is only built on GPU machines"
        )
    from torch.utils import cpp_extension

    if torch.version.hip is not None:
        if cpp_extension.ROCM_HOME is None:
            return "the ROCm toolkit (hipcc) was not found; set ROCM_HOME"
    elif torch.version.cuda is not None:
        home = cpp_extension.CUDA_HOME
        if home is None or not (Path(home) / "bin" / "nvcc").exists():
            return "the CUDA compiler nvcc was not found; set CUDA_HOME or put nvcc on PATH"
    else:
        return "this torch build supports neither CUDA nor ROCm"
    if not cpp_extension.is_ninja_available():
        return "ninja was not found; install it (pip install ninja)"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"the C++ compiler {cxx!r} was not found; install one or set CXX"
    return None


def _build_tag(src: Path) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((src / name).read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    gpu = f"hip{torch.version.hip}" if torch.version.hip is not None else f"cu{torch.version.cuda}"
    tag = f"{digest.hexdigest()[:16]}-torch{torch.__version__}-{gpu}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", tag)


def _stage_sources(src: Path, target: Path) -> None:
    """Copy the sources into ``target`` (made by `build_dirs`): the ROCm build writes hipified
    files beside them."""
    for name in SOURCES:
        dest = target / name
        data = (src / name).read_bytes()
        if dest.is_file() and dest.read_bytes() == data:
            continue
        tmp = target / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, dest)


@dataclass(frozen=True)
class BuildDirs:
    """Where one build lives: ``root`` is keyed by the sources and the torch build."""

    root: Path

    @property
    def src(self) -> Path:
        """Staged sources (the ROCm build writes hipified copies beside them)."""
        return self.root / "src"

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def lock(self) -> Path:
        """Our build lock (`build_lock`), outside the build directory torch manages."""
        return self.root / "build.lock"

    @property
    def baton(self) -> Path:
        """The lock file torch's extension loader creates in the build directory."""
        return self.build / "lock"


def build_dirs() -> BuildDirs:
    """This build's directories, created private to the user and checked; `NativeBuildError`
    names a directory that someone else owns or can write, and how to fix it."""
    dirs = BuildDirs(private_tree(cache_base(), (*CACHE_PARTS, _build_tag(source_dir()))))
    private_dir(dirs.src)
    private_dir(dirs.build)
    return dirs


def build_library() -> None:
    """Build (or find built) and load the kernel library into this process.

    Raises `NativeBuildError` when the toolchain is missing, the cache is not private to the
    user or cannot be used, another builder holds the lock past `BUILD_WAIT_S`, or the build
    itself fails.
    """
    problem = toolchain_problem()
    if problem is not None:
        raise NativeBuildError(f"native RoPE/logn kernel unavailable: {problem}")
    try:
        dirs = build_dirs()
        with build_lock(dirs.lock, dirs.baton, BUILD_WAIT_S):
            check_libraries(dirs.build)
            _compile(dirs)
    except OSError as exc:  # the cache itself: a full disk, a symlinked lock, a vanished path
        raise NativeBuildError(
            f"the native-kernel cache {cache_root()} cannot be used ({exc}); delete it so that "
            "it is recreated, or point XDG_CACHE_HOME at a directory only you can write"
        ) from exc


def _compile(dirs: BuildDirs) -> None:
    """torch's extension loader: builds what changed, then loads the library."""
    from torch.utils import cpp_extension

    try:
        _stage_sources(source_dir(), dirs.src)
        cpp_extension.load(
            name=_EXTENSION,
            sources=[str(dirs.src / "rope_logn.cu"), str(dirs.src / "rope_logn_binding.cpp")],
            extra_cflags=list(_FLAGS),
            extra_cuda_cflags=list(_FLAGS),
            extra_include_paths=[str(dirs.src)],
            build_directory=str(dirs.build),
            is_python_module=False,
        )
    except Exception as exc:  # compiler, linker, loader and file errors come in many types
        logger.warning("building the native RoPE/logn kernel in %s failed: %s", dirs.build, exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise NativeBuildError(
            f"building the native RoPE/logn kernel failed ({type(exc).__name__}: "
            f"{first[:200]}); the full compiler output is in the log"
        ) from exc


def _operator() -> Any:
    """The operator the library registered (untyped: it comes from ``torch.ops``)."""
    return torch.ops.attn_backends_native.rope_logn_


def _build_and_load() -> Any:
    build_library()
    try:
        return _operator()
    except (AttributeError, RuntimeError) as exc:
        raise NativeBuildError(
            f"the native kernel library loaded but registered no rope_logn_ operator ({exc}); "
            f"delete '{cache_root()}' so that it is rebuilt from the installed sources"
        ) from exc


def load() -> Any:
    """The ``rope_logn_`` operator, built and loaded on first use; raises `NativeBuildError`."""
    global _op, _error
    if _op is not None:
        return _op
    with _lock:
        if _op is not None:
            return _op
        if _error is not None:
            raise _error
        try:
            _op = _build_and_load()
        except NativeBuildError as exc:
            _error = exc
            raise
        logger.info("native RoPE/logn kernel loaded")
        return _op


def unavailable_reason() -> str | None:
    """None when the kernel is loaded (building it if needed), else why it cannot be."""
    try:
        load()
    except NativeBuildError as exc:
        return str(exc)
    return None


def clear_cache() -> None:
    """Forget a remembered failure (tests, or after installing a compiler)."""
    global _error
    with _lock:
        _error = None


def rope_logn_(
    packed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    tokens: int,
    spec: AttentionSpec,
    *,
    unroll: int = 0,
    target_threads_per_sm: int = 0,
) -> None:
    """RoPE on the Q|K columns and logn on Q of the first ``tokens`` rows, in place, one pass.

    ``unroll`` and ``target_threads_per_sm`` are tuning knobs for measurements (0: defaults).
    """
    load()(packed, cu_seqlens, tokens, *_spec_args(spec), unroll, target_threads_per_sm)


def rope_logn_qk_(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, tokens: int, spec: AttentionSpec
) -> None:
    """`rope_logn_` on separate ``q`` ``[rows, Hq * D]`` and ``k`` ``[rows, Hkv * D]`` (dense
    columns, any row strides, the same rows): one launch, in place, nothing allocated."""
    load()  # builds the library (and remembers a failure) like the packed operator
    torch.ops.attn_backends_native.rope_logn_qk_(q, k, cu_seqlens, tokens, *_spec_args(spec))


def _spec_args(spec: AttentionSpec) -> tuple[int, int, int, int, bool, float, float]:
    """The spec's part of both operators' arguments: heads, head_dim, rotary_dim, interleaved,
    theta (0 without RoPE) and the logn base (0 without logn)."""
    rope = spec.rope
    return (
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.rotary_dim,
        rope.interleaved if rope is not None else False,
        float(rope.theta) if rope is not None else 0.0,
        float(spec.logn_base) if spec.use_logn_attn and spec.logn_base is not None else 0.0,
    )
