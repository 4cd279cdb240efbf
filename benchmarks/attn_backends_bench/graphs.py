"""Graph replay: the public API's ``forward`` captured in a CUDA graph once, then replayed.

What an engine that captures its layers sees per call: no Python at all, only the replay. The
path selects with ``cuda_graph=True``, prepares a graph plan for a bucket of exactly this batch
(``max_tokens`` = the batch's tokens, so the replay does the eager work and no padding), plans
the batch into it (``update``), then captures one ``forward`` per input buffer. Before it is
timed, the replay of a copy of the check input must equal, bit for bit, the eager ``forward``
of the same graph plan on the same input, and be within tolerance of the float64 reference.

A backend without graph mode, or whose RoPE pass cannot be replayed, is recorded as not
supported, with its reasons. Capture is a parameter (`Capture`) so that everything but the CUDA
graph itself runs on a CPU in tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from attn_backends import AttentionSpec, FMHAParams, GraphBucket, GraphPlan, NoBackendError, select
from attn_backends.errors import GraphModeError
from attn_backends.plugin import PrefillBackend, ReasonCode
from attn_backends.reference import relative_error

from .paths import Unsupported, refusal_text, with_batch_preprocess
from .timing import synchronize

CAPTURE_WARMUP = 3
"""Eager calls on a side stream before capture, as torch's CUDA-graph notes advise."""


class Replayable(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], torch.Tensor], torch.device], tuple[Replayable, torch.Tensor]]
"""``capture(fn, device) -> (graph, static output)``: record ``fn`` once for replays."""


@dataclass(frozen=True, eq=False)
class GraphTarget:
    """A graph plan holding the batch, and the backend that captures ``forward`` with it."""

    name: str
    backend: PrefillBackend
    plan: GraphPlan
    details: dict[str, str]


def bucket_for(params: FMHAParams) -> GraphBucket:
    """A bucket of exactly this batch: its tokens, sequences and longest sequence."""
    return GraphBucket(
        max_tokens=params.token_q_num,
        max_batch=params.batch_size,
        max_seqlen=params.max_seqlen_q,
    )


def graph_refusal_text(exc: NoBackendError) -> str:
    """Why no backend serves graph mode here: the reasons of those that declare graph mode,
    then the names of those that do not (their reasons would only say so)."""
    capable: list[str] = []
    without: list[str] = []
    for name, reasons in exc.reasons:
        if any(r.code == ReasonCode.CUDA_GRAPH for r in reasons):
            without.append(name)
        else:
            capable.append(f"{name}: " + "; ".join(map(str, reasons)))
    parts = capable or ["no registered backend declares graph mode"]
    if without:
        parts.append(f"without graph mode: {', '.join(without)}")
    return " | ".join(parts)


@dataclass(frozen=True, eq=False)
class GraphChoice:
    """The backend graph mode selected, before its plan is prepared."""

    name: str
    backend: PrefillBackend
    details: dict[str, str]


def choose_graph_backend(
    spec: AttentionSpec, params: FMHAParams, backend: str | None
) -> GraphChoice | Unsupported:
    """Select in graph mode: ``backend``, or the automatic choice."""
    try:
        selection = select(
            spec, device=params.device, backend=backend, strict=False, cuda_graph=True
        )
    except NoBackendError as exc:
        return Unsupported(
            refusal_text(exc, backend) if backend is not None else graph_refusal_text(exc)
        )
    impl = selection.backend
    if not isinstance(impl, PrefillBackend):
        return Unsupported(f"{selection.name} is not a PrefillBackend: it has no prepare_graph")
    details = dict(selection.details)
    details["selected_by"] = selection.source
    return GraphChoice(selection.name, impl, details)


def open_graph(choice: GraphChoice, params: FMHAParams) -> GraphTarget | Unsupported:
    """Prepare a graph plan for a bucket of exactly this batch and plan the batch into it.

    A `GraphModeError` (the backend cannot serve graph mode for this spec here) is
    `Unsupported`; any other failure propagates, to be recorded as the path's error."""
    bucket = bucket_for(params)
    try:
        plan = choice.backend.prepare_graph(bucket, device=params.device)
    except GraphModeError as exc:
        return Unsupported(str(exc))
    batch = FMHAParams.from_lengths(
        params.input_lengths, device=params.device, padded_rows=bucket.max_tokens
    )
    plan.update(batch)
    details = with_batch_preprocess(choice.details, plan.preprocess)
    details["bucket"] = ", ".join(f"{k}={v}" for k, v in bucket.to_dict().items())
    return GraphTarget(choice.name, choice.backend, plan, details)


def capture_cuda(
    fn: Callable[[], torch.Tensor], device: torch.device
) -> tuple[Replayable, torch.Tensor]:
    """Warm ``fn`` up on a side stream, then capture one call in a CUDA graph."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(CAPTURE_WARMUP):
            fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@dataclass(frozen=True, eq=False)
class CapturedGraphs:
    """One captured ``forward`` on a copy of the check input, and one per timing buffer.

    It holds the target: the captured kernels read the graph plan's fixed device buffers
    (offsets, the kernel's workspace), which must live as long as the graphs are replayed."""

    target: GraphTarget
    check_buffer: torch.Tensor
    check: Replayable
    check_output: torch.Tensor
    replays: tuple[Replayable, ...]

    def step(self, i: int) -> None:
        """Replay the graph of input set ``i`` (rotating through the sets, like eager calls)."""
        self.replays[i % len(self.replays)].replay()


def capture_graphs(
    target: GraphTarget,
    check_input: torch.Tensor,
    sets: Sequence[torch.Tensor],
    capture: Capture,
) -> CapturedGraphs:
    forward = target.backend.forward
    device = check_input.device
    check_buffer = check_input.clone()
    check, check_output = capture(functools.partial(forward, check_buffer, target.plan), device)
    replays = tuple(
        capture(functools.partial(forward, buffer, target.plan), device)[0] for buffer in sets
    )
    return CapturedGraphs(target, check_buffer, check, check_output, replays)


@dataclass(frozen=True)
class ReplayCheck:
    matches_eager: bool
    """The replayed valid rows equal the eager output of the same graph plan, bit for bit."""
    max_abs_diff: float
    """Largest difference between replay and eager (0.0 when they match)."""
    rel_error: float
    """Of the replay against the float64 reference."""


def check_replay(
    target: GraphTarget,
    graphs: CapturedGraphs,
    check_input: torch.Tensor,
    reference: torch.Tensor,
) -> ReplayCheck:
    """Eager ``forward`` of the graph plan on a copy of the input, against a replay on another."""
    valid = target.plan.token_q_num
    eager = target.backend.forward(check_input.clone(), target.plan)[:valid].clone()
    graphs.check_buffer.copy_(check_input)  # the warm-up and capture rotated it
    graphs.check.replay()
    synchronize(check_input.device)
    replayed = graphs.check_output[:valid]
    same = torch.equal(replayed, eager)
    diff = 0.0 if same else float((replayed.float() - eager.float()).abs().max())
    return ReplayCheck(same, diff, relative_error(replayed, reference))
