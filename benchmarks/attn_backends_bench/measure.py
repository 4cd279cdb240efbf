"""Measuring one workload: build a path, check it against the float64 reference, time it.

`WorkloadRun.check` builds and checks a path without timing it; `WorkloadRun.time` times a
group of checked paths together (interleaved: see `interleave`) and records them. A path
compared with nothing else is a group of one (`measure`, `measure_graph`).

Failure stays local: a path that raises is recorded with its error and the others go on. Only
a CUDA context left unusable by an error stops the workload (`DeviceLost`): every later call
would fail the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from attn_backends import AttentionSpec, FMHAParams, reference_attention
from attn_backends.reference import TOLERANCE, relative_error

from .config import GRAPH_TIMINGS, BenchConfig
from .graphs import (
    Capture,
    capture_cuda,
    capture_graphs,
    check_replay,
    choose_graph_backend,
    open_graph,
)
from .interleave import ROUNDS, TimingPlan, time_interleaved
from .paths import PreparedPath, Skip, Unsupported
from .results import ENGINE_KINDS, Mode, PathKind, PathResult, PathStatus
from .timing import Step, input_set_count, synchronize
from .workloads import Workload

Log = Callable[[str], None]


@dataclass(frozen=True, eq=False)
class Checked:
    """A path built and checked, not yet timed; ``step`` is None when it cannot be timed
    (skipped, failed, not supported)."""

    result: PathResult
    step: Step | None = None


class DeviceLost(Exception):
    """The CUDA context is unusable after an earlier error; nothing more can run."""


def short_error(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def device_usable(device: torch.device) -> bool:
    try:
        synchronize(device)
    except Exception:
        return False
    return True


def free_memory(device: torch.device) -> None:
    """Give cached device memory back; a lost CUDA context has nothing left to give (its
    loss is reported by whoever found it), so its error is not raised again here."""
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError):  # torch.AcceleratorError is one
            torch.cuda.empty_cache()


class WorkloadRun:
    """State of one workload: its batch, reference outputs and input buffers."""

    def __init__(self, work: Workload, config: BenchConfig, device: torch.device, log: Log) -> None:
        self.work = work
        self.config = config
        self.device = device
        self.log = log
        self.spec = work.spec(config.dtype)
        self.lengths = work.lengths(config.seed)
        self.params = FMHAParams.from_lengths(self.lengths, device=device)
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
        self.capture: Capture = capture_cuda

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
        details: Mapping[str, str] | None = None,
    ) -> PathResult:
        """Build, check against the reference, then time alone; failures become records."""
        return self.time([self.check(path, kind, label, build, spec, backend, details)])[0]

    def measure_graph(self, path: str, label: str, backend: str | None) -> PathResult:
        """Open a graph plan, capture, check the replay, then time it alone."""
        return self.time([self.check_graph(path, label, backend)])[0]

    def check(
        self,
        path: str,
        kind: PathKind,
        label: str,
        build: Callable[[], PreparedPath | Skip],
        spec: AttentionSpec | None = None,
        backend: str | None = None,
        details: Mapping[str, str] | None = None,
    ) -> Checked:
        """Build the path and check it against the reference; nothing is timed.

        ``details`` are known before the build (what RoPE a variant runs) and kept when the
        path is skipped; a built path records its own."""
        base = PathResult(
            path=path,
            kind=kind,
            label=label,
            status="error",
            backend=backend,
            details=details or {},
        )
        spec = spec or self.spec
        try:
            prepared = build()
        except Exception as exc:
            return self._failed(base, exc)
        if isinstance(prepared, Skip):
            return Checked(dataclasses.replace(base, status="skipped", note=prepared.reason))
        base = dataclasses.replace(
            base,
            backend=prepared.backend if prepared.backend is not None else base.backend,
            details=prepared.details,
            prepare_ms=prepared.prepare_ms,
            select_ms=prepared.select_ms,
        )
        tolerance = TOLERANCE[spec.dtype]
        try:
            reference = self.reference(spec)
        except Exception as exc:
            return self._failed(base, exc, "the float64 reference failed: ")
        try:
            out = prepared.run(self.check_input.clone())
            error = relative_error(out, reference)
            del out
        except Exception as exc:
            return self._failed(base, exc)
        status: PathStatus = "ok" if error <= tolerance else "wrong"
        note = None if status == "ok" else f"relative error {error:.3g} > tolerance {tolerance}"
        result = dataclasses.replace(
            base, status=status, rel_error=error, tolerance=tolerance, note=note
        )
        sets, run = self.sets, prepared.run
        return Checked(result, lambda i: run(sets[i % len(sets)]))

    def check_graph(self, path: str, label: str, backend: str | None) -> Checked:
        """Select in graph mode, prepare the plan, capture one ``forward`` per buffer, and
        check the replay against the eager graph plan and the reference."""
        base = PathResult(path=path, kind="graph", label=label, status="error", backend=backend)
        try:
            choice = choose_graph_backend(self.spec, self.params, backend)
            if isinstance(choice, Unsupported):
                return Checked(dataclasses.replace(base, status="unsupported", note=choice.reason))
            base = dataclasses.replace(base, backend=choice.name, details=choice.details)
            target = open_graph(choice, self.params)
            if isinstance(target, Unsupported):
                return Checked(dataclasses.replace(base, status="unsupported", note=target.reason))
            base = dataclasses.replace(base, details=target.details)
            reference = self.reference(self.spec)
            graphs = capture_graphs(target, self.check_input, self.sets, self.capture)
            check = check_replay(target, graphs, self.check_input, reference)
        except Exception as exc:
            return self._failed(base, exc)
        tolerance = TOLERANCE[self.spec.dtype]
        problems = []
        if not check.matches_eager:
            problems.append(
                "the replay differs from the eager forward of the same graph plan "
                f"(max |difference| {check.max_abs_diff:.3g})"
            )
        if not check.rel_error <= tolerance:
            problems.append(f"relative error {check.rel_error:.3g} > tolerance {tolerance}")
        result = dataclasses.replace(
            base,
            status="wrong" if problems else "ok",
            rel_error=check.rel_error,
            tolerance=tolerance,
            matches_eager=check.matches_eager,
            note="; ".join(problems) or None,
        )
        return Checked(result, graphs.step)

    def modes_for(self, kind: PathKind) -> tuple[Mode, ...]:
        """The timing modes of a path of ``kind`` in this run."""
        if kind == "graph":
            return GRAPH_TIMINGS
        timed: tuple[Mode, ...] = GRAPH_TIMINGS if kind in ENGINE_KINDS else ("throughput",)
        return tuple(m for m in timed if m in self.config.modes)

    def time(self, group: list[Checked]) -> list[PathResult]:
        """Time the checked paths of ``group`` together, interleaved, and record them."""
        cfg = self.config
        plan = TimingPlan(cfg.iters, cfg.warmup, cfg.host_repeats, len(self.sets), self.device)
        timed = [(c.step, self.modes_for(c.result.kind)) for c in group if c.step is not None]
        if len(timed) > 1:
            self.log(f"  timing {len(timed)} paths interleaved, {ROUNDS} rounds per mode")
        outcomes = iter(time_interleaved(timed, plan))
        results = []
        for c in group:
            result = c.result
            outcome = next(outcomes) if c.step is not None else None
            if isinstance(outcome, Exception):
                result = failed(result, outcome, "while timing: ")
            elif outcome is not None:
                result = dataclasses.replace(
                    result, timing=outcome.throughput, latency=outcome.latency, host=outcome.host
                )
            self._record(result)
            results.append(result)
        broken = [r for r in results if r.status == "error"]
        if broken:
            self._after_error(broken[0])
        return results

    def _failed(self, base: PathResult, exc: Exception, prefix: str = "") -> Checked:
        """A path that failed before timing: stop at once if it broke the device."""
        result = failed(base, exc, prefix)
        if not device_usable(self.device):
            self._record(result)
            self._after_error(result)
        free_memory(self.device)  # what a failed path left behind (an OOM, say)
        return Checked(result)

    def _after_error(self, result: PathResult) -> None:
        if not device_usable(self.device):
            raise DeviceLost(f"CUDA context unusable after {result.path} failed: {result.note}")
        free_memory(self.device)

    def _record(self, result: PathResult) -> None:
        self.paths.append(result)
        status = result.status.upper() if result.status != "ok" else "ok"
        err = f"err {result.rel_error:.1e}" if result.rel_error is not None else ""
        note = ""
        if result.note and result.status != "ok":
            note = " (" + " ".join(result.note.split())[:200] + ")"
        self.log(f"  {result.path:<32} {status:<7} {_timings_text(result)} {err}{note}")


def failed(base: PathResult, exc: Exception, prefix: str = "") -> PathResult:
    """``base`` as an error: the exception's text and the end of its traceback."""
    return dataclasses.replace(
        base, status="error", note=prefix + short_error(exc), traceback=traceback_tail(exc)
    )


def _timings_text(p: PathResult) -> str:
    parts = [f"{p.ms:.4f} ms" if p.ms is not None else "-"]
    if p.latency_ms is not None:
        parts.append(f"latency {p.latency_ms:.4f} ms")
    if p.host_us is not None:
        parts.append(f"host {p.host_us:.1f} us")
    return f"{' '.join(parts):>12}"


def traceback_tail(exc: BaseException, lines: int = 12) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(text.rstrip().splitlines()[-lines:])
