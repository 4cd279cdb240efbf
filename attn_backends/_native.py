"""Build-on-first-use loader of the native RoPE/logn kernel in ``csrc/``.

CPU machines never compile it. On a CUDA or ROCm machine the first `load` builds it with
torch's extension loader (hipified automatically on ROCm) into a cache directory keyed by the
sources and the torch build, so later processes only load it. It registers the torch operator
``attn_backends_native::rope_logn_``. Any failure becomes one `NativeBuildError`, remembered
for the process, so a machine without a compiler pays the check once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from ._errors import NativeBuildError
from ._spec import AttentionSpec

logger = logging.getLogger("attn_backends")

SOURCES = ("rope_logn.h", "rope_logn.cu", "rope_logn_binding.cpp")
MAX_ROTARY_DIM = 512
"""Largest rotary_dim the kernel serves (``2 * kMaxRotaryHalf`` in ``csrc/rope_logn.h``)."""
NATIVE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_EXTENSION = "attn_backends_rope_logn"
_FLAGS = ("-O3",)

_lock = threading.Lock()
_op: Any = None
"""The loaded operator (a torch OpOverloadPacket: untyped, it comes from ``torch.ops``)."""
_error: NativeBuildError | None = None


def source_dir() -> Path:
    """``csrc/`` inside the installed package (wheel), else beside it (source checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if all((candidate / name).is_file() for name in SOURCES):
            return candidate
    raise NativeBuildError(
        "the native kernel sources (csrc/" + ", csrc/".join(SOURCES) + ") are not installed "
        "with attn_backends; reinstall the package with its package data"
    )


def cache_root() -> Path:
    """Where builds live: ``$XDG_CACHE_HOME/attn_backends/native`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attn_backends" / "native"


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
    """Copy the sources to a writable place: the ROCm build writes hipified files beside them."""
    target.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        dest = target / name
        data = (src / name).read_bytes()
        if dest.is_file() and dest.read_bytes() == data:
            continue
        tmp = target / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, dest)


def _build_and_load() -> Any:
    problem = toolchain_problem()
    if problem is not None:
        raise NativeBuildError(f"native RoPE/logn kernel unavailable: {problem}")
    from torch.utils import cpp_extension

    src = source_dir()
    root = cache_root() / _build_tag(src)
    staged = root / "src"
    build = root / "build"
    try:
        _stage_sources(src, staged)
        build.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=_EXTENSION,
            sources=[str(staged / "rope_logn.cu"), str(staged / "rope_logn_binding.cpp")],
            extra_cflags=list(_FLAGS),
            extra_cuda_cflags=list(_FLAGS),
            extra_include_paths=[str(staged)],
            build_directory=str(build),
            is_python_module=False,
        )
        return torch.ops.attn_backends_native.rope_logn_
    except Exception as exc:  # compiler, linker, loader and file errors come in many types
        logger.warning("building the native RoPE/logn kernel in %s failed: %s", build, exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise NativeBuildError(
            f"building the native RoPE/logn kernel failed ({type(exc).__name__}: {first[:200]}); "
            "the full compiler output is in the log"
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
    op = load()
    rope = spec.rope
    op(
        packed,
        cu_seqlens,
        tokens,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.rotary_dim,
        rope.interleaved if rope is not None else False,
        float(rope.theta) if rope is not None else 0.0,
        float(spec.logn_base) if spec.use_logn_attn and spec.logn_base is not None else 0.0,
        unroll,
        target_threads_per_sm,
    )
