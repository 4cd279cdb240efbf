"""Warm-up: load (and on a new machine compile) every kernel a deployment will use, at start-up.

GPU libraries such as flashinfer compile a kernel module the first time it runs, which takes
minutes; an engine that meets it on its first request times out its health check. `warmup`
selects the backend for each spec, then runs one tiny batch through every path the backend can
take per batch (a backend that fuses RoPE only up to a length also gets a batch past it), so
every module those batches need is built or loaded before traffic arrives. Steps run in
parallel threads, so several compilations proceed at once; a second call finds them cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ._contract import Fp8Scales
from ._errors import ParamsError
from ._params import FMHAParams
from ._platform import Platform
from ._presets import PRESETS
from ._selector import select
from ._spec import AttentionSpec

SpecLike = AttentionSpec | str
"""A spec, or the name of a preset (``attn-backends list`` and the README name them)."""


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


def _named(spec: SpecLike) -> tuple[str, AttentionSpec]:
    if isinstance(spec, AttentionSpec):
        return repr(spec), spec
    if isinstance(spec, str) and spec in PRESETS:
        return spec, PRESETS[spec]
    raise ParamsError(
        f"warmup() takes AttentionSpecs or preset names ({', '.join(sorted(PRESETS))}), "
        f"got {spec!r}"
    )


def warmup_batches(limit: int | None) -> tuple[tuple[int, ...], ...]:
    """Batches that reach every per-batch path: a short one, and one past a fusion limit."""
    short = (8, 3)
    return (short,) if limit is None else (short, (limit + 1, 2))


def _run(
    name: str,
    spec: AttentionSpec,
    device: torch.device,
    lengths: tuple[int, ...],
    platform: Platform | str | None,
) -> WarmupStep:
    sel = select(spec, device=device, platform=platform)
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
) -> WarmupReport:
    """Build or load every kernel the given specs use on ``device``; one line per step to
    ``progress`` as it finishes. Raises the first step's error (a `NoBackendError` names every
    candidate's reasons) after the other steps have finished. ``platform`` overrides the
    detected one (tests run a GPU backend's path over a fake library this way)."""
    named = [_named(s) for s in ((specs,) if isinstance(specs, (AttentionSpec, str)) else specs)]
    if not named:
        raise ParamsError("warmup() needs at least one spec or preset name")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ParamsError(f"device {device!r} is not a torch device: {exc}") from None
    jobs: list[tuple[str, AttentionSpec, tuple[int, ...]]] = []
    for name, spec in named:
        chosen = select(spec, device=dev, platform=platform)
        limit = chosen.backend.capabilities.fused_rope_max_seqlen
        jobs += [(name, spec, lengths) for lengths in warmup_batches(limit)]
    start = time.perf_counter()
    steps: list[WarmupStep] = []
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(jobs)))) as pool:
        futures = [
            pool.submit(_run, name, spec, dev, lengths, platform) for name, spec, lengths in jobs
        ]
        for i, future in enumerate(futures, 1):
            step = future.result()
            steps.append(step)
            if progress is not None:
                progress(
                    f"[{i}/{len(jobs)}] {step.spec}: {step.backend}, lengths "
                    f"{','.join(map(str, step.lengths))}, preprocess {step.preprocess}: "
                    f"{step.seconds:.1f} s"
                )
    return WarmupReport(str(dev), tuple(steps), time.perf_counter() - start)
