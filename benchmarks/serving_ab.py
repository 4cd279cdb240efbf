"""Padded sdpa and the library's packed path of one model, timed in alternating rounds.

`serving_bench.py` times each path in one block, so a drift of the machine between blocks
(clocks, a neighbour on the host) lands in the ratio. Here the two paths alternate, round by
round, in one process; each round takes the median of ``--repeats`` encodes (synchronised per
call) and the report keeps each path's best round. Run it once per code tree in one session
to compare trees (``--label`` names the tree in the JSON lines it prints), e.g.::

    python3 benchmarks/serving_ab.py --label new --workloads "documents,queries 8"
    PYTHONPATH=/tmp/old:/tmp/old/plugins python3 benchmarks/serving_ab.py --label old ...

The packed path drops the shared layouts before every encode, as `serving_bench.py` does (each
batch pays for its boundaries as a batch of new lengths does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_bench as bench


def _round(encode: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``repeats`` encodes, each synchronised."""
    return statistics.median(bench.synchronised_ms(encode, repeats, device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="this tree", help="names the code tree in the output")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    bench.add_one_model_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    device = torch.device(args.device)
    import attn_backends

    for workload, padded, packed, _ in bench.one_model_workloads(parser, args):
        for encode in (padded, packed, padded, packed):  # warm-up, both paths
            encode()
        rounds: dict[str, list[float]] = {"padded": [], "packed": []}
        for _ in range(args.rounds):
            rounds["padded"].append(_round(padded, args.repeats, device))
            rounds["packed"].append(_round(packed, args.repeats, device))
        best = {name: min(values) for name, values in rounds.items()}
        print(
            json.dumps(
                {
                    "label": args.label,
                    "library": str(Path(attn_backends.__file__).parent),
                    "model": args.model,
                    "workload": workload,
                    "padded_ms": round(best["padded"], 3),
                    "packed_ms": round(best["packed"], 3),
                    "packed_over_padded": round(best["packed"] / best["padded"], 3),
                    "rounds_ms": {k: [round(v, 3) for v in vs] for k, vs in rounds.items()},
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
