"""flashinfer's JIT modules as this package names them: their build specs, cache state, cost.

One place for what warm-up (`attn_backends.warmup`, ``attn-backends warmup``) and the offline
prebuild (``benchmarks/gpu/prebuild.py``) both need: which flashinfer ``JitSpec`` a `JitModule`
is, whether flashinfer's cache already holds it, where that cache is, roughly what building it
costs, and loading it through the very function the backend's call path uses.
"""

from __future__ import annotations

from typing import Any

import torch

from attn_backends.plugin import KernelModule

from ._flashinfer_common import JitKind, JitModule

ROPE_MODULE = JitModule("rope", "any", None)
"""flashinfer's in-place RoPE (``apply_rope_pos_ids_inplace``): the contract's RoPE pass when
the native kernel is unavailable."""

BUILD_CPU_SECONDS: dict[JitKind, float] = {
    "fa3": 720.0,
    "fa2": 180.0,
    "fmha_v2": 2300.0,
    "rope": 100.0,
}
"""Rough CPU-seconds to compile one module (nvcc 13.0, sm90a): fa3 has 10 objects, 8 of them
about 80 s each; fa2 10 objects of about 19 s; FMHA v2 about 136 objects, at about one per
second on 16 cores; RoPE 2 objects. Divide by the build's parallel jobs for wall time."""

LONGEST_OBJECT_SECONDS: dict[JitKind, float] = {
    "fa3": 95.0,
    "fa2": 35.0,
    "fmha_v2": 20.0,
    "rope": 40.0,
}
"""Rough wall seconds of a module's slowest object on an H200 machine's cores; a module is
never done sooner, however many jobs run. Measured: a fa3 module built alone with 16 jobs took
95 s, a fa2 module 34 s (flashinfer 0.7.4, 2026-12-01). Not measured per object: RoPE is its
whole first build (about 40 s), FMHA v2 a guess from its objects (about 16 CPU-seconds each)."""

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def prefill_key(module: JitModule) -> tuple[object, ...]:
    """flashinfer's batch-prefill module key: backend, q/kv/o dtypes, index dtype, head dims,
    position encoding, sliding window, logits soft cap, then fp16 QK reduction (off)."""
    dtype = _DTYPES[module.dtype]
    dim = module.head_dim
    return (
        module.kind,
        dtype,
        dtype,
        dtype,
        torch.int32,
        dim,
        dim,
        module.pos_encoding,
        module.sliding_window,
        module.logit_softcap,
        False,
    )


def jit_spec(module: JitModule) -> Any:
    """flashinfer's ``JitSpec`` for ``module``: exactly the one its wrapper or function builds
    (generating it writes the module's sources, nothing is compiled)."""
    from flashinfer.jit.attention.modules import (  # untyped GPU library
        _gen_batch_prefill_primary_module,
        gen_batch_prefill_module,
        gen_fmha_v2_module,
    )
    from flashinfer.jit.rope import gen_rope_module

    if module.kind == "rope":
        return gen_rope_module()
    if module.kind == "fmha_v2":
        return gen_fmha_v2_module("PACKED_QKV", _DTYPES[module.dtype], None)
    gen = gen_batch_prefill_module if module.kind == "fa3" else _gen_batch_prefill_primary_module
    return gen(*prefill_key(module))


def load(module: JitModule) -> None:
    """Load ``module`` through the function the backend's call path uses (a build if flashinfer's
    cache lacks it)."""
    import flashinfer.prefill as prefill  # untyped GPU library
    import flashinfer.rope as rope

    if module.kind == "rope":
        rope.get_rope_module()
    elif module.kind == "fmha_v2":
        prefill.get_trtllm_fmha_v2_module("PACKED_QKV", _DTYPES[module.dtype], None)
    else:
        prefill.get_batch_prefill_module(*prefill_key(module))


def cache_dir() -> str:
    """Where flashinfer keeps compiled modules (``FLASHINFER_WORKSPACE_BASE`` moves it)."""
    from flashinfer.jit import env  # untyped GPU library

    return str(env.FLASHINFER_JIT_DIR)


def is_cached(module: JitModule) -> bool | None:
    """Whether flashinfer's cache (or its ahead-of-time package) holds ``module``; None when it
    cannot tell (flashinfer missing or its JIT API changed)."""
    try:
        return bool(jit_spec(module).is_compiled)
    except Exception:  # any failure here means "unknown", never a failed warm-up
        return None


def kernel_module(module: JitModule) -> KernelModule:
    """``module`` in the library's terms, for warm-up's plan and estimate."""
    try:
        where: str | None = cache_dir()
    except Exception:  # flashinfer absent or changed: the location is unknown
        where = None
    return KernelModule(
        name=f"flashinfer {module}",
        cached=is_cached(module),
        build_cpu_seconds=BUILD_CPU_SECONDS[module.kind],
        longest_object_seconds=LONGEST_OBJECT_SECONDS[module.kind],
        cache_dir=where,
    )
