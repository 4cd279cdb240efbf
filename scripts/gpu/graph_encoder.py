"""Whole-encoder timing, eager vs one CUDA graph per bucket (graph mode), on query-sized batches.

    python3 scripts/gpu/graph_encoder.py OUT.json

For each spec and batch: the eager path an engine runs today (``prepare`` per batch, the model
layer by layer) and graph mode (``plan.update`` per batch, copy the embeddings into the static
buffer, ``replay``), each timed with a host sync around every batch (latency, what one request
sees), median of ``ITERS``. The replayed output is compared with the eager one first.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import attn_backends as ab
from attn_backends.testing.graphs import capture_graph
from tests.gpu.tiny_encoder import TinyEncoder, embeddings

ITERS = 50
LAYERS = 24
HIDDEN = 1024
SPECS = {
    "bge-m3-like d64 bidir": ab.AttentionSpec(16, 16, 64, torch.bfloat16, causal=False),
    "qwen3-like d128 causal rope": ab.AttentionSpec(
        16, 8, 128, torch.bfloat16, True, rope=ab.RopeSpec(1e6)
    ),
}
BUCKET = ab.GraphBucket(max_tokens=512, max_batch=16)
BATCHES = [(16,), (9, 40, 3, 17), (8, 64, 8, 33) * 4]


def _median_ms(step: Callable[[], object], iters: int = ITERS) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@dataclass
class Captured:
    """A model captured on a bucket's plan: the graph, its static input and output."""

    model: TinyEncoder
    plan: ab.GraphPlan
    graph: torch.cuda.CUDAGraph
    static: torch.Tensor
    output: torch.Tensor

    @classmethod
    def capture(cls, model: TinyEncoder, device: torch.device) -> Captured:
        plan = model.backend.prepare_graph(BUCKET, device=device)
        rows = BUCKET.max_tokens
        plan.update(ab.FMHAParams.from_lengths(BATCHES[0], device=device, padded_rows=rows))
        static = embeddings(BATCHES[0], rows, model.hidden, model.spec.dtype, device)
        captured = capture_graph(lambda: model(static, plan), device)
        return cls(model, plan, captured.graph, static, captured.output)

    def measure(self, lengths: tuple[int, ...], device: torch.device) -> dict[str, object]:
        model, plan = self.model, self.plan
        tokens = sum(lengths)
        rows = BUCKET.max_tokens
        params = ab.FMHAParams.from_lengths(lengths, device=device, padded_rows=rows)
        fresh = embeddings(lengths, rows, model.hidden, model.spec.dtype, device)

        def replay() -> None:
            plan.update(params)
            self.static.copy_(fresh)
            self.graph.replay()

        def eager() -> torch.Tensor:
            own = ab.FMHAParams.from_lengths(lengths, device=device)
            return model(fresh[:tokens].clone(), model.backend.prepare(own))

        replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(self.output[:tokens], model(fresh.clone(), plan)[:tokens]))
        err = ab.reference.relative_error(self.output[:tokens].float(), eager().float())
        eager_ms, graph_ms = _median_ms(eager), _median_ms(replay)
        return {
            "backend": model.backend.name,
            "lengths": list(lengths),
            "tokens": tokens,
            "replay_equals_eager_same_plan": same,
            "relative_error_vs_per_batch_plan": err,
            "eager_ms": eager_ms,
            "graph_ms": graph_ms,
            "speedup": eager_ms / graph_ms,
        }


def main(out: Path) -> None:
    device = torch.device("cuda")
    rows: list[dict[str, object]] = []
    for name, spec in SPECS.items():
        captured = Captured.capture(TinyEncoder.build(spec, LAYERS, HIDDEN, device), device)
        for lengths in BATCHES:
            row = {"spec": name, "layers": LAYERS, "hidden": HIDDEN}
            row.update(captured.measure(lengths, device))
            print(json.dumps(row))
            rows.append(row)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
