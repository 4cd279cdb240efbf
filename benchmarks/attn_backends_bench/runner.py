"""Runs the workloads: which paths each one measures, in which modes, within the budget.

Per workload: the engine's view first (the public API and the raw kernel it wraps, in every
timing mode), then, in throughput mode, every other path, then, in graph mode, the graph-replay
rows. `measure` builds, checks and times each path. Failure stays local: a workload that
raises is recorded and the next one starts; only a CUDA context left unusable by an error
stops the run (every later call would fail the same way).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

import torch

import attn_backends
from attn_backends import AttentionSpec, FMHAParams, detect_platform, select
from attn_backends.deploy import clear_selection_cache, get_registry
from attn_backends.plugin import dtype_name

from .config import DEFAULT_ITERS, DEFAULT_TIME_BUDGET_S, DEFAULT_WARMUP, BenchConfig
from .interleave import ROUNDS
from .legacy import ROPE_TEXT, build_legacy_flashinfer, legacy_variants
from .measure import (
    Checked,
    DeviceLost,
    Log,
    WorkloadRun,
    device_usable,
    free_memory,
    short_error,
    traceback_tail,
)
from .paths import (
    PreparedPath,
    RopeTables,
    Skip,
    build_padded_sdpa,
    build_public,
    build_varlen,
    rope_tables,
)
from .raw import ApiPlan, build_raw, raw_recipe
from .results import BenchResult, Ceilings, PathResult, WorkloadResult
from .timing import host_calls, indexed, measure_ceilings
from .workloads import Workload, attention_bytes, attention_flops, rope_bytes

__all__ = [
    "DEFAULT_ITERS",
    "DEFAULT_TIME_BUDGET_S",
    "DEFAULT_WARMUP",
    "BenchConfig",
    "collect_meta",
    "run_benchmark",
    "run_workload",
]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_meta(config: BenchConfig, device: torch.device) -> dict[str, object]:
    meta: dict[str, object] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": config.command,
        "attn_backends": attn_backends.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "flashinfer": _version("flashinfer-python"),
        "dtype": dtype_name(config.dtype),
        "iters": config.iters,
        "warmup": config.warmup,
        "seed": config.seed,
        "time_budget_s": config.time_budget_s,
        "backends_filter": sorted(config.backends) if config.backends is not None else None,
        "modes": list(config.modes),
        "host_calls": host_calls(config.iters),
        "host_repeats": config.host_repeats,
        "rounds": ROUNDS,
        "attn_backend_env": os.environ.get("ATTN_BACKEND"),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta["device_name"] = props.name
        meta["capability"] = f"{props.major}.{props.minor}"
        meta["l2_cache_bytes"] = props.L2_cache_size
    return meta


def _registered_backends() -> list[str]:
    return [entry.backend.name for entry in get_registry().entries()]


def run_workload(
    work: Workload, config: BenchConfig, device: torch.device, log: Log
) -> tuple[WorkloadResult, str | None]:
    """The workload's result, and why the device became unusable during it (else None)."""
    t0 = time.perf_counter()
    state = WorkloadRun(work, config, device, log)
    spec, params = state.spec, state.params
    log(
        f"[{work.name}] {work.shape_text()}; {params.token_q_num} tokens, "
        f"{len(state.sets)} input sets"
    )
    lost: str | None = None
    try:
        _run_paths(state)
    except DeviceLost as exc:
        lost = str(exc)
    result = WorkloadResult(
        name=work.name,
        title=work.title,
        shape=work.shape_text(),
        spec=spec.to_dict(),
        lengths=state.lengths,
        flops=attention_flops(state.lengths, spec.num_heads, spec.head_dim, spec.causal),
        bytes=attention_bytes(params.token_q_num, spec),
        rope_bytes=rope_bytes(params.token_q_num, spec) if spec.rope is not None else 0,
        targets=work.targets,
        paths=tuple(state.paths),
        elapsed_s=time.perf_counter() - t0,
        note=f"stopped early: {lost}" if lost is not None else None,
        modes=config.modes,
    )
    return result, lost


def _run_paths(state: WorkloadRun) -> None:
    """Check every path first, then time them all in one interleaved group, so that the
    comparisons the targets make are between paths timed in the same seconds."""
    spec, params = state.spec, state.params
    modes = state.config.modes
    state.reference(spec)  # before any path: a failure here is the workload's, not a path's

    # The engine's view: the public API (whatever the selector picks), the raw kernel it wraps
    # and, in graph mode, its graph replay.
    api = state.check(
        "api",
        "api",
        "public API",
        functools.partial(build_public, spec, params, backend=None),
    )
    raw = state.check(
        "raw",
        "raw",
        "raw kernel (flashinfer called by hand)",
        functools.partial(_build_raw, spec, params, api.result),
        backend="flashinfer",
    )
    group = [api, raw]
    if "graph" in modes:
        group.append(state.check_graph("graph", "public API, CUDA graph replay", None))
    if "throughput" in modes:
        group += _check_throughput_paths(state)
    timed = state.time(group)
    if "graph" in modes:
        _run_graph_paths(state, timed[2])


def _build_raw(spec: AttentionSpec, params: FMHAParams, api: PathResult) -> PreparedPath | Skip:
    recipe = raw_recipe(ApiPlan.from_record(api.backend, api.details), spec, params.device)
    if isinstance(recipe, Skip):
        return recipe
    return build_raw(spec, params, recipe)


def _check_throughput_paths(state: WorkloadRun) -> list[Checked]:
    """Every other way to compute the workload, built and checked (timed back-to-back)."""
    spec, params = state.spec, state.params
    tables: RopeTables | None = rope_tables(spec, params)
    checked: list[Checked] = []

    # Each registered backend alone.
    wanted = state.config.backends
    for name in _registered_backends():
        if wanted is not None and name not in wanted:
            continue
        checked.append(
            state.check(
                f"backend:{name}",
                "backend",
                f"{name} alone",
                functools.partial(build_public, spec, params, backend=name),
                backend=name,
            )
        )

    # Attention without RoPE: the automatic choice and each backend that served the workload.
    if spec.rope is not None:
        bare = dataclasses.replace(spec, rope=None)
        names: list[str] = []
        try:
            names.append(select(bare, device=params.device, strict=False).name)
        except Exception as exc:
            state.log(f"  no automatic choice for the spec without RoPE: {short_error(exc)}")
        for c in checked:
            served = c.result.backend
            if c.result.status == "ok" and served is not None and served not in names:
                names.append(served)
        for name in names:
            checked.append(
                state.check(
                    f"attention-alone:{name}",
                    "attention-alone",
                    "attention alone (no RoPE)",
                    functools.partial(build_public, bare, params, backend=name),
                    spec=bare,
                    backend=name,
                )
            )

    # The legacy path, with each RoPE it could use; padded SDPA; torch varlen_attn.
    platform = detect_platform(params.device, extra_libraries=("flashinfer",))
    for variant in legacy_variants(spec, platform):
        checked.append(
            state.check(
                variant.path,
                "legacy",
                variant.label,
                functools.partial(build_legacy_flashinfer, spec, params, variant),
                backend="flashinfer",
                details={"rope": ROPE_TEXT[variant.rope], "rope_why": variant.why},
            )
        )
    checked.append(
        state.check(
            "padded-sdpa",
            "padded-sdpa",
            "padded SDPA (HF style)",
            functools.partial(build_padded_sdpa, spec, params, tables),
        )
    )
    checked.append(
        state.check(
            "varlen-attn",
            "varlen-attn",
            "torch varlen_attn",
            functools.partial(build_varlen, spec, params, tables),
        )
    )
    return checked


def _run_graph_paths(state: WorkloadRun, auto: PathResult) -> None:
    """After the API's graph replay (``auto``, the automatic choice in graph mode), each
    backend that served the workload eagerly: captured too, or recorded as not supported."""
    served = [
        p.backend
        for p in state.paths
        if p.kind == "backend" and p.status in ("ok", "wrong") and p.backend is not None
    ]
    for name in served:
        if name == auto.backend:
            continue  # the automatic choice's row already is this backend's
        state.measure_graph(f"graph:{name}", f"{name} alone, CUDA graph replay", name)


def _plugin_records() -> list[Mapping[str, object]]:
    return [record.to_dict() for record in get_registry().records()]


def run_benchmark(
    config: BenchConfig,
    *,
    device: torch.device | str = "cuda",
    log: Log = lambda line: print(line, file=sys.stderr, flush=True),
    checkpoint: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """Run every configured workload; ``checkpoint`` gets the partial result after each one."""
    start = time.perf_counter()
    dev = indexed(device)
    meta = collect_meta(config, dev)
    meta["plugins"] = _plugin_records()
    loaded = _registered_backends()
    log(f"device {meta.get('device_name', dev)}; backends registered: {', '.join(loaded)}")
    ceilings: Ceilings | None = None
    if config.measure_ceilings:
        try:
            ceilings = measure_ceilings(dev)
            log(
                f"ceilings: copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s (read + write), "
                f"bf16 matmul {ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s"
            )
        except Exception as exc:
            meta["ceilings_error"] = short_error(exc)
            log(f"ceilings not measured: {short_error(exc)}")
    results: list[WorkloadResult] = []
    skipped: list[tuple[str, str]] = []
    lost: str | None = None
    for work in config.workloads:
        elapsed = time.perf_counter() - start
        if lost is not None:
            skipped.append((work.name, lost))
        elif elapsed > config.time_budget_s:
            reason = (
                f"time budget of {config.time_budget_s:g} s used up "
                f"({elapsed:.0f} s elapsed before it could start)"
            )
            skipped.append((work.name, reason))
            log(f"[{work.name}] skipped: {reason}")
        else:
            try:
                result, lost = run_workload(work, config, dev, log)
                results.append(result)
                if lost is not None:
                    log(f"[{work.name}] stopped: {lost}")
            except Exception as exc:
                reason = f"workload failed: {short_error(exc)}"
                skipped.append((work.name, reason))
                log(f"[{work.name}] {reason}\n{traceback_tail(exc)}")
                if not device_usable(dev):
                    lost = f"CUDA context unusable after {work.name} failed"
            clear_selection_cache()
            free_memory(dev)
        if checkpoint is not None:
            checkpoint(BenchResult(meta, ceilings, tuple(results), tuple(skipped), complete=False))
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    return BenchResult(meta, ceilings, tuple(results), tuple(skipped), complete=True)
