"""Timing paths that are compared with each other interleaved, so drift cannot take sides.

The GPU's clock and the host's caches drift over seconds: on an H200 the first path timed after
a pause ran 8% faster than the same kernels a second later. Paths timed one after the other
would carry that drift into a ratio whose target is 5%. So the paths of one comparison (the
public API, the raw kernel, the API's graph replay) are timed in rounds: each round times a
block of calls of every path, in alternating order (A B C, then C B A), and each path's
samples of all rounds make its median. Host mode alternates its repeats the same way. A path
timed alone takes one round: the calls and samples of `timing.time_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .results import HostTiming, Mode, Timing
from .timing import (
    Step,
    event_block,
    host_block,
    host_calls,
    host_timing,
    latency_block,
    summarize,
    warm,
)

ROUNDS = 5
"""Rounds per mode when several paths are compared."""


@dataclass(frozen=True)
class Timings:
    """One path's timings in each mode it was timed in (None: not timed in that mode)."""

    throughput: Timing | None = None
    latency: Timing | None = None
    host: HostTiming | None = None


@dataclass(frozen=True)
class TimingPlan:
    """How much to time: the run's settings."""

    iters: int
    warmup: int
    host_repeats: int
    input_sets: int
    device: torch.device


def alternating(members: Sequence[int], rounds: int) -> list[list[int]]:
    """The order of ``members`` in each of ``rounds`` rounds: forward, backward, forward..."""
    forward = list(members)
    return [forward if r % 2 == 0 else forward[::-1] for r in range(rounds)]


@dataclass
class _Member:
    step: Step
    modes: tuple[Mode, ...]
    next_call: int = 0
    """Index of the next call (the input set rotates with it)."""
    failure: Exception | None = None
    samples: dict[Mode, list[float]] = field(default_factory=dict)
    host_elapsed: list[float] = field(default_factory=list)

    def take(self, count: int) -> int:
        """Reserve the next ``count`` call indices; returns the first."""
        first = self.next_call
        self.next_call += count
        return first


def _block(member: _Member, mode: Mode, count: int, plan: TimingPlan) -> None:
    warm(member.step, first=member.take(plan.warmup), count=plan.warmup)
    first = member.take(count)
    sampler = event_block if mode == "throughput" else latency_block
    samples = sampler(member.step, first=first, count=count, device=plan.device)
    member.samples.setdefault(mode, []).extend(samples)


def _timed_rounds(members: list[_Member], mode: Mode, plan: TimingPlan) -> None:
    index = [i for i, m in enumerate(members) if mode in m.modes]
    rounds = ROUNDS if len(index) > 1 else 1
    per_round = math.ceil(plan.iters / rounds)
    for order in alternating(index, rounds):
        for i in order:
            member = members[i]
            if member.failure is not None:
                continue
            try:
                _block(member, mode, per_round, plan)
            except Exception as exc:  # recorded as the path's error; the others go on
                member.failure = exc


def _host_repeats(members: list[_Member], plan: TimingPlan) -> None:
    index = [i for i, m in enumerate(members) if "host" in m.modes]
    calls = host_calls(plan.iters)
    for i in index:
        member = members[i]
        try:
            warm(member.step, first=member.take(plan.warmup), count=plan.warmup)
        except Exception as exc:
            member.failure = exc
    for order in alternating(index, plan.host_repeats):
        for i in order:
            member = members[i]
            if member.failure is not None:
                continue
            try:
                first = member.take(calls)
                member.host_elapsed.append(
                    host_block(member.step, first=first, calls=calls, device=plan.device)
                )
            except Exception as exc:
                member.failure = exc


def time_interleaved(
    paths: Sequence[tuple[Step, tuple[Mode, ...]]], plan: TimingPlan
) -> list[Timings | Exception]:
    """Time each ``(step, modes)`` in its modes, interleaved with the others; per path its
    `Timings`, or the exception that stopped it."""
    if plan.iters < 1:
        raise ValueError(f"iters must be >= 1, got {plan.iters}")
    members = [_Member(step, modes) for step, modes in paths]
    for mode in ("throughput", "latency"):
        _timed_rounds(members, mode, plan)
    _host_repeats(members, plan)
    out: list[Timings | Exception] = []
    for m in members:
        if m.failure is not None:
            out.append(m.failure)
            continue

        def summary(mode: Mode, member: _Member = m) -> Timing | None:
            samples = member.samples.get(mode)
            if not samples:
                return None
            return summarize(samples, warmup=plan.warmup, input_sets=plan.input_sets)

        host = host_timing(m.host_elapsed, host_calls(plan.iters)) if m.host_elapsed else None
        out.append(Timings(summary("throughput"), summary("latency"), host))
    return out
