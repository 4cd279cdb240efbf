"""Runs the workloads: build each path, check it against the float64 reference, then time it.

Failure stays local: a path that raises is recorded with its error and the others go on; a
workload that raises is recorded and the next one starts. Only a CUDA context left unusable by
an earlier error stops the run (every later call would fail the same way).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.metadata
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

import attn_backends
from attn_backends import (
    TOLERANCE,
    AttentionSpec,
    FMHAParams,
    clear_selection_cache,
    get_registry,
    reference_attention,
    relative_error,
    select,
)
from attn_backends._dtypes import dtype_name

from .paths import (
    PreparedPath,
    RopeTables,
    Skip,
    build_legacy_flashinfer,
    build_padded_sdpa,
    build_public,
    build_varlen,
    rope_tables,
)
from .results import (
    BenchResult,
    Ceilings,
    PathKind,
    PathResult,
    PathStatus,
    WorkloadResult,
)
from .timing import input_set_count, measure_ceilings, synchronize, time_steps
from .workloads import Workload, attention_bytes, attention_flops, rope_bytes

Log = Callable[[str], None]

DEFAULT_ITERS = 50
DEFAULT_WARMUP = 10
DEFAULT_TIME_BUDGET_S = 300.0


@dataclass(frozen=True)
class BenchConfig:
    workloads: tuple[Workload, ...]
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    """No workload starts once this many seconds have passed since the run began."""
    backends: frozenset[str] | None = None
    """Backends to time alone; ``None``: every registered one."""
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    measure_ceilings: bool = True
    command: str = ""


class _DeviceLost(Exception):
    """The CUDA context is unusable after an earlier error; nothing more can run."""


def _short(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _device_usable(device: torch.device) -> bool:
    try:
        synchronize(device)
    except Exception:
        return False
    return True


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
        "attn_backend_env": os.environ.get("ATTN_BACKEND"),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta["device_name"] = props.name
        meta["capability"] = f"{props.major}.{props.minor}"
        meta["l2_cache_bytes"] = props.L2_cache_size
    return meta


class _WorkloadRun:
    """State of one workload: its batch, reference outputs and input buffers."""

    def __init__(self, work: Workload, config: BenchConfig, device: torch.device, log: Log) -> None:
        self.work = work
        self.config = config
        self.device = device
        self.log = log
        self.spec = work.spec(config.dtype)
        self.lengths = work.lengths(config.seed)
        self.params = FMHAParams.from_lengths(self.lengths, device=device)
        self.tables: RopeTables | None = rope_tables(self.spec, self.params)
        tokens, width = self.params.token_q_num, self.spec.qkv_width
        gen = torch.Generator(device=device).manual_seed(config.seed * 7919 + work.salt)
        # Fresh random inputs, never zeros: one buffer for the correctness check, then the
        # buffers the timed calls rotate through.
        self.check_input = torch.randn(
            tokens, width, device=device, dtype=config.dtype, generator=gen
        )
        set_bytes = tokens * width * config.dtype.itemsize
        self.sets = [
            torch.randn(tokens, width, device=device, dtype=config.dtype, generator=gen)
            for _ in range(input_set_count(set_bytes, device))
        ]
        self.references: dict[AttentionSpec, torch.Tensor] = {}
        self.paths: list[PathResult] = []

    def reference(self, spec: AttentionSpec) -> torch.Tensor:
        if spec not in self.references:
            t0 = time.perf_counter()
            self.references[spec] = reference_attention(
                self.check_input, spec, self.params, compute_device=self.device
            )
            synchronize(self.device)
            self.log(
                f"  reference ({'RoPE' if spec.rope else 'no RoPE'}) in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        return self.references[spec]

    def measure(
        self,
        path: str,
        kind: PathKind,
        label: str,
        build: Callable[[], PreparedPath | Skip],
        spec: AttentionSpec | None = None,
        backend: str | None = None,
    ) -> PathResult:
        """Build, check against the reference, then time; every failure becomes a record."""
        result = self._measure(path, kind, label, build, spec or self.spec, backend)
        self.paths.append(result)
        status = result.status.upper() if result.status != "ok" else "ok"
        timing = f"{result.ms:.4f} ms" if result.ms is not None else "-"
        err = f"err {result.rel_error:.1e}" if result.rel_error is not None else ""
        note = ""
        if result.note and result.status != "ok":
            note = " (" + " ".join(result.note.split())[:200] + ")"
        self.log(f"  {path:<32} {status:<7} {timing:>12} {err}{note}")
        if result.status == "error":
            if not _device_usable(self.device):
                raise _DeviceLost(f"CUDA context unusable after {path} failed: {result.note}")
            _free(self.device)  # what a failed path left behind (an OOM, say)
        return result

    def _measure(
        self,
        path: str,
        kind: PathKind,
        label: str,
        build: Callable[[], PreparedPath | Skip],
        spec: AttentionSpec,
        backend: str | None,
    ) -> PathResult:
        base = PathResult(path=path, kind=kind, label=label, status="error", backend=backend)
        try:
            prepared = build()
        except Exception as exc:
            return dataclasses.replace(base, note=_short(exc), traceback=_tail(exc))
        if isinstance(prepared, Skip):
            return dataclasses.replace(base, status="skipped", note=prepared.reason)
        base = dataclasses.replace(
            base,
            backend=prepared.backend if prepared.backend is not None else backend,
            details=prepared.details,
            prepare_ms=prepared.prepare_ms,
            select_ms=prepared.select_ms,
        )
        tolerance = TOLERANCE[spec.dtype]
        try:
            reference = self.reference(spec)
        except Exception as exc:
            why = f"the float64 reference failed: {_short(exc)}"
            return dataclasses.replace(base, note=why, traceback=_tail(exc))
        try:
            out = prepared.run(self.check_input.clone())
            error = relative_error(out, reference)
            del out
        except Exception as exc:
            return dataclasses.replace(base, note=_short(exc), traceback=_tail(exc))
        status: PathStatus = "ok" if error <= tolerance else "wrong"
        base = dataclasses.replace(base, status=status, rel_error=error, tolerance=tolerance)
        sets = self.sets
        try:
            timing = time_steps(
                lambda i: prepared.run(sets[i % len(sets)]),
                iters=self.config.iters,
                warmup=self.config.warmup,
                device=self.device,
                input_sets=len(sets),
            )
        except Exception as exc:
            return dataclasses.replace(
                base, status="error", note=f"while timing: {_short(exc)}", traceback=_tail(exc)
            )
        note = None if status == "ok" else f"relative error {error:.3g} > tolerance {tolerance}"
        return dataclasses.replace(base, timing=timing, note=note)


def _tail(exc: BaseException, lines: int = 12) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _registered_backends() -> list[str]:
    return [entry.backend.name for entry in get_registry().entries()]


def run_workload(
    work: Workload, config: BenchConfig, device: torch.device, log: Log
) -> tuple[WorkloadResult, str | None]:
    """The workload's result, and why the device became unusable during it (else None)."""
    t0 = time.perf_counter()
    state = _WorkloadRun(work, config, device, log)
    spec, params = state.spec, state.params
    log(
        f"[{work.name}] {work.shape_text()}; {params.token_q_num} tokens, "
        f"{len(state.sets)} input sets"
    )
    lost: str | None = None
    try:
        _run_paths(state)
    except _DeviceLost as exc:
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
    )
    return result, lost


def _run_paths(state: _WorkloadRun) -> None:
    spec, params, tables = state.spec, state.params, state.tables
    state.reference(spec)  # before any path: a failure here is the workload's, not a path's

    # (a) the public API, whatever the selector picks.
    state.measure("api", "api", "public API", lambda: build_public(spec, params, backend=None))

    # (b) each registered backend alone.
    wanted = state.config.backends
    for name in _registered_backends():
        if wanted is not None and name not in wanted:
            continue
        state.measure(
            f"backend:{name}",
            "backend",
            f"{name} alone",
            functools.partial(build_public, spec, params, backend=name),
            backend=name,
        )

    # (c) attention without RoPE: the automatic choice and the fastest backend of (b).
    if spec.rope is not None:
        bare = dataclasses.replace(spec, rope=None)
        names: list[str] = []
        try:
            names.append(select(bare, device=params.device, strict=False).name)
        except Exception as exc:
            state.log(f"  no automatic choice for the spec without RoPE: {_short(exc)}")
        fastest = _fastest_backend(state.paths)
        if fastest is not None and fastest not in names:
            names.append(fastest)
        for name in names:
            state.measure(
                f"attention-alone:{name}",
                "attention-alone",
                "attention alone (no RoPE)",
                functools.partial(build_public, bare, params, backend=name),
                spec=bare,
                backend=name,
            )

    # (d) legacy, (e) padded SDPA, (f) torch varlen_attn.
    state.measure(
        "legacy",
        "legacy",
        "legacy: copy-split + paged cache write",
        lambda: build_legacy_flashinfer(spec, params, tables),
        backend="flashinfer",
    )
    state.measure(
        "padded-sdpa",
        "padded-sdpa",
        "padded SDPA (HF style)",
        lambda: build_padded_sdpa(spec, params, tables),
    )
    state.measure(
        "varlen-attn",
        "varlen-attn",
        "torch varlen_attn",
        lambda: build_varlen(spec, params, tables),
    )


def _fastest_backend(paths: list[PathResult]) -> str | None:
    usable = [p for p in paths if p.kind == "backend" and p.usable and p.ms is not None]
    if not usable:
        return None
    return min(usable, key=lambda p: p.ms if p.ms is not None else math.inf).backend


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
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
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
            meta["ceilings_error"] = _short(exc)
            log(f"ceilings not measured: {_short(exc)}")
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
                reason = f"workload failed: {_short(exc)}"
                skipped.append((work.name, reason))
                log(f"[{work.name}] {reason}\n{_tail(exc)}")
                if not _device_usable(dev):
                    lost = f"CUDA context unusable after {work.name} failed"
            clear_selection_cache()
            _free(dev)
        if checkpoint is not None:
            checkpoint(BenchResult(meta, ceilings, tuple(results), tuple(skipped), complete=False))
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    return BenchResult(meta, ceilings, tuple(results), tuple(skipped), complete=True)
