"""Warm-up: load (and on a new machine compile) every kernel a deployment will use, at start-up.

GPU libraries such as flashinfer compile a kernel module the first time it runs, which takes
minutes; an engine that meets it on its first request times out its health check. `warmup`
selects the backend for each spec, then runs one tiny batch through every path the backend can
take per batch (a backend that fuses RoPE only up to a length also gets a batch past it), so
every module those batches need is built or loaded before traffic arrives. Steps run in
parallel threads, so several compilations proceed at once; a second call finds them cached.

Before it starts, warm-up asks each backend which compiled modules its specs load
(`PrefillBackend.kernel_modules`) and reports how many are built, where the cache is, and an
estimate for the rest; while steps run it reports progress at a steady beat, so a long build
is never silent.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import torch

from .._backend._backend import KernelModule, PrefillBackend
from .._path._contract import Fp8Scales
from .._values._errors import InvalidArgumentError, ParamsError
from .._values._params import FMHAParams
from .._values._platform import Platform
from .._values._spec import PRESETS, AttentionSpec
from ._selector import SelectRequest, select_request

SpecLike = AttentionSpec | str | SelectRequest
"""A spec, the name of a preset (``attn-backends list`` and the README name them), or a whole
`SelectRequest` (its ``device`` and ``platform``, when unset, are warm-up's)."""


@dataclass(frozen=True)
class WarmupStep:
    """One batch run through one selected backend, and how long it took (load or compile)."""

    spec: str
    backend: str
    lengths: tuple[int, ...]
    preprocess: str
    seconds: float


@dataclass(frozen=True)
class WarmupReport:
    device: str
    steps: tuple[WarmupStep, ...]
    seconds: float
    """Wall time of the whole warm-up (steps overlap)."""
    modules: tuple[KernelModule, ...] = ()
    """Compiled modules the steps load, as found before the start (``cached`` then)."""
    estimate_seconds: float | None = None
    """Expected wall time of the builds found missing; None if some cost is unknown."""


def build_jobs() -> int:
    """Parallel compile jobs of a JIT build: ``MAX_JOBS`` (the convention of torch extensions
    and flashinfer), else the core count."""
    try:
        return max(1, int(os.environ.get("MAX_JOBS", "")))
    except ValueError:
        return max(1, os.cpu_count() or 1)


def estimate_build_seconds(modules: Sequence[KernelModule], jobs: int) -> float | None:
    """Wall seconds to build the modules not cached, with ``jobs`` parallel compile jobs: the
    CPU work spread over the jobs, but never less than the slowest single object; 0 when all
    are built, None when the cost of one is unknown."""
    missing = [m for m in modules if m.cached is not True]
    if not missing:
        return 0.0
    if any(m.build_cpu_seconds is None for m in missing):
        return None
    spread = sum(m.build_cpu_seconds or 0.0 for m in missing) / max(1, jobs)
    return max(spread, *(m.longest_object_seconds or 0.0 for m in missing))


def plan_lines(modules: Sequence[KernelModule], jobs: int, estimate: float | None) -> list[str]:
    """What warm-up says before it starts: the cache location(s), what is left to build and
    ``estimate`` (`estimate_build_seconds` of the same modules and jobs)."""
    if not modules:
        return ["no compiled kernel modules to build (the selected backends need none)"]
    lines = [f"kernel cache: {d}" for d in sorted({m.cache_dir for m in modules if m.cache_dir})]
    built = sum(1 for m in modules if m.cached is True)
    unknown = sum(1 for m in modules if m.cached is None)
    todo = len(modules) - built - unknown
    parts = [f"{built} built", f"{todo} to build"] + ([f"{unknown} unknown"] if unknown else [])
    line = f"kernel modules: {len(modules)} ({', '.join(parts)})"
    if todo and estimate is not None:
        line += f"; about {_duration(estimate)} with {jobs} compile jobs"
    lines.append(line)
    lines += [f"  {'built   ' if m.cached else 'to build'}  {m.name}" for m in modules]
    return lines


def progress_bar(elapsed: float, estimate: float | None, done: int, total: int) -> str:
    """One progress line: a bar by time against the estimate (by steps without one)."""
    width = 20
    if estimate:
        filled = min(width, int(width * elapsed / estimate))
        tail = f"{_duration(elapsed)} of about {_duration(estimate)}"
    else:
        filled = width * done // max(1, total)
        tail = _duration(elapsed)
    return f"[{'#' * filled}{'.' * (width - filled)}] {tail}, {done}/{total} steps done"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _named(spec: SpecLike) -> tuple[str, AttentionSpec | SelectRequest]:
    if isinstance(spec, SelectRequest):
        return repr(spec.spec), spec
    if isinstance(spec, AttentionSpec):
        return repr(spec), spec
    if isinstance(spec, str) and spec in PRESETS:
        return spec, PRESETS[spec]
    raise ParamsError(
        f"warmup() takes AttentionSpecs, SelectRequests or preset names "
        f"({', '.join(sorted(PRESETS))}), got {spec!r}"
    )


def _request(
    given: AttentionSpec | SelectRequest, device: torch.device, platform: Platform | str | None
) -> SelectRequest:
    """The request to warm up: warm-up's device and platform fill what the caller left unset."""
    if isinstance(given, AttentionSpec):
        return SelectRequest(given, device=device, platform=platform)
    return replace(
        given,
        device=given.device if given.device is not None else device,
        platform=given.platform if given.platform is not None else platform,
    )


def _check_options(max_workers: object, tick_seconds: object) -> None:
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise InvalidArgumentError(
            f"warmup(max_workers=...) takes a positive int, got {type(max_workers).__name__} "
            f"{max_workers!r}"
        )
    if (
        isinstance(tick_seconds, bool)
        or not isinstance(tick_seconds, (int, float))
        or not (math.isfinite(tick_seconds) and tick_seconds > 0)
    ):
        raise InvalidArgumentError(
            f"warmup(tick_seconds=...) takes a positive number of seconds, got "
            f"{type(tick_seconds).__name__} {tick_seconds!r}"
        )


def warmup_batches(limit: int | None) -> tuple[tuple[int, ...], ...]:
    """Batches that reach every per-batch path: a short one, and one past a fusion limit."""
    short = (8, 3)
    return (short,) if limit is None else (short, (limit + 1, 2))


def _run(name: str, request: SelectRequest, lengths: tuple[int, ...]) -> WarmupStep:
    sel = select_request(request)
    spec = request.spec
    device = torch.device(request.device or "cpu")
    params = FMHAParams.from_lengths(lengths, device=device)
    gen = torch.Generator(device="cpu").manual_seed(len(lengths))
    qkv = torch.randn(params.rows, spec.qkv_width, generator=gen).to(
        device=device, dtype=spec.dtype
    )
    scales = Fp8Scales(1.0, 1.0, 1.0) if spec.is_fp8 else None
    start = time.perf_counter()
    plan = sel.backend.prepare(params)
    sel.backend.forward(qkv, plan, fp8_scales=scales)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return WarmupStep(name, sel.name, lengths, plan.preprocess, time.perf_counter() - start)


def warmup(
    specs: SpecLike | Sequence[SpecLike],
    *,
    device: torch.device | str = "cuda",
    progress: Callable[[str], None] | None = None,
    max_workers: int = 4,
    platform: Platform | str | None = None,
    tick_seconds: float = 15.0,
) -> WarmupReport:
    """Build or load every kernel the given specs (or `SelectRequest`s: a graph-mode request
    warms up the backend ``cuda_graph=True`` selects) use on ``device``; one line per step to
    ``progress`` as it finishes. Raises the error of the first step to fail (a `NoBackendError`
    names every candidate's reasons) after the other steps have finished. ``platform`` overrides the
    detected one (tests run a GPU backend's path over a fake library this way). Before the
    steps it reports the cache location and the modules left to build with an estimate; while
    they run, a progress line every ``tick_seconds``."""
    _check_options(max_workers, tick_seconds)
    items: Sequence[SpecLike] = (
        (specs,) if isinstance(specs, (AttentionSpec, str, SelectRequest)) else specs
    )
    named = [_named(s) for s in items]
    if not named:
        raise ParamsError("warmup() needs at least one spec or preset name")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ParamsError(f"device {device!r} is not a torch device: {exc}") from None
    jobs: list[tuple[str, SelectRequest, tuple[int, ...]]] = []
    modules: dict[str, KernelModule] = {}
    for name, given in named:
        request = _request(given, dev, platform)
        chosen = select_request(request)
        limit = chosen.backend.capabilities.fused_rope_max_seqlen
        jobs += [(name, request, lengths) for lengths in warmup_batches(limit)]
        if isinstance(chosen.backend, PrefillBackend):  # a bare protocol backend lists none
            where = torch.device(request.device or dev)
            for module in chosen.backend.kernel_modules(request.spec, where):
                modules.setdefault(module.name, module)
    found = tuple(modules.values())
    compile_jobs = build_jobs()
    estimate = estimate_build_seconds(found, compile_jobs)
    say = progress if progress is not None else (lambda line: None)
    for line in plan_lines(found, compile_jobs, estimate):
        say(line)
    start = time.perf_counter()
    steps: list[WarmupStep] = []
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(jobs)))) as pool:
        submitted = [pool.submit(_run, name, request, lengths) for name, request, lengths in jobs]
        pending: set[Future[WarmupStep]] = set(submitted)
        failed: BaseException | None = None
        while pending:
            finished, pending = wait(pending, timeout=tick_seconds, return_when=FIRST_COMPLETED)
            # the order of submission among those done at once, so "first error" means it
            for future in sorted(finished, key=submitted.index):
                if future.exception() is not None:
                    failed = failed or future.exception()
                    continue
                step = future.result()
                steps.append(step)
                say(
                    f"[{len(steps)}/{len(jobs)}] {step.spec}: {step.backend}, lengths "
                    f"{','.join(map(str, step.lengths))}, preprocess {step.preprocess}: "
                    f"{step.seconds:.1f} s"
                )
            if pending and not finished:
                say(progress_bar(time.perf_counter() - start, estimate, len(steps), len(jobs)))
        if failed is not None:
            raise failed
    return WarmupReport(str(dev), tuple(steps), time.perf_counter() - start, found, estimate)
