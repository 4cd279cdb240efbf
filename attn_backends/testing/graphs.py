"""Capture a step in a CUDA graph the way torch asks for it, for graph-mode checks and timings.

torch wants a few warm-up runs on a side stream before capture (lazy initialisation, cuBLAS
workspaces, autotuning), then the capture on its own stream. One helper does it for the
conformance suite, the GPU tests and the GPU scripts alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class CapturedGraph:
    """A captured step: replaying it recomputes ``output`` in place."""

    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


def capture_graph(
    step: Callable[[], torch.Tensor], device: torch.device, *, warmup: int = 2
) -> CapturedGraph:
    """Run ``step`` ``warmup`` times on a side stream, then capture it once."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return CapturedGraph(graph, output)
